"""How to read two checkpoints side by side: memory map vs ``readinto`` reused buffers.

The inner loop of an identical-pair comparison (compare two files chunk by chunk, hash one
side) run with four reading strategies, each in its own child process (time from spawn to
exit, peak RSS from ``wait4``), interleaved, best of N, on a warm and on a cold page cache
(cold: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on both files, written and synced first,
before each run, which drops their cached pages without root):

``mmap``            memory map, pages released behind the cursor (``MADV_DONTNEED``): dmlib's way
``mmap+seq``        the same with ``MADV_SEQUENTIAL`` (kernel read-ahead hint)
``readinto``        two reused 4 MiB buffers filled with ``readinto``
``readinto+fadv``   the same after ``posix_fadvise(POSIX_FADV_SEQUENTIAL)``

    python -m benchmarks.bench_read [--size-mib 512] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
from pathlib import Path

import numpy as np

from benchmarks._proc import run

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "_work_read"
RESULTS = HERE / "results" / "read.json"
CHUNK = 4 << 20
STRATEGIES = ("mmap", "mmap+seq", "readinto", "readinto+fadv")


def _child(strategy: str, a: str, b: str) -> None:
    from blake3 import blake3

    h = blake3()
    same = True
    if strategy.startswith("mmap"):
        with open(a, "rb") as fa, open(b, "rb") as fb:
            ma = mmap.mmap(fa.fileno(), 0, access=mmap.ACCESS_READ)
            mb = mmap.mmap(fb.fileno(), 0, access=mmap.ACCESS_READ)
            if strategy == "mmap+seq":
                ma.madvise(mmap.MADV_SEQUENTIAL)
                mb.madvise(mmap.MADV_SEQUENTIAL)
            xa, xb = np.frombuffer(ma, np.uint8), np.frombuffer(mb, np.uint8)
            n = min(xa.size, xb.size)
            for off in range(0, n, CHUNK):
                ca, cb = xa[off : off + CHUNK], xb[off : off + CHUNK]
                same &= not np.not_equal(ca.view(np.uint64), cb.view(np.uint64)).any()
                h.update(ca)
                if off >= 2 * CHUNK:  # release what lies two chunks behind
                    lo = off - 2 * CHUNK
                    ma.madvise(mmap.MADV_DONTNEED, lo, CHUNK)
                    mb.madvise(mmap.MADV_DONTNEED, lo, CHUNK)
            del xa, xb, ca, cb
            ma.close()
            mb.close()
    else:
        bufa, bufb = bytearray(CHUNK), bytearray(CHUNK)
        va, vb = np.frombuffer(bufa, np.uint8), np.frombuffer(bufb, np.uint8)
        with open(a, "rb", buffering=0) as fa, open(b, "rb", buffering=0) as fb:
            if strategy == "readinto+fadv":
                for f in (fa, fb):
                    os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while True:
                na, nb = fa.readinto(bufa), fb.readinto(bufb)
                if not na:
                    break
                ca, cb = va[:na], vb[:nb]
                same &= na == nb and not np.not_equal(ca.view(np.uint64), cb.view(np.uint64)).any()
                h.update(ca)
    print(json.dumps({"same": bool(same), "digest": h.hexdigest()}))


def _drop_cache(*paths: Path) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm(*paths: Path) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def _run(strategy: str, a: Path, b: Path) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "benchmarks.bench_read", "--child", strategy, str(a), str(b)]
    return run(cmd, ok=(0,), cwd=ROOT)


def _write(a: Path, b: Path, size: int) -> None:
    """Two equal files of random bytes, written a block at a time and synced (so that
    POSIX_FADV_DONTNEED can drop their pages: dirty pages stay cached)."""
    rng = np.random.default_rng(0)
    with open(a, "wb") as fa, open(b, "wb") as fb:
        for off in range(0, size, 16 << 20):
            block = rng.integers(0, 256, min(16 << 20, size - off), dtype=np.uint8).tobytes()
            fa.write(block)
            fb.write(block)
        for f in (fa, fb):
            f.flush()
            os.fsync(f.fileno())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mib", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0
    size = (8 << 20) if args.quick else args.size_mib << 20
    repeat = 1 if args.quick else args.repeat
    WORK.mkdir(parents=True, exist_ok=True)
    a, b = WORK / "a.bin", WORK / "b.bin"
    result: dict = {"size_bytes": size, "repeat": repeat, "loadavg_before": os.getloadavg()}
    try:
        _write(a, b, size)
        for cache in ("warm", "cold"):
            runs: dict[str, list[tuple[float, float]]] = {s: [] for s in STRATEGIES}
            for _ in range(repeat):
                for s in STRATEGIES:
                    (_drop_cache if cache == "cold" else _warm)(a, b)
                    runs[s].append(_run(s, a, b))
            result[cache] = {
                s: {"best_seconds": min(t for t, _ in v), "peak_rss_mib": max(m for _, m in v)}
                for s, v in runs.items()
            }
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)
    result["loadavg_after"] = os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(
        f"reading two {size >> 20} MiB files side by side (compare + hash one side), best of {repeat}"
        f"{' (QUICK: not a measurement)' if args.quick else ''}"
    )
    print(
        f"{'strategy':<16} {'warm s':>8} {'warm RSS MiB':>13} {'cold s':>8} {'cold RSS MiB':>13}  (ratio to mmap)"
    )
    for s in STRATEGIES:
        w, c = result["warm"][s], result["cold"][s]
        rw = w["best_seconds"] / result["warm"]["mmap"]["best_seconds"]
        rc = c["best_seconds"] / result["cold"]["mmap"]["best_seconds"]
        print(
            f"{s:<16} {w['best_seconds']:>8.3f} {w['peak_rss_mib']:>13.0f} {c['best_seconds']:>8.3f}"
            f" {c['peak_rss_mib']:>13.0f}  warm {rw:.2f}x, cold {rc:.2f}x"
        )
    la, lb = result["loadavg_before"][0], result["loadavg_after"][0]
    print(
        f"load average before/after: {la:.1f} / {lb:.1f} (a shared machine: ratios, not absolutes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
