"""Overhead of dmlib.capture on a real MiniLM forward: no capture, hashes only, full dump.

One process, torch threads fixed, model loaded once, warm-up calls first; each variant is
timed (wall clock around ``with capture(...): model(batch)``, manifest and tensor files
written and fsynced included, removing the previous run's folder not; and the forward with
its hooks alone, files excluded) N times, interleaved so drift hits every variant alike;
the median and the best of N are reported.
Captures go to benchmarks/_work/ and are deleted. Ratios are against the plain forward.

``--baseline REV`` also times, interleaved in the same process, the capture module of git
revision REV (its ``dmlib/localize/capture.py`` loaded beside the current one), so a
change is measured before/after under the same machine load.

    python -m benchmarks.bench_capture [--n 15] [--batch 8] [--seq 64] [--baseline REV] [--quick]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORK = HERE / "_work" / "capture"
RESULTS = HERE / "results" / "capture.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=15, help="timed runs per variant (median reported)")
    p.add_argument("--batch", type=int, default=8, help="texts per forward")
    p.add_argument("--seq", type=int, default=64, help="positions per text (padded)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--baseline", help="git revision whose capture module is timed alongside")
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.n, args.batch, args.seq = 3, 2, 16

    import torch

    import dmlib
    from dmlib.lab.minilm import load_minilm, tokenize

    torch.set_num_threads(args.threads)
    model = load_minilm()
    words = "the committee reviewed quarterly results and asked for a revised forecast".split()
    texts = [
        " ".join(words[(i + j) % len(words)] for j in range(args.seq // 2 + i))
        for i in range(args.batch)
    ]
    batch = tokenize(texts, pad_to=args.seq)
    mask = batch["attention_mask"].tolist()
    row_map = [(f"t{i}", j) if m else None for i, row in enumerate(mask) for j, m in enumerate(row)]

    def plain() -> None:
        with torch.no_grad():
            model(**batch)

    inside: dict[str, list[float]] = {}

    def captured(name: str, dump: list[str] | None, capture: Any = dmlib.capture):
        inside[name] = []

        def run() -> None:
            out = WORK / "c"  # the previous run's folder is removed before the clock starts
            with (
                torch.no_grad(),
                capture(model, out, modules="*", row_map=row_map, dump=dump),
            ):
                t0 = time.perf_counter()
                model(**batch)
                inside[name].append(time.perf_counter() - t0)  # hooks included, manifest not

        return run

    variants = {
        "no_capture": plain,
        "hash_only": captured("hash_only", None),
        "full_dump": captured("full_dump", ["*"]),
    }
    if args.baseline:
        old = _capture_at(args.baseline)
        variants["hash_only_baseline"] = captured("hash_only_baseline", None, old)
        variants["full_dump_baseline"] = captured("full_dump_baseline", ["*"], old)
    WORK.mkdir(parents=True, exist_ok=True)
    try:
        for fn in variants.values():  # warm-up: allocator, kernels, page cache
            shutil.rmtree(WORK / "c", ignore_errors=True)
            fn()
        times: dict[str, list[float]] = {k: [] for k in variants}
        dump_bytes = 0
        for _ in range(args.n):
            for name, fn in variants.items():
                shutil.rmtree(WORK / "c", ignore_errors=True)
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                if name == "full_dump":
                    dump_bytes = sum(
                        f.stat().st_size for f in (WORK / "c").rglob("*") if f.is_file()
                    )
    finally:
        shutil.rmtree(WORK, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    fwd = {k: statistics.median(v[1:]) for k, v in inside.items()}  # v[0]: the warm-up
    result = {
        "benchmark": "capture",
        "model": "all-MiniLM-L6-v2 (dmlib.lab.minilm), float32, CPU",
        "batch": args.batch,
        "seq": args.seq,
        "torch_threads": args.threads,
        "n": args.n,
        "quick": args.quick,
        "median_seconds": med,
        "baseline": args.baseline,
        "ratios": {k: v / med["no_capture"] for k, v in med.items()},
        "best_seconds": best,
        "best_ratios": {k: v / best["no_capture"] for k, v in best.items()},
        "ratio_hash_only": med["hash_only"] / med["no_capture"],
        "ratio_full_dump": med["full_dump"] / med["no_capture"],
        "median_forward_seconds": fwd,
        "ratio_hash_only_forward": fwd["hash_only"] / med["no_capture"],
        "ratio_full_dump_forward": fwd["full_dump"] / med["no_capture"],
        "full_dump_bytes": dump_bytes,
    }
    print(
        f"MiniLM forward, batch {args.batch} x {args.seq} positions, {args.threads} thread(s), median of {args.n}:"
    )
    for k, v in med.items():
        extra = (
            f"   (forward with hooks alone: {fwd[k] * 1e3:.1f} ms, x{fwd[k] / med['no_capture']:.2f})"
            if k in fwd
            else ""
        )
        print(
            f"  {k:18s} {v * 1e3:8.1f} ms   x{v / med['no_capture']:.2f}"
            f"   best {best[k] * 1e3:7.1f} ms x{best[k] / best['no_capture']:.2f}{extra}"
        )
    print(f"  full dump writes {dump_bytes / 2**20:.1f} MiB per forward")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    from dmlib._atomic import atomic_write_text

    atomic_write_text(RESULTS, json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULTS}")
    return 0


def _capture_at(rev: str) -> Any:
    """``capture`` from git revision ``rev``'s capture module, beside today's package.

    The old module runs on today's helpers (captures.py, ops.py); this measures the
    capture code of ``rev`` itself, its hashing rule and its hooks.
    """
    root = HERE.parent
    got = subprocess.run(
        ["git", "show", f"{rev}:dmlib/localize/capture.py"],
        cwd=root, capture_output=True, text=True,
    )  # fmt: skip
    if got.returncode != 0 or "dmlib.kernels import jsonenc" in got.stdout:
        # the capture is a package of rooms with its own compiled module since then: a
        # revision's capture no longer loads beside today's package
        raise SystemExit(
            f"--baseline {rev}: that revision's capture module cannot run beside today's "
            "package; run this benchmark in a checkout of it (git worktree add) and here "
            "in turn, as benchmarks/README.md describes"
        )
    src = got.stdout
    tmp = Path(tempfile.mkdtemp()) / "capture_baseline.py"
    tmp.write_text(src)
    spec = importlib.util.spec_from_file_location("dmlib.localize._capture_baseline", tmp)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.capture


if __name__ == "__main__":
    sys.exit(main())
