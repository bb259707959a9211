"""Decompression bombs and huge header counts: time and peak memory, before and after, in one run.

"Before" is the reader of git revision ``--baseline`` (default ``b6eb418``, the last one
without the bounds), its module source taken with ``git show`` into a temporary folder and
imported next to today's dmlib; "after" is the same harness with this checkout's reader
(``dmlib.io.<module>``), so both pay the same start-up. Each is one child process measured from fork to exit with its peak RSS from ``wait4``
(benchmarks/_proc.py). The bombs are built by tests/_support/bombs.py (honest sizes and CRCs):

- ``npz``: two members of ``--npz-mib`` MiB of zeros each (about 600 KB at the default):
  the old reader inflated every member at open;
- ``mpk.gz``: one tensor of ``--mpk-mib`` MiB of zeros; ``mpk.gz (lying trailer)``: the
  same with a gzip trailer claiming 100 bytes;
- ``npy 4 TiB``, ``safetensors 4 TiB``: a header declaring a 4 TiB tensor over 16 bytes.

Defaults keep every "before" under about 2 GB on a shared machine.

    python -m benchmarks.bench_bombs [--npz-mib 300] [--mpk-mib 512] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._proc import run_cpu

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "bombs.json"
sys.path.insert(0, str(ROOT / "tests"))
from _support import bombs as _bombs  # noqa: E402

# open a file with one reader module (the baseline's, or today's) and load every tensor
_OLD = """
import sys
sys.path.insert(0, sys.argv[1])
from dmlib.errors import DmlibError
import importlib
reader = importlib.import_module(sys.argv[2])
try:
    ts = getattr(reader, sys.argv[3])(sys.argv[4])
    for t in ts.values():
        t.load()
except DmlibError as err:
    print(err, file=sys.stderr)
    sys.exit(2)
"""

_READERS = {  # bomb suffix -> (module under dmlib/io, opening function)
    ".npz": ("numpy_", "open_npz"),
    ".npy": ("numpy_", "open_npy"),
    ".mpk.gz": ("burn_mpk", "open_mpk"),
    ".safetensors": ("safetensors", "open_safetensors"),
}


def build(work: Path, npz_mib: int, mpk_mib: int) -> dict[str, tuple[Path, str, int]]:
    """name -> (file, reader suffix, bytes declared)."""
    out = {}
    p = work / "bomb.npz"
    out["npz"] = (p, ".npz", _bombs.npz_zeros(p, members=2, mib_each=npz_mib))
    p = work / "bomb.mpk.gz"
    out["mpk.gz"] = (p, ".mpk.gz", _bombs.mpk_gz_zeros(p, mib=mpk_mib))
    p = work / "liar.mpk.gz"
    out["mpk.gz (lying trailer)"] = (p, ".mpk.gz", _bombs.mpk_gz_zeros(p, mpk_mib, isize=100))
    p = work / "huge.npy"
    p.write_bytes(_bombs.npy_header("<f4", (1 << 40,)) + bytes(16))
    out["npy 4 TiB"] = (p, ".npy", 4 << 40)
    p = work / "huge.safetensors"
    hb = json.dumps({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4]}}).encode()
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + bytes(4))
    out["safetensors 4 TiB"] = (p, ".safetensors", 4 << 40)
    return out


def old_sources(rev: str, into: Path) -> None:
    """The baseline's readers as modules ``old_<name>`` in ``into``."""
    for module in {m for m, _ in _READERS.values()}:
        src = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:dmlib/io/{module}.py"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        (into / f"old_{module}.py").write_text(src, encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--npz-mib", type=int, default=300)
    ap.add_argument("--mpk-mib", type=int, default=512)
    ap.add_argument("--baseline", default="b6eb418")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        old_sources(args.baseline, work)
        for name, (path, suffix, declared) in build(work, args.npz_mib, args.mpk_mib).items():
            module, fn = _READERS[suffix]
            before = run_cpu(
                [sys.executable, "-c", _OLD, str(work), f"old_{module}", fn, str(path)],
                ok=(0, 1, 2),
            )
            after = run_cpu(
                [sys.executable, "-c", _OLD, str(work), f"dmlib.io.{module}", fn, str(path)],
                ok=(2,),
            )
            rows.append(
                {
                    "bomb": name,
                    "file_bytes": path.stat().st_size,
                    "declared_bytes": declared,
                    "before_s": round(before[0], 3),
                    "before_peak_mib": round(before[1], 1),
                    "after_s": round(after[0], 3),
                    "after_peak_mib": round(after[1], 1),
                }
            )
            r = rows[-1]
            print(
                f"{name:24} {r['file_bytes']:>10} B file, declares {declared / 2**20:>10.0f} MiB: "
                f"before {r['before_s']:6.2f} s {r['before_peak_mib']:7.0f} MiB | "
                f"after {r['after_s']:6.2f} s {r['after_peak_mib']:5.0f} MiB (exit 2)",
                flush=True,
            )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"rows": rows}, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
