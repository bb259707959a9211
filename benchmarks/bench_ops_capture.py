"""Overhead of op-level capture on a real MiniLM forward, beside module-level capture.

One process, torch threads fixed, model loaded once, one warm-up call per variant, then
N interleaved timed runs per variant (median reported; wall clock around the whole
``with capture(...)`` block, manifest written). Variants, all hashing only (no dumps):
no capture; module boundaries (``modules="*"``); module boundaries plus the ops of one
layer (``ops=True, op_modules="encoder.layer.0*"``); module boundaries plus every op.
Ratios are against the plain forward.

    python -m benchmarks.bench_ops_capture [--n 7] [--batch 8] [--seq 64] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORK = HERE / "_work" / "ops_capture"
RESULTS = HERE / "results" / "ops_capture.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=7, help="timed runs per variant (median reported)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.batch, args.seq = 2, 2, 16

    import torch

    import dmlib
    from dmlib.lab.minilm import load_minilm, tokenize

    torch.set_num_threads(args.threads)
    model = load_minilm()
    words = "the committee reviewed quarterly results and asked for a revised forecast".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(args.seq // 2 + i))
             for i in range(args.batch)]  # fmt: skip
    batch = tokenize(texts, pad_to=args.seq)
    mask = batch["attention_mask"].tolist()
    rows = [(f"t{i}", j) if m else None for i, row in enumerate(mask) for j, m in enumerate(row)]
    n_bounds: dict[str, int] = {}

    def plain() -> None:
        with torch.no_grad():
            model(**batch)

    def captured(name: str, **kw):
        def run() -> None:
            out = WORK / name
            if out.exists():
                shutil.rmtree(out)
            with torch.no_grad(), dmlib.capture(model, out, modules="*", row_map=rows, **kw) as rec:
                model(**batch)
            n_bounds[name] = len(rec.boundaries)

        return run

    variants = {
        "no_capture": plain,
        "modules": captured("modules"),
        "ops_layer0": captured("ops_layer0", ops=True, op_modules="encoder.layer.0*"),
        "ops_all": captured("ops_all", ops=True),
    }
    WORK.mkdir(parents=True, exist_ok=True)
    try:
        for fn in variants.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.n):
            for name, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "benchmark": "ops_capture",
        "model": "all-MiniLM-L6-v2 (dmlib.lab.minilm), float32, CPU",
        "batch": args.batch, "seq": args.seq, "torch_threads": args.threads, "n": args.n,
        "quick": args.quick, "median_seconds": med, "boundaries": n_bounds,
        "ratios": {k: v / med["no_capture"] for k, v in med.items()},
    }  # fmt: skip
    print(f"MiniLM forward, batch {args.batch} x {args.seq}, {args.threads} thread(s), "
          f"median of {args.n}, hashes only:")  # fmt: skip
    for k, v in med.items():
        nb = f"   {n_bounds[k]} boundaries" if k in n_bounds else ""
        print(f"  {k:11s} {v * 1e3:8.1f} ms   x{v / med['no_capture']:.2f}{nb}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    from dmlib._atomic import atomic_write_text

    atomic_write_text(RESULTS, json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
