"""Run every benchmark (``python -m benchmarks.run [--quick]``).

Each ``benchmarks/bench_*.py`` measures dmlib side by side with its baseline in one run
and writes its figures (as ratios) to ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, not a measurement")
    p.add_argument("--only", nargs="*", help="benchmark module names (e.g. bench_compare)")
    args = p.parse_args(argv)
    here = Path(__file__).parent
    names = sorted(m.name for m in pkgutil.iter_modules([str(here)]) if m.name.startswith("bench_"))
    if args.only:
        names = [n for n in names if n in args.only]
    status = 0
    for name in names:
        print(f"== {name}", flush=True)
        mod = importlib.import_module(f"benchmarks.{name}")
        rc = mod.main(["--quick"] if args.quick else [])
        status = status or int(rc or 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
