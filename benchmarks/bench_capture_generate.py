"""Cost of a long ``generate()`` capture: time per pass as the steps grow, against plain generate().

Two tiny random-init models from their configs (one torch thread, float32, CPU): the
Llama of ``bench_capture_hf`` ("tiny": hidden 64, 2 layers, 4/2 heads) and the
Qwen3-Next hybrid of ``bench_capture_hybrid`` (3 Gated DeltaNet layers on the torch
fallback, 1 attention layer, 4 experts top-2). A batch of 3 prompts of 16 tokens, greedy,
exactly ``--steps`` new tokens (no end-of-sequence token). Variants, timed alternately
``--n`` times per step count (median reported):

- ``plain``: ``model.generate(...)`` under ``torch.no_grad()``;
- ``capture``: :func:`dmlib.localize.hf.capture_generate` with the default modules (the
  model itself not hooked: the pass hook looks for the model's outputs among the
  boundaries it recorded), states after every pass, manifest written;
- ``capture_root``: the same with the model itself hooked too (``""`` added to the
  modules).

Per variant: the whole call's CPU seconds (``time.process_time``: every thread of the
process; torch runs on one) and wall seconds, its CPU time per pass (``per_pass_ms``:
over the passes, 1 + steps), and the time per pass late in the generation against early
(``late_over_early``: the median CPU time of the main thread (``time.thread_time``)
between consecutive passes' starts, measured by a forward pre-hook on the model, over the
last quarter of the passes against the second quarter; 1.0 when a pass costs the same
however many came before). CPU time, not wall time: on a shared machine the wall time of
one run moves by 2-4x with the others' load, its CPU time much less.

    python -m benchmarks.bench_capture_generate [--steps 16 64 256] [--n 3] [--models llama qwen3next]

Run it with ``PYTHONPATH`` pointing at another checkout (a ``git worktree`` with its
compiled modules built) to time that checkout's capture: the output names the dmlib it
imported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPT, BATCH = 16, 3


def build(name: str) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    if name == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=256, max_position_embeddings=2048, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=2048,
    )  # fmt: skip
    return transformers.Qwen3NextForCausalLM(cfg).eval()


class PassClock:
    """A forward pre-hook on the model: the time each pass starts."""

    def __init__(self, model: Any) -> None:
        self.starts: list[float] = []
        self.handle = model.register_forward_pre_hook(self.hook)

    def hook(self, mod: Any, args: Any) -> None:
        self.starts.append(time.thread_time())

    def late_over_early(self) -> float:
        gaps = [b - a for a, b in zip(self.starts, self.starts[1:], strict=False)]
        q = len(gaps) // 4
        if q < 2:
            return float("nan")
        return statistics.median(gaps[3 * q :]) / statistics.median(gaps[q : 2 * q])


def run_variants(model: Any, steps: int, n: int, work: Path) -> dict[str, dict[str, float]]:
    import torch

    from dmlib.localize.capture.tensors import default_modules
    from dmlib.localize.hf import capture_generate, row_map_from_attention_mask

    ids = torch.randint(0, 256, (BATCH, PROMPT), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    rows = row_map_from_attention_mask(mask)
    gen = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": steps,
           "min_new_tokens": steps, "do_sample": False, "pad_token_id": 0}  # fmt: skip
    with_root = ["", *default_modules(model)]

    def plain() -> None:
        model.generate(**gen)

    def cap(**kw: Any) -> Any:
        def go() -> None:
            capture_generate(model, work / "c", row_map=rows, generate_kwargs=gen,
                             overwrite=True, **kw)  # fmt: skip

        return go

    variants = {"plain": plain, "capture": cap(), "capture_root": cap(modules=with_root)}
    times: dict[str, list[float]] = {k: [] for k in variants}
    walls: dict[str, list[float]] = {k: [] for k in variants}
    ratios: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        plain()  # warm-up
        for _ in range(n):
            for k, fn in variants.items():
                clock = PassClock(model)
                t0, w0 = time.process_time(), time.perf_counter()
                try:
                    fn()
                finally:
                    clock.handle.remove()
                times[k].append(time.process_time() - t0)
                walls[k].append(time.perf_counter() - w0)
                ratios[k].append(clock.late_over_early())
    out = {}
    for k in variants:
        med = statistics.median(times[k])
        out[k] = {"cpu_s": med, "wall_s": statistics.median(walls[k]),
                  "per_pass_ms": med / (steps + 1) * 1e3,
                  "late_over_early": statistics.median(ratios[k]),
                  "over_plain": med / statistics.median(times["plain"])}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--n", type=int, default=3, help="timed runs per variant and step count")
    p.add_argument("--models", nargs="+", default=["llama", "qwen3next"])
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    import torch

    import dmlib

    torch.set_num_threads(1)  # one thread: torch's pool swings on a shared machine
    report: dict[str, Any] = {"dmlib": str(Path(dmlib.__file__).parent), "n": args.n,
                              "batch": [BATCH, PROMPT], "models": {}}  # fmt: skip
    print(f"dmlib from {report['dmlib']}")
    work = Path(tempfile.mkdtemp(prefix="dmlib-bench-gen-"))
    try:
        for name in args.models:
            model = build(name)
            report["models"][name] = {}
            for steps in args.steps:
                r = run_variants(model, steps, args.n, work)
                report["models"][name][str(steps)] = r
                line = ", ".join(
                    f"{k} {v['cpu_s']:.2f} CPU s ({v['per_pass_ms']:.1f} ms/pass, "
                    f"{v['over_plain']:.2f}x, late/early {v['late_over_early']:.2f})"
                    for k, v in r.items()
                )
                print(f"{name} {steps} steps: {line}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
