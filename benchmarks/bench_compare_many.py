"""``dmlib.compare`` on checkpoints of many small tensors, against a plain numpy loop.

An optimizer state, a sharded model's index or a Trainer checkpoint holds thousands of
tensors, most of them small. Two safetensors files of N float32 tensors of 16 elements
(every 7th tensor differs in one element), for N = 1,000, 5,000 and 20,000, written
under benchmarks/_work/ and deleted at the end; both programs run in this process, files
warm, best of ``--repeat``, interleaved:

- ``dmlib``: ``dmlib.compare(a, b)`` (every column, whole-tensor hashes included);
- ``numpy``: the user's loop: ``safetensors.numpy.load_file`` of both files, then per
  tensor the count of differing elements (bitwise) and ``np.array_equal``.

Reported per N: seconds, microseconds per tensor, dmlib / numpy, and the scaling (per
tensor at N over per tensor at the smallest N: 1.0 is linear). Targets: linear scaling
(within 1.5x at 20,000 of the 1,000 figure per tensor).

    python -m benchmarks.bench_compare_many [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
WORK = HERE / "_work" / "many"
RESULTS = HERE / "results" / "compare_many.json"


def write_pair(n: int) -> tuple[Path, Path]:
    from safetensors.numpy import save_file

    a = {f"layer.{i}.w": np.full(16, i, np.float32) for i in range(n)}
    b = {k: v.copy() for k, v in a.items()}
    for i in range(0, n, 7):
        b[f"layer.{i}.w"][3] += 1.0
    pa, pb = WORK / f"a{n}.safetensors", WORK / f"b{n}.safetensors"
    save_file(a, str(pa))
    save_file(b, str(pb))
    return pa, pb


def numpy_loop(pa: Path, pb: Path) -> int:
    from safetensors.numpy import load_file

    a, b = load_file(str(pa)), load_file(str(pb))
    differing = 0
    for k, x in a.items():
        y = b[k]
        n = int(np.count_nonzero(x.view(np.uint32) != y.view(np.uint32)))
        differing += int(n > 0 or not np.array_equal(x, y))
    return differing


def dmlib_compare(pa: Path, pb: Path) -> int:
    import dmlib

    df = dmlib.compare(pa, pb)
    return int((df["n_diff"] > 0).sum())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small N: a smoke test")
    args = p.parse_args(argv)
    sizes = [200, 1000] if args.quick else [1000, 5000, 20000]
    WORK.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"tensors": {}}
    try:
        for n in sizes:
            pa, pb = write_pair(n)
            times: dict[str, list[float]] = {"dmlib": [], "numpy": []}
            counts = {}
            for _ in range(args.repeat):
                for name, fn in (("dmlib", dmlib_compare), ("numpy", numpy_loop)):
                    t0 = time.perf_counter()
                    counts[name] = fn(pa, pb)
                    times[name].append(time.perf_counter() - t0)
            if counts["dmlib"] != counts["numpy"]:
                raise SystemExit(f"N={n}: dmlib counts {counts['dmlib']} differing tensors, "
                                 f"numpy {counts['numpy']}")  # fmt: skip
            best = {k: min(v) for k, v in times.items()}
            out["tensors"][n] = {
                "dmlib_s": best["dmlib"], "numpy_s": best["numpy"],
                "dmlib_us_per_tensor": best["dmlib"] / n * 1e6,
                "ratio_to_numpy": best["dmlib"] / best["numpy"], "differing": counts["dmlib"],
            }  # fmt: skip
            for f in (pa, pb):
                f.unlink()
        first = out["tensors"][sizes[0]]["dmlib_us_per_tensor"]
        for n in sizes:
            r = out["tensors"][n]
            r["scaling"] = r["dmlib_us_per_tensor"] / first
            print(f"N={n}: dmlib {r['dmlib_s']:.2f} s ({r['dmlib_us_per_tensor']:.0f} us/tensor, "
                  f"scaling {r['scaling']:.2f}), numpy loop {r['numpy_s']:.2f} s, "
                  f"ratio {r['ratio_to_numpy']:.1f}x")  # fmt: skip
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
