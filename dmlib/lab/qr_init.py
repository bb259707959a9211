"""Dataset ``qr_init``: one seeded model initialisation, saved by several processes.

Every factorised projection ``blocks.{i}.proj`` is ``u diag(s) v^T`` with ``u`` and ``v``
the Q of a Householder QR of a seeded standard-normal matrix (rank 64); every other
parameter is drawn directly from the same seeded ``numpy.random.Generator``.

The QR's reductions (the column and reflector norms, and the dot products ``v^T R`` and
``v^T Q`` of the two rank-1 updates) go through a per-process :class:`Autotuner`, the way
a GPU autotuner picks a kernel: on the first use of a *shape key* (the operation and its
reduction length rounded up to a multiple of :data:`BUCKET`) it runs a timing race among
:data:`CANDIDATES`, all valid sums that add in different orders, and caches the winner for
the rest of the process. The race is modelled by an unseeded draw (``os.urandom``): the
usual winner wins with probability :data:`WIN_PROB`, otherwise one of the others does.
Reduction lengths shrink with the column index ``j`` (``m - j``), so two processes agree
bit for bit up to the first column whose shape key they tuned differently, and differ by a
few float32 ULP from there on, the 64 sequential Householder iterations carrying the
difference into every later column. Direct draws never pass through a reduction and are
bit-identical across same-seed processes.

Files are written with Burn's conventions: each parameter gets a ``param_id`` drawn from
an unseeded source, so same-seed files differ as files even when every tensor agrees.

Run ``python -m dmlib.lab.qr_init --worker --seed 7 --label p1 --out DIR`` for one process
(``DMLIB_QR_AUTOTUNE='{"cache": {...}}'`` replays a recorded cache); :func:`generate` runs
all of them, each as its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dmlib.lab import _proc
from dmlib.lab.autotune import (  # noqa: F401  (re-exported: the dataset's public mechanism)
    BUCKET,
    CANDIDATES,
    ENV_TUNE,
    OPS,
    PROCESS_TUNER,
    PROCESS_TUNER_SOURCE,
    USUAL_WINNER,
    WIN_PROB,
    Autotuner,
    blocked_sum,
    householder_qr,
    reduce_sum,
    shape_key,
)
from dmlib.lab.records import RECORDS_FILE, RECORDS_MODEL_FILE, write_checkpoint  # noqa: F401

DATASET = "qr_init"
RANK = 64
# ----------------------------------------------------------------------------- the model


def model_shapes(small: bool = False) -> dict[str, Any]:
    """Sizes of the model: ``n_blocks`` factorised blocks of width ``d``."""
    # d = 100 is not a multiple of 64 floats, so LayerNorm vectors leave inter-tensor padding
    return {"n_blocks": 2 if small else 8, "d": 100, "vocab": 300, "classes": 37}


def init_model(
    seed: int, *, small: bool = False, tuner: Autotuner | None = None
) -> dict[str, np.ndarray]:
    """Every parameter in module-visitor (disk) order, float32.

    The seeded generator is consumed in one fixed order whatever the QR does, so the
    direct draws depend on ``seed`` alone.
    """
    sh = model_shapes(small)
    d, rng = sh["d"], np.random.default_rng(seed)
    f32 = np.float32
    out: dict[str, np.ndarray] = {"embed.weight": rng.standard_normal((sh["vocab"], d), f32)}
    for i in range(sh["n_blocks"]):
        p = f"blocks.{i}"
        out[f"{p}.norm.gamma"] = f32(1) + f32(0.1) * rng.standard_normal(d, f32)
        out[f"{p}.norm.beta"] = f32(0.1) * rng.standard_normal(d, f32)
        out[f"{p}.proj.u"] = householder_qr(rng.standard_normal((d, RANK), f32), tuner=tuner)[0]
        out[f"{p}.proj.s"] = rng.uniform(0.5, 1.5, RANK).astype(f32)
        out[f"{p}.proj.v"] = householder_qr(rng.standard_normal((d, RANK), f32), tuner=tuner)[0]
    bound = f32(1 / np.sqrt(d))
    out["head.weight"] = bound * rng.standard_normal((d, sh["classes"]), f32)  # Burn: [d_in, d_out]
    out["head.bias"] = rng.uniform(-bound, bound, sh["classes"]).astype(f32)
    return out


def _param_ids(names: Sequence[str]) -> dict[str, int]:
    # Burn draws parameter ids per process from an unseeded source: never from the seed
    return {n: int.from_bytes(os.urandom(8), "little") for n in names}


def strategy(tuner: Autotuner, source: str) -> dict[str, Any]:
    """What a process's tuner decided, for index.json: enough to replay it (``cache``)."""
    return {
        "reduction": "autotuned",
        "bucket": tuner.bucket,
        "win_prob": tuner.win_prob,
        "usual_winner": USUAL_WINNER,
        "source": source,
        "cache": dict(tuner.cache),
        "not_usual": {k: v for k, v in tuner.cache.items() if v != USUAL_WINNER},
    }


def _metadata(label: str, seed: int, tuner: Autotuner, source: str) -> dict[str, str]:
    off = " ".join(f"{k}={v}" for k, v in tuner.cache.items() if v != USUAL_WINNER)
    return {
        "format": "burnpack",
        "producer": "dmlib.lab.qr_init",
        "label": label,
        "seed": str(seed),
        "qr_reduction": f"autotuned per shape key (op:length rounded up to {tuner.bucket}), "
        f"usual winner {USUAL_WINNER} with probability {tuner.win_prob}",
        "qr_autotune_source": source,
        "qr_autotune_cache": tuner.summary(),
        "qr_autotune_not_usual": off or "none",
    }


def write_model(
    path: Path, params: dict[str, np.ndarray], ids: dict[str, int], meta: dict[str, str]
) -> None:
    """A plain single-record burnpack file with Burn's writer (zero padding)."""
    from dmlib.io.burnpack import BurnTensor, write_burnpack

    write_burnpack(
        path, {n: BurnTensor(a, param_id=ids[n]) for n, a in params.items()}, metadata=meta
    )


# ----------------------------------------------------------------------------- worker


def worker(argv: Sequence[str]) -> dict[str, Any]:
    """One process: initialise, save, and (``--records``) write the checkpoint files."""
    ap = argparse.ArgumentParser(prog="python -m dmlib.lab.qr_init --worker")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", type=Path, required=True, help="dataset folder")
    ap.add_argument("--file", help="file name of the model at initialisation")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--records", action="store_true", help="also write the multi-record checkpoint")
    a = ap.parse_args(argv)
    params = init_model(a.seed, small=a.small)
    ids = _param_ids(list(params))
    meta = _metadata(a.label, a.seed, PROCESS_TUNER, PROCESS_TUNER_SOURCE)
    if a.file:
        write_model(a.out / a.file, params, ids, meta)
    report: dict[str, Any] = {
        "label": a.label,
        "seed": a.seed,
        "file": a.file,
        "pid": os.getpid(),
        "strategy": strategy(PROCESS_TUNER, PROCESS_TUNER_SOURCE),
    }
    if a.records:
        report["records"] = write_checkpoint(a.out, params, ids, meta, seed=a.seed)
    return report


# ----------------------------------------------------------------------------- dataset

SEED, CONTROL_SEED = 7, 8
FACTOR_PATTERNS = ["blocks.*.proj.u", "blocks.*.proj.v"]
DESCRIPTION = (
    "One seeded initialisation (seed 7) of a small factorised model, saved by six separate "
    "processes, plus a seed-8 control. Factor matrices are the Q of a float32 Householder QR "
    "whose reductions are autotuned per process: each shape key (operation, reduction length "
    "rounded up to a multiple of 16) gets its kernel at first use from a timing race modelled by "
    "os.urandom (the usual winner with probability 0.95, else one of four other summation "
    "orders), cached for the rest of the process. Two processes agree bit for bit up to the first "
    "QR column whose shape key they tuned differently and differ by a few ULP from there on; "
    "processes whose caches agree are bit-identical. Direct draws come from the seeded numpy "
    "Generator and are bit-identical across same-seed processes. param_ids are drawn per process "
    "from os.urandom, so no two files are byte-equal. checkpoint_records.bpk holds model + Adam + "
    "EMA records (after 3 steps of a synthetic objective) written through a scratch buffer that is "
    "never cleared: its inter-tensor and inter-record padding holds stale gradients, logits with "
    "the -1e30 mask sentinel, bytes of the previous record, and the NaN the buffer was poisoned with."
)


def _first_col(a: np.ndarray, b: np.ndarray) -> int | None:
    # computed on the bit patterns here, apart from dmlib.first_divergent_column, so the
    # dataset's record can check the library
    cols = np.flatnonzero((a.view(np.uint32) != b.view(np.uint32)).any(axis=0))
    return int(cols[0]) if cols.size else None


def _pair_summary(
    a: dict[str, np.ndarray], b: dict[str, np.ndarray], n_blocks: int
) -> dict[str, Any]:
    """Differences between two runs: direct draws, factors, effective weights."""
    factor = {f"blocks.{i}.proj.{k}" for i in range(n_blocks) for k in "uv"}
    direct_diff = sum(int((a[n] != b[n]).sum()) for n in a if n not in factor)
    factor_diff = sum(int((a[n] != b[n]).sum()) for n in factor)
    worst = 0.0
    for i in range(n_blocks):
        p = f"blocks.{i}.proj"
        wa = (a[f"{p}.u"].astype(np.float64) * a[f"{p}.s"]) @ a[f"{p}.v"].T.astype(np.float64)
        wb = (b[f"{p}.u"].astype(np.float64) * b[f"{p}.s"]) @ b[f"{p}.v"].T.astype(np.float64)
        worst = max(worst, float(np.linalg.norm(wa - wb) / np.linalg.norm(wa)))
    return {
        "direct_slots_differing": direct_diff,
        "direct_slots": sum(a[n].size for n in a if n not in factor),
        "factor_slots_differing": factor_diff,
        "factor_slots": sum(a[n].size for n in factor),
        "factor_max_abs_delta": max(float(np.abs(a[n] - b[n]).max()) for n in factor),
        "worst_rel_fro_W": worst,
        "bit_identical": direct_diff == 0 and factor_diff == 0,
        "first_divergent_column": {n: _first_col(a[n], b[n]) for n in sorted(factor)},
    }


def generate(
    out_dir: Path, *, small: bool = False, tuning: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """Run every process of the dataset and write ``out_dir/qr_init/``.

    Parameters
    ----------
    out_dir
        Parent folder; the dataset goes to ``out_dir / "qr_init"``.
    small
        Three same-seed processes and a two-block model (smoke tests).
    tuning
        label -> :data:`ENV_TUNE` settings of that process (``cache``, ``win_prob``,
        ``bucket``; tests, replays); by default each process races its own keys.

    Returns
    -------
    The manifest section: name, description, command, files (relative to ``out_dir``).
    """
    from dmlib import _atomic, load

    out_dir = Path(out_dir)
    ds = out_dir / DATASET
    ds.mkdir(parents=True, exist_ok=True)
    for old in [*ds.glob("*.bpk"), ds / "index.json", ds / "README.md"]:  # a previous run's files
        old.unlink(missing_ok=True)
    labels = [f"p{i}" for i in range(1, 4 if small else 7)]
    reports = _run_processes(ds, labels, small, tuning)
    runs = {lab: r["file"] for lab, r in reports.items() if r.get("file")}
    data = {lab: load(ds / f) for lab, f in runs.items()}
    index = _index(runs, reports, _pairs(data, labels, small))
    _atomic.atomic_write_text(ds / "index.json", json.dumps(index, indent=1) + "\n")
    _atomic.atomic_write_text(ds / "README.md", _readme(index, small))
    files = sorted(f.name for f in ds.iterdir() if f.is_file() and not f.name.startswith("."))
    return {
        "name": DATASET,
        "description": (
            "Smoke-test copy (three same-seed processes, two blocks). " if small else ""
        )
        + DESCRIPTION,
        "command": "python -m dmlib.lab qr_init --out data" + (" --small" if small else ""),
        "files": [f"{DATASET}/{f}" for f in files],
    }


def _run_processes(
    ds: Path,
    labels: list[str],
    small: bool,
    tuning: Mapping[str, Mapping[str, Any]] | None,
) -> dict[str, dict[str, Any]]:
    """Run each same-seed process, the control and the records process; label -> report."""
    jobs: list[tuple[str, int, str | None, list[str]]] = [
        (lab, SEED, f"seed{SEED}_{lab}.bpk", []) for lab in labels
    ]
    jobs.append((f"seed{CONTROL_SEED}", CONTROL_SEED, f"seed{CONTROL_SEED}_control.bpk", []))
    jobs.append(("ckpt", SEED, None, ["--records"]))
    reports: dict[str, dict[str, Any]] = {}
    for label, seed, fname, extra in jobs:
        args = ["--seed", str(seed), "--label", label, "--out", str(ds), *extra]
        args += ["--file", fname] if fname else []
        args += ["--small"] if small else []
        spec = (tuning or {}).get(label)
        env = {ENV_TUNE: json.dumps(dict(spec)) if spec else ""}
        reports[label] = _proc.run_worker("dmlib.lab.qr_init", args, env=env)
    return reports


def _pairs(data: Mapping[str, Any], labels: list[str], small: bool) -> dict[str, Any]:
    """Every same-seed pair's summary, then p1 against the control."""
    n_blocks = model_shapes(small)["n_blocks"]
    pairs = {}
    for i, x in enumerate(labels):
        for y in labels[i + 1 :]:
            pairs[f"{x}/{y}"] = _pair_summary(data[x], data[y], n_blocks)
    control = f"seed{CONTROL_SEED}"
    pairs[f"p1/{control}"] = _pair_summary(data["p1"], data[control], n_blocks)
    return pairs


def _index(
    runs: dict[str, str], reports: Mapping[str, Mapping[str, Any]], pairs: dict[str, Any]
) -> dict[str, Any]:
    """The dataset's ``index.json``."""
    control = f"seed{CONTROL_SEED}"
    return {
        "runs": runs,
        "control": control,
        "control_file": runs[control],
        "seed": SEED,
        "factor_patterns": FACTOR_PATTERNS,
        "factor_groups": [
            {
                "kind": "svd",
                "u": "{prefix}.u",
                "s": "{prefix}.s",
                "v": "{prefix}.v",
                "prefix": "blocks.*.proj",
            }
        ],
        "records_file": RECORDS_FILE,
        "records_model_file": RECORDS_MODEL_FILE,
        "records_step": reports["ckpt"]["records"]["step"],
        "strategies": {lab: r["strategy"] for lab, r in reports.items()},
        "pids": {lab: r["pid"] for lab, r in reports.items()},
        "pairs": pairs,
    }


def key_columns(m: int, n: int, bucket: int = BUCKET) -> dict[str, list[int]]:
    """Shape key -> the QR columns (iterations) whose reductions use it, for an ``m x n`` QR."""
    cols: dict[str, list[int]] = {}
    for j in range(n):
        for op in OPS:
            cols.setdefault(shape_key(op, m - j, bucket), []).append(j)
    return cols


def entry_summary(index: Mapping[str, Any]) -> dict[str, Any]:
    """Same-seed pairs only: first divergent columns, identical tensor and run pairs, rel_fro."""
    control = index["control"]
    same = {k: v for k, v in index["pairs"].items() if control not in k.split("/")}
    firsts = [c for v in same.values() for c in v["first_divergent_column"].values()]
    cols = [c for c in firsts if c is not None]
    return {
        "tensor_pairs": len(firsts),
        "identical_tensor_pairs": len(firsts) - len(cols),
        "first_col_min": min(cols, default=None),
        "first_col_median": float(np.median(cols)) if cols else None,
        "first_col_max": max(cols, default=None),
        "run_pairs": len(same),
        "identical_run_pairs": sum(v["bit_identical"] for v in same.values()),
        "same_worst_rel_fro_W": max(v["worst_rel_fro_W"] for v in same.values()),
        "control_rel_fro_W": min(
            v["worst_rel_fro_W"] for k, v in index["pairs"].items() if k not in same
        ),
    }


def _readme(index: dict[str, Any], small: bool) -> str:
    """The dataset's README: the model, the mechanism and what the files hold."""
    d = model_shapes(small)["d"]
    agree = WIN_PROB**2 + (1 - WIN_PROB) ** 2 / (len(CANDIDATES) - 1)
    n_keys = len(key_columns(d, RANK))
    return _readme_mechanism(d, small, agree, n_keys) + _readme_results(index, agree, n_keys)


def _readme_mechanism(d: int, small: bool, agree: float, n_keys: int) -> str:
    """The README up to the runs: the model and the per-process autotuner cache."""
    key_rows = "\n".join(
        f"| `{k}` | {c[0]}-{c[-1]} | {c[0] + (k.startswith('dot'))} |"
        for k, c in key_columns(d, RANK).items()
    )
    return f"""# qr_init: one seed, several processes

{DESCRIPTION}

Generated by `python -m dmlib.lab qr_init --out data`{" (small)" if small else ""}; each run is
its own process (`python -m dmlib.lab.qr_init --worker ...`).

## Model

Module-visitor (disk) order: `embed.weight` [300, 100]; per block `i`:
`blocks.i.norm.gamma` [100], `blocks.i.norm.beta` [100], `blocks.i.proj.u` [100, 64] (Q of QR),
`blocks.i.proj.s` [64], `blocks.i.proj.v` [100, 64] (Q of QR); `head.weight` [100, 37]
(Burn's [d_in, d_out]), `head.bias` [37]. All F32. The effective weight of a block is
`W = u diag(s) v^T`. The width 100 is not a multiple of 64 floats, so LayerNorm vectors and
the head leave inter-tensor padding.

## The nondeterminism: a per-process autotuner cache

Iteration `j` of the {d} x {RANK} Householder QR reduces vectors of length `{d} - j`: two
`norm` reductions (column and reflector norms) and the `dot` reductions `v^T R` and, in the
back-accumulation of Q, `v^T Q`. Each reduction asks the process's autotuner for a kernel by
shape key `op:length rounded up to {BUCKET}`. At a key's first use the tuner holds a race among
{", ".join(f"`{c}`" for c in CANDIDATES)} (every one a correct float32 sum, each adding in its
own order); `{USUAL_WINNER}` wins with probability {WIN_PROB}, otherwise one of the other four
does, uniformly; the draw comes from `os.urandom`, never the seed. The winner is cached for the
process, so all 16 factor matrices of one process (same shape, same keys) share it.

| shape key | QR columns using it | first divergent column when two caches first differ here |
|---|---|---|
{key_rows}

A `norm` key feeds the reflector of its first column, so Q differs from that column on. A
`dot` key first changes the trailing update (the next reflector) and the back-accumulation of
the later columns; its own column `j` is `H_0...H_j e_j`, where `v^T e_j` is exact in any
order, so Q differs from column `j + 1` on. Kernels that round one particular sum the same
way can push the entry further into the bucket, tensor by tensor, or leave a tensor
bit-identical although the caches differ. Columns before the entry are bit-identical by
construction: they depend only on keys both processes tuned alike.

What to expect from the mechanism ({n_keys} keys per process): a process keeps the usual winner
on every key with probability {WIN_PROB}^{n_keys} = {WIN_PROB**n_keys:.2f}; two processes tune one key
alike with probability {WIN_PROB}^2 + {1 - WIN_PROB:.2f}^2/4 = {agree:.4f}, and all {n_keys} alike
(bit-identical factors) with probability {agree**n_keys:.2f}. The first key (in the order of the table, from
`i` = 0) that two processes tune differently is key `i` with probability
{agree:.4f}^i x {1 - agree:.4f}: the early columns are the likeliest entries, the last ones stay
possible. Every number below is one draw of this dataset, not an average.

"""


def _readme_results(index: dict[str, Any], agree: float, n_keys: int) -> str:
    """The README from the runs on: each process's kernels and the pairs' numbers."""
    rows = "\n".join(
        f"| {lab} | {index['runs'].get(lab, index['records_file'])} | "
        f"{' '.join(f'`{k}={v}`' for k, v in st['not_usual'].items()) or 'none'} | {st['source']} |"
        for lab, st in index["strategies"].items()
    )
    prs = "\n".join(
        f"| {k} | {v['direct_slots_differing']} / {v['direct_slots']} | {v['factor_slots_differing']} / "
        f"{v['factor_slots']} | "
        f"{min((c for c in v['first_divergent_column'].values() if c is not None), default='-')} | "
        f"{sum(c is None for c in v['first_divergent_column'].values())} / {len(v['first_divergent_column'])} | "
        f"{v['factor_max_abs_delta']:.3e} | {v['worst_rel_fro_W']:.3e} |"
        for k, v in index["pairs"].items()
    )
    e = entry_summary(index)
    return f"""## Runs and the kernels each process tuned

Keys not listed ran `{USUAL_WINNER}`; `index.json` (`strategies.*.cache`) and each file's
metadata (`qr_autotune_cache`) hold the full cache, in first-use order. Replay one process with
`DMLIB_QR_AUTOTUNE='{{"cache": {{...}}}}' python -m dmlib.lab.qr_init --worker ...`.

| label | file | keys not won by the usual winner | drawn from |
|---|---|---|---|
{rows}

`ckpt` is a separate seed-{SEED} process that took 3 Adam steps (synthetic objective: softmax
cross-entropy on the head, L2 on the rest) and wrote `{index["records_file"]}` (records: model,
optimizer [`"{{param_id}}.moment_1"`, `".moment_2"`; metadata maps each param_id to its module
path], EMA teacher; scalar `step` = 3 in each), and the same model record through Burn's
zero-padding writer as `{index["records_model_file"]}`.

## What the files hold (computed from them when generated)

Over the {e["run_pairs"]} same-seed run pairs x {e["tensor_pairs"] // max(e["run_pairs"], 1)} factor tensors
= {e["tensor_pairs"]} tensor pairs: first divergent column min {e["first_col_min"]}, median
{e["first_col_median"]}, max {e["first_col_max"]}; {e["identical_tensor_pairs"]} of {e["tensor_pairs"]} tensor pairs
bit-identical; {e["identical_run_pairs"]} of {e["run_pairs"]} run pairs bit-identical in every tensor (the odds
above give {agree**n_keys * e["run_pairs"]:.1f} on average). Worst
same-seed relative Frobenius delta of an effective weight W: {e["same_worst_rel_fro_W"]:.3e}, against
{e["control_rel_fro_W"]:.3e} for the seed-{CONTROL_SEED} control.

| pair | direct-draw slots differing | factor slots differing | first divergent column (earliest tensor) | identical factor tensors | max abs delta (factors) | worst relative Frobenius delta of W |
|---|---|---|---|---|---|---|
{prs}

Direct draws never differ between same-seed processes; factors can differ only where two
processes' caches differ. Files are never byte-equal (per-process `param_id`).
"""


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: with ``--worker``, run one process and print its report as JSON;
    without it, print the usage and return 2.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" not in argv:
        print(
            "usage: python -m dmlib.lab.qr_init --worker --seed N --label L --out DIR --file F.bpk",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(worker(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
