"""Run every benchmark (``python -m benchmarks.run [--quick]``).

Each ``benchmarks/bench_*.py`` measures dmlib side by side with its baseline in one run
and writes its figures (as ratios) to ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
from pathlib import Path

# the `make bench` profile: sizes that fit the whole run in under 10 minutes on a busy
# 2-core machine (each benchmark's own defaults measure more when run alone)
PROFILE = {
    "bench_compare": ["--size-gib", "0.5", "--repeat", "3"],
    "bench_cli": ["--size-mib", "512", "--repeat", "3"],
    "bench_dask": ["--size-mib", "1024", "--repeat", "2"],
    "bench_read": ["--size-mib", "512", "--repeat", "3"],
    "bench_orbax": ["--size-mib", "512"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement"
    )
    p.add_argument("--only", nargs="*", help="benchmark module names (e.g. bench_compare)")
    args = p.parse_args(argv)
    here = Path(__file__).parent
    names = sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))
    if args.only:
        names = [n for n in names if n in args.only]
    status = 0
    t0 = time.perf_counter()
    for name in names:
        print(f"== {name}", flush=True)
        t = time.perf_counter()
        mod = importlib.import_module(f"benchmarks.{name}")
        rc = mod.main(["--quick"] if args.quick else PROFILE.get(name, []))
        status = status or int(rc or 0)
        print(f"({name}: {time.perf_counter() - t:.0f} s)", flush=True)
    print(f"all benchmarks: {time.perf_counter() - t0:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
