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

``--readers BEFORE_TREE`` measures the small hostile files of the pickle, torch zip, flax
and TOML readers instead (see :data:`READER_CASES`): each is ``python -m dmlib ...`` run
once with ``PYTHONPATH=BEFORE_TREE`` (a worktree of the revision before the bounds) and
once with this checkout, in a child capped at ``--cap-gib`` GiB of address space and
``--timeout`` seconds, its exit status, wall time and peak RSS (``wait4``) reported.
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


# -- the small hostile files of the pickle / torch zip / flax / TOML readers --------------------

# one command in a child: address space capped, killed at the timeout, (status, s, peak KiB)
_CAPPED = """
import os, resource, signal, sys, time
cap, timeout, cmd = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
t = time.perf_counter()
pid = os.fork()
if pid == 0:
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.execvp(cmd[0], cmd)
signal.signal(signal.SIGALRM, lambda *_: os.kill(pid, signal.SIGKILL))
signal.setitimer(signal.ITIMER_REAL, timeout)
_, status, usage = os.wait4(pid, 0)
signal.setitimer(signal.ITIMER_REAL, 0)
dt = time.perf_counter() - t
code = os.waitstatus_to_exitcode(status)
print(f"{'timeout' if dt >= timeout else code} {dt:.2f} {usage.ru_maxrss}", file=sys.stderr)
"""


def reader_cases(work: Path) -> dict[str, list[str]]:
    """name -> the dmlib arguments that open that hostile file (built into ``work``)."""
    import msgpack
    import numpy as np

    b = _bombs
    cases: dict[str, list[str]] = {}

    def torch_file(name: str, pkl: bytes, storages: dict[str, bytes] | None = None) -> None:
        p = work / f"{name}.pt"
        b.torch_zip(p, pkl, storages)
        cases[name] = ["inspect", str(p)]

    torch_file("torch: 20 KB key x 990 levels", b.pickle_long_key_nest(20_000, 990, 180))
    torch_file("pickle: [x, x] x 40 over []", b.pickle_empty_doubling(40))
    torch_file("pickle: 9.6M shared leaves", b.pickle_shared_leaves(1_200_000, 8))
    torch_file("torch: dim 2**40, stride 0", b.pickle_tensor((1 << 40,), (0,)), {"0": bytes(4)})
    torch_file("torch: stride 2**62", b.pickle_tensor((1, 2), (1 << 62, 1), numel=2),
               {"0": bytes(8)})  # fmt: skip
    torch_file("torch: huge int key", b"\x80\x02}" + b.p_int(10**5000) + b.p_int(1) + b"s."
               )  # fmt: skip
    torch_file("pickle: 10M empty lists", b.PROTO2 + b"}" + b.p_str("x") + b"](" + b"]" * 10**7
               + b"es.")  # fmt: skip
    torch_file("torch: huge int value", b"\x80\x02}" + b.p_str("x") + b.p_int(10**5000) + b"s.")
    p = work / "long.msgpack"
    p.write_bytes(b.flax_long_key_nest(2000, 50, 15_000))
    cases["flax: 2 KB keys x 50 levels"] = ["inspect", str(p)]
    p = work / "empties.msgpack"
    n = 10_000_000
    p.write_bytes(b"\x81\xa6params\xdd" + struct.pack(">I", n) + b"\x90" * n)
    cases["flax: 10M empty arrays"] = ["inspect", str(p)]
    good = work / "good.pt"
    b.torch_zip(good, b.pickle_tensor((4,), (1,), numel=4), {"0": bytes(16)})
    p = work / "dup.pt"
    b.torch_zip_duplicate_storage(p, np.arange(4, dtype="<f4").tobytes(), bytes(16))
    cases["zip: archive/data/0 twice"] = ["compare", str(good), str(p)]
    raw = good.read_bytes()
    for field in ("csize", "method"):
        p = work / f"local_{field}.pt"
        p.write_bytes(b.patched_local_header(raw, "archive/data/0", field, 8))
        cases[f"zip: local header {field} differs"] = ["inspect", str(p)]
    p = work / "prepended.pt"
    p.write_bytes(bytes(100) + raw)
    cases["zip: 100 bytes before the archive"] = ["inspect", str(p)]
    p = work / "two.pt"
    b.two_archives(p, bytes(16))
    cases["zip: two data.pkl (a/, b/)"] = ["inspect", str(p)]
    npz = work / "dup.npz"
    np.savez(npz, w=np.zeros(4, np.float32))
    p = work / "local.npz"
    p.write_bytes(b.patched_local_header(npz.read_bytes(), "w.npy", "usize", 8))
    cases["npz: local header size differs"] = ["inspect", str(p)]
    deep = work / "deep.toml"
    deep.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n", encoding="utf-8")
    cases["mapping TOML nested 5000 deep"] = ["compare", str(good), str(good), "--map", str(deep)]
    tables = work / "tables.toml"
    tables.write_text("[" + ".".join(["a"] * 200) + "]\nb = 1\n", encoding="utf-8")
    cases["mapping TOML tables 200 deep"] = ["compare", str(good), str(good), "--map", str(tables)]
    study = work / "study.toml"
    study.write_text("title = 'x'\n" + tables.read_text(encoding="utf-8"), encoding="utf-8")
    cases["study.toml tables 200 deep"] = ["report", str(study), "--out", str(work / "out")]
    del msgpack
    return cases


def run_readers(before_tree: str, cap_gib: float, timeout: float) -> list[dict[str, object]]:
    """Every reader case before (``before_tree``) and after (this checkout)."""
    import os

    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in reader_cases(Path(tmp)).items():
            hostile = next(Path(a) for a in reversed(args) if Path(a).is_file())
            row: dict[str, object] = {"case": name, "file_bytes": hostile.stat().st_size}
            for side, tree in (("before", before_tree), ("after", str(ROOT))):
                env = {**os.environ, "PYTHONPATH": tree, "DMLIB_KERNELS": "numpy"}
                cmd = [sys.executable, "-m", "dmlib", *args]
                proc = subprocess.run(
                    [sys.executable, "-S", "-c", _CAPPED, str(int(cap_gib * 2**30)),
                     str(timeout), *cmd],
                    capture_output=True, text=True, env=env, cwd=tree, check=False,
                )  # fmt: skip
                lines = proc.stderr.strip().splitlines()
                code, secs, kib = lines[-1].split()
                row[side] = {"exit": code, "s": float(secs), "peak_mib": int(kib) // 1024,
                             "line": lines[-2][:160] if len(lines) > 1 else ""}  # fmt: skip
            rows.append(row)
            bf, af = row["before"], row["after"]
            assert isinstance(bf, dict) and isinstance(af, dict)
            print(
                f"{name:36} {row['file_bytes']:>9} B | before exit {bf['exit']:>7} "
                f"{bf['s']:6.2f} s {bf['peak_mib']:6} MiB | after exit {af['exit']:>3} "
                f"{af['s']:6.2f} s {af['peak_mib']:5} MiB",
                flush=True,
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readers", metavar="BEFORE_TREE", help="measure the reader cases instead")
    ap.add_argument("--cap-gib", type=float, default=4.0)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--npz-mib", type=int, default=300)
    ap.add_argument("--mpk-mib", type=int, default=512)
    ap.add_argument("--baseline", default="b6eb418")
    args = ap.parse_args()
    if args.readers:
        found = run_readers(args.readers, args.cap_gib, args.timeout)
        RESULTS.parent.mkdir(exist_ok=True)
        out = RESULTS.with_name("bombs_readers.json")
        out.write_text(json.dumps({"rows": found}, indent=1), encoding="utf-8")
        return
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
