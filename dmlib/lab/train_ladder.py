"""Dataset ``step_ladder``: a short fine-tune of the real all-MiniLM-L6-v2, several ways.

Every run starts from the same packaged weights, sees the same fixed sentence pairs in
the same order and takes the same AdamW steps on a cosine-similarity regression
objective; nothing is random. The runs differ only in a real source of floating-point
nondeterminism of CPU training:

- ``repeat``: nothing (the same configuration in a new process; whether it comes out
  bit-identical on the machine at hand is measured and recorded, not assumed),
- ``microbatch``: the gradient accumulated over two micro-batches instead of one batch
  (the same sum, added in a different order),
- ``threads2``: ``torch.set_num_threads(2)`` instead of 1 (work split across threads),
- ``isa_default``: ``ATEN_CPU_CAPABILITY=default``, so ATen's vectorised kernels run their
  scalar builds instead of the widest instruction set the CPU has (different reduction
  widths, hence different summation orders).

Each run is its own process. Only biases and LayerNorm parameters are saved (the
figures need no more), at a ladder of steps, as burnpack files with Burn's conventions:
a scalar ``step`` (UInt) holding the step actually reached, per-process ``param_id``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dmlib.lab import _proc

DATASET = "step_ladder"
STEPS = (0, 1, 2, 5, 10, 20, 30)
SMALL_STEPS = (0, 1, 2)
LR = 2e-5
WEIGHT_DECAY = 0.01

# (sentence a, sentence b, target cosine similarity): a fixed, hand-written batch
PAIRS: tuple[tuple[str, str, float], ...] = (
    ("A man is playing a guitar.", "A person plays an instrument.", 0.8),
    ("The cat sleeps on the sofa.", "A kitten is napping on a couch.", 0.9),
    ("Stock markets fell sharply today.", "A child is riding a bicycle.", 0.0),
    ("She is cooking pasta for dinner.", "A woman prepares a meal.", 0.7),
    ("The train leaves at noon.", "Rain is expected tomorrow.", 0.1),
    ("Two dogs run across a field.", "Dogs are running outside.", 0.85),
    ("He repaired the old car engine.", "The bakery sells fresh bread.", 0.05),
    ("The committee approved the budget.", "The budget was accepted by the board.", 0.75),
)

# name -> regex over parameter names, for the figures
GROUPS = {
    "attention.key.bias": r"attention\.self\.key\.bias$",
    "attention.query.bias": r"attention\.self\.query\.bias$",
    "attention.value.bias": r"attention\.self\.value\.bias$",
    "dense.bias": r"(attention\.output|intermediate|output)\.dense\.bias$",
    "LayerNorm": r"LayerNorm\.(weight|bias)$",
}
SAVED = re.compile(r"(\.bias|LayerNorm\.weight)$")

# label -> (variant description, extra worker arguments, environment)
RUNS: dict[str, tuple[str, list[str], dict[str, str]]] = {
    "base": ("one batch of 8 pairs, 1 thread, native instruction set", [], {}),
    "repeat": ("the base configuration again, in a new process", [], {}),
    "microbatch": (
        "gradient accumulated over 2 micro-batches of 4 pairs (loss scaled by 1/2 each) "
        "instead of one batch of 8",
        ["--microbatches", "2"],
        {},
    ),
    "threads2": ("torch.set_num_threads(2) instead of 1", ["--threads", "2"], {}),
    "isa_default": (
        "ATEN_CPU_CAPABILITY=default: ATen's non-vectorised kernels instead of the native ones",
        [],
        {"ATEN_CPU_CAPABILITY": "default"},
    ),
}
SMALL_RUNS = ("base", "repeat")


# ----------------------------------------------------------------------------- worker


def _train(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from dmlib.io.burnpack import BurnTensor, write_burnpack
    from dmlib.lab.minilm import load_minilm, mean_pool, tokenize

    torch.set_num_threads(a.threads)
    pairs = PAIRS[: a.pairs]
    model = load_minilm()
    model.train()  # the module has no dropout: train() changes nothing in the forward pass
    names = [n for n, _ in model.named_parameters() if SAVED.search(n)]
    params = dict(model.named_parameters())
    # Burn draws parameter ids per process from an unseeded source
    ids = {n: int.from_bytes(os.urandom(8), "little") for n in names}
    texts = [p[0] for p in pairs] + [p[1] for p in pairs]
    width = int(tokenize(texts)["input_ids"].shape[1])  # one width for every micro-batch
    target = torch.tensor([p[2] for p in pairs], dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    meta = {
        "format": "burnpack",
        "producer": "dmlib.lab.train_ladder",
        "label": a.label,
        "threads": str(torch.get_num_threads()),
        "microbatches": str(a.microbatches),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }
    files: dict[str, str] = {}

    def save(step: int) -> None:
        rel = f"{a.label}/step{step:02d}.bpk"
        tensors = {n: BurnTensor(params[n].detach().numpy().copy(), param_id=ids[n]) for n in names}
        write_burnpack(
            a.out / rel,
            tensors,
            metadata=meta,
            scalars={"step": step},
            scalar_kinds={"step": "UInt"},
        )
        files[str(step)] = rel

    (a.out / a.label).mkdir(parents=True, exist_ok=True)
    chunks = np.array_split(np.arange(len(pairs)), a.microbatches)
    losses: list[float] = []
    grad_norms: dict[str, float] = {}
    if 0 in a.save:
        save(0)
    for step in range(1, a.steps + 1):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for idx in chunks:
            sel = [texts[i] for i in idx] + [texts[len(pairs) + i] for i in idx]
            batch = tokenize(sel, pad_to=width)
            emb = mean_pool(model(**batch), batch["attention_mask"])
            k = len(idx)
            cos = F.cosine_similarity(emb[:k], emb[k:], dim=1)
            # the mean over a chunk times its share of the batch: the chunks sum to the batch mean
            loss = F.mse_loss(cos, target[idx]) * (k / len(pairs))
            loss.backward()
            total += float(loss.detach())
        if step == 1:  # how large each saved parameter's computed gradient is
            grad_norms = {n: float(params[n].grad.norm()) for n in names}  # type: ignore[union-attr]
        opt.step()
        losses.append(total)
        if step in a.save:
            save(step)
    return {
        "label": a.label,
        "pid": os.getpid(),
        "files": files,
        "loss": losses,
        "grad_norm_step1": grad_norms,
        "threads": torch.get_num_threads(),
        "cpu_capability": meta["cpu_capability"],
        "microbatches": a.microbatches,
    }


def worker(argv: Sequence[str]) -> dict[str, Any]:
    """One process: the fine-tune ``argv`` describes, its checkpoints saved; returns its report."""
    ap = argparse.ArgumentParser(prog="python -m dmlib.lab.train_ladder --worker")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", type=Path, required=True, help="dataset folder")
    ap.add_argument("--steps", type=int, default=max(STEPS))
    ap.add_argument("--save", type=lambda s: {int(x) for x in s.split(",")}, default=set(STEPS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--pairs", type=int, default=len(PAIRS))
    return _train(ap.parse_args(argv))


# ----------------------------------------------------------------------------- dataset

DESCRIPTION = (
    "A 30-step AdamW fine-tune (cosine-similarity regression on 8 fixed sentence pairs, no "
    "dropout, nothing random) of the real all-MiniLM-L6-v2, run as separate processes that differ "
    "only in a real source of CPU floating-point nondeterminism: a repeat of the base run, "
    "gradient accumulation over 2 micro-batches, 2 threads instead of 1, and "
    "ATEN_CPU_CAPABILITY=default instead of the native instruction set. Biases and LayerNorm "
    "parameters at steps 0, 1, 2, 5, 10, 20, 30, with the step reached as the scalar 'step'."
)


def _rel_fro(a: np.ndarray, b: np.ndarray) -> float:
    a64 = a.astype(np.float64)
    den = np.linalg.norm(a64)
    return float(np.linalg.norm(b.astype(np.float64) - a64) / den) if den else float("nan")


def _summary(ds: Path, runs: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Per run and step against ``base``: slots differing, worst tensor, top movers."""
    from dmlib import load

    out: dict[str, Any] = {}
    for label, files in runs.items():
        if label == "base":
            continue
        rows = {}
        for step, rel in files.items():
            a, b = load(ds / runs["base"][step]), load(ds / rel)
            moved = sorted(((_rel_fro(a[n], b[n]), n) for n in a), reverse=True)
            rows[step] = {
                "slots_differing": sum(int((a[n] != b[n]).sum()) for n in a),
                "slots": sum(a[n].size for n in a),
                "top_movers": [[n, r] for r, n in moved[:5]],
            }
        out[label] = rows
    return out


def generate(out_dir: Path, *, small: bool = False) -> dict[str, Any]:
    """Run every fine-tune of the dataset, each in its own process, into ``out_dir/step_ladder/``.

    ``small``: the base run and its repeat only, 2 steps on 4 pairs (smoke tests).
    Returns the manifest section: name, description, command, files (relative to ``out_dir``).
    """
    from dmlib import _atomic

    out_dir = Path(out_dir)
    ds = out_dir / DATASET
    ds.mkdir(parents=True, exist_ok=True)
    for old in [
        *(f for lab in RUNS for f in (ds / lab).glob("step*.bpk")),
        ds / "index.json",
        ds / "README.md",
    ]:
        old.unlink(missing_ok=True)  # a previous run's files
    steps = SMALL_STEPS if small else STEPS
    extra = ["--steps", str(max(steps)), "--save", ",".join(map(str, steps))]
    extra += ["--pairs", "4"] if small else []
    reports = {}
    for label in SMALL_RUNS if small else RUNS:
        _, args, env = RUNS[label]
        env = {"ATEN_CPU_CAPABILITY": "", **env}  # the native choice unless the run sets one
        reports[label] = _proc.run_worker(
            "dmlib.lab.train_ladder",
            ["--label", label, "--out", str(ds), *args, *extra],
            env=env,
            timeout=900,
        )
    runs = {lab: r["files"] for lab, r in reports.items()}
    summary = _summary(ds, runs)
    index = {
        "runs": runs,
        "base": "base",
        "repeat": "repeat",
        "variants": {lab: RUNS[lab][0] for lab in runs if lab not in ("base", "repeat")},
        "groups": GROUPS,
        "steps": list(steps),
        "optimizer": {"name": "AdamW", "lr": LR, "weight_decay": WEIGHT_DECAY},
        "config": {
            lab: {k: r[k] for k in ("threads", "cpu_capability", "microbatches", "pid")}
            for lab, r in reports.items()
        },
        "loss": {lab: r["loss"] for lab, r in reports.items()},
        "grad_norm_step1": reports["base"]["grad_norm_step1"],
        "repeat_bit_identical": all(
            row["slots_differing"] == 0 for row in summary["repeat"].values()
        ),
        "summary": summary,
    }
    _atomic.atomic_write_text(ds / "index.json", json.dumps(index, indent=1) + "\n")
    _atomic.atomic_write_text(ds / "README.md", _readme(index, small))
    files = sorted(
        str(f.relative_to(out_dir))
        for f in ds.rglob("*")
        if f.is_file() and not f.name.startswith(".")
    )
    return {
        "name": DATASET,
        "description": ("Smoke-test copy (base and repeat, 2 steps on 4 pairs). " if small else "")
        + DESCRIPTION,
        "command": "python -m dmlib.lab step_ladder --out data" + (" --small" if small else ""),
        "files": files,
    }


def _readme(index: dict[str, Any], small: bool) -> str:
    from dmlib.lab.manifest import describe_machine, environment

    cfg = "\n".join(
        f"| {lab} | {c['threads']} | {c['microbatches']} | {c['cpu_capability']} | {RUNS[lab][0]} |"
        for lab, c in index["config"].items()
    )
    rows = []
    for lab, by_step in index["summary"].items():
        for step, r in by_step.items():
            name, rel = r["top_movers"][0]
            mover = f"`{name}`" if rel > 0 else "none"
            rows.append(
                f"| {lab} | {step} | {r['slots_differing']} / {r['slots']} | {mover} | {rel:.3e} |"
            )
    key = [
        v for n, v in index["grad_norm_step1"].items() if re.search(GROUPS["attention.key.bias"], n)
    ]
    rest = [
        v
        for n, v in index["grad_norm_step1"].items()
        if not re.search(GROUPS["attention.key.bias"], n)
    ]
    table = "\n".join(rows)
    what = "Smoke-test copy: base and repeat only, 2 steps on 4 pairs." if small else DESCRIPTION
    return f"""# step_ladder: one fine-tune, several processes

{what}

Generated by `python -m dmlib.lab step_ladder --out data`{" (small)" if small else ""}; each run
is its own process (`python -m dmlib.lab.train_ladder --worker ...`). Files:
`<run>/stepNN.bpk`, one per saved step; `index.json` maps run -> step -> file and holds the
groups (regexes over parameter names) the figures use. Tensor names are the PyTorch names of
the module (`encoder.layer.{{i}}.attention.self.key.bias` ...); LayerNorm parameters keep
PyTorch's `weight`/`bias`.

| run | threads | micro-batches | ATen CPU capability | what differs |
|---|---|---|---|---|
{cfg}

## What the files hold (computed from them when generated)

Made on {describe_machine(environment())}.
Repeat bit-identical to base at every saved step: **{index["repeat_bit_identical"]}**.

| run | step | slots differing from base | fastest mover | its relative Frobenius delta |
|---|---|---|---|---|
{table}

Computed gradient norms at step 1 (base run): attention key biases median
{np.median(key) if key else float("nan"):.2e}, every other saved parameter median
{np.median(rest) if rest else float("nan"):.2e}. Softmax is invariant to adding the same
number to every score of a row, and a key bias adds `q . b` to every score of a query's row,
so its true gradient is zero; what is computed is rounding noise, which AdamW normalises into
steps of about the learning rate, on tensors of small norm.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: with ``--worker``, run one process and print its report as JSON;
    without it, print the usage and return 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" not in argv:
        print(
            "usage: python -m dmlib.lab.train_ladder --worker --label L --out DIR [...]",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(worker(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
