"""dmlib.compare against ``cmp`` and against a straightforward numpy script, side by side.

Three measurements, each program in its own child process (peak RSS = the child's
VmHWM, file-backed pages included), page cache warmed first, median of several runs:

1. two byte-identical checkpoints: ``cmp A B`` vs ``dmlib.compare(A, B)`` (time inside
   the call, imports excluded; with and without the whole-file hashes; and, for
   reference, the whole ``dmlib compare`` process), runs interleaved;
2. two float32 checkpoints where ~15 % of elements differ by 1-2 ULP: dmlib.compare vs
   a numpy script that loads both files whole (np.fromfile) and computes the same
   statistics with numpy.testing's nulp_diff and np.linalg.norm;
3. dmlib's peak memory on that pair at SIZE and at 4 x SIZE.

Files are safetensors with 8 float32 tensors, written under benchmarks/_work/ and
deleted at the end. ``--quick`` uses tiny files (a smoke test, not a measurement).

    python -m benchmarks.bench_compare [--size-gib 1] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "_work"
RESULTS = HERE / "results" / "compare.json"
N_TENSORS = 8
BLOCK = 1 << 24  # bytes generated at a time


# -- files -------------------------------------------------------------------------------


def write_pair(
    path_a: Path, path_b: Path | None, nbytes: int, seed: int, frac: float = 0.15
) -> None:
    """Safetensors file(s) of N_TENSORS float32 tensors; b (if given) has ~frac of elements +1/+2 ULP."""
    per = nbytes // N_TENSORS // 4 * 4
    header, off = {}, 0
    for i in range(N_TENSORS):
        header[f"layer.{i}.weight"] = {
            "dtype": "F32",
            "shape": [per // 4],
            "data_offsets": [off, off + per],
        }
        off += per
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    rng = np.random.default_rng(seed)
    fa = open(path_a, "wb")
    fb = open(path_b, "wb") if path_b is not None else None
    try:
        for f in (fa, fb):
            if f is not None:
                f.write(len(hb).to_bytes(8, "little") + hb)
        left = per * N_TENSORS
        while left:
            n = min(BLOCK, left) // 4
            a = rng.standard_normal(n, dtype=np.float32)
            fa.write(a.tobytes())
            if fb is not None:
                bits = a.view(np.uint32)
                moved = rng.random(n, dtype=np.float32) < frac
                bits[moved] += rng.integers(1, 3, int(moved.sum()), dtype=np.uint32)
                fb.write(bits.tobytes())
            left -= n * 4
    finally:
        fa.close()
        if fb is not None:
            fb.close()


def warm(*paths: Path) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


# -- children ----------------------------------------------------------------------------


def vmhwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child_dmlib(a: str, b: str, mode: str) -> dict:
    """``dmlib.compare`` in a fresh process; mode "0": per-tensor hashes (the API's
    default), "1": and whole-file hashes, "none": no hash (what the CLI's text output does)."""
    import dmlib
    import dmlib.io
    import dmlib.stats.compare  # noqa: F401  (imports are start-up cost, not comparison time)

    t = time.perf_counter()
    kw: dict = {"hash": "none"} if mode == "none" else {"file_hashes": mode == "1"}
    df = dmlib.compare(a, b, progress=False, **kw)
    s = dmlib.summarize(df)
    return {"seconds": time.perf_counter() - t, "vmhwm_mib": vmhwm_mib(), "n_diff": s["n_diff"]}


def child_numpy(a: str, b: str) -> dict:
    """The straightforward script: both files whole in memory, numpy for every statistic."""
    from numpy.testing._private.utils import nulp_diff

    t = time.perf_counter()
    da, db = np.fromfile(a, dtype=np.uint8), np.fromfile(b, dtype=np.uint8)
    n = int(da[:8].view("<u8")[0])
    header = json.loads(da[8 : 8 + n].tobytes())
    base = 8 + n
    edges = [0, 1, 2] + [1 << k for k in range(2, 17)]
    n_diff_total = 0
    for _name, d in header.items():
        s, e = d["data_offsets"]
        x = da[base + s : base + e].view(np.float32)
        y = db[base + s : base + e].view(np.float32)
        neq = x.view(np.uint32) != y.view(np.uint32)
        n_diff = int(neq.sum())
        nulp = nulp_diff(x, y).reshape(-1)
        dn = nulp[neq]
        _stats = {
            "n_diff": n_diff,
            "max_ulp": float(nulp.max()),
            "median_ulp": float(np.median(dn)) if n_diff else None,
            "hist": np.histogram(dn, bins=[*edges, np.inf])[0],
            "max_abs": float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))),
            "rel_fro": float(
                np.linalg.norm(x.astype(np.float64) - y.astype(np.float64))
                / np.linalg.norm(x.astype(np.float64))
            ),
            "cosine": float(
                np.dot(x.astype(np.float64), y.astype(np.float64))
                / (np.linalg.norm(x.astype(np.float64)) * np.linalg.norm(y.astype(np.float64)))
            ),
            "first_diff": int(np.argmax(neq)) if n_diff else None,
            "hash_a": hashlib.sha256(x).hexdigest(),
            "hash_b": hashlib.sha256(y).hexdigest(),
        }
        n_diff_total += n_diff
    return {"seconds": time.perf_counter() - t, "vmhwm_mib": vmhwm_mib(), "n_diff": n_diff_total}


def run_child(*args: str, env: dict | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_compare", "--child", *args],
        cwd=ROOT,
        env=None if env is None else {**os.environ, **env},
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def time_cmp(a: Path, b: Path) -> float:
    t = time.perf_counter()
    rc = subprocess.run(["cmp", str(a), str(b)], check=False).returncode
    dt = time.perf_counter() - t
    if rc != 0:
        raise SystemExit(f"cmp says the identical files differ (rc {rc})")
    return dt


def median_of(fn, repeat: int) -> tuple[float, list]:
    runs = [fn() for _ in range(repeat)]
    return statistics.median(r["seconds"] if isinstance(r, dict) else r for r in runs), runs


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--size-gib", type=float, default=1.0, help="size of each checkpoint (default 1)"
    )
    p.add_argument("--quick", action="store_true", help="tiny files: smoke test only")
    p.add_argument("--repeat", type=int, default=5, help="runs per measurement (median)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        kind, a, b, *rest = args.child
        res = child_numpy(a, b) if kind == "numpy" else child_dmlib(a, b, (rest or ["0"])[0])
        print(json.dumps(res))
        return 0

    size = int((4 << 20) if args.quick else args.size_gib * (1 << 30))
    repeat = 2 if args.quick else args.repeat
    WORK.mkdir(parents=True, exist_ok=True)
    A, A2, B = WORK / "a.safetensors", WORK / "a_copy.safetensors", WORK / "b.safetensors"
    A4, B4 = WORK / "a4.safetensors", WORK / "b4.safetensors"
    result: dict = {
        "size_bytes": size,
        "quick": args.quick,
        "repeat": repeat,
        "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
    }
    try:
        t = time.perf_counter()
        write_pair(A, B, size, seed=1)
        shutil.copyfile(A, A2)
        result["generate_seconds"] = time.perf_counter() - t

        # 1. identical files: cmp vs dmlib
        warm(A, A2)
        time_cmp(A, A2)
        # interleaved, so that load from other processes falls on both alike
        cmp_runs, ident, identfh, identnh = [], [], [], []
        for _ in range(repeat):
            cmp_runs.append(time_cmp(A, A2))
            ident.append(run_child("dmlib", str(A), str(A2), "0"))
            identfh.append(run_child("dmlib", str(A), str(A2), "1"))
            identnh.append(run_child("dmlib", str(A), str(A2), "none"))
        cli_runs = []
        for _ in range(min(repeat, 3)):  # the whole command, imports included (for reference)
            t = time.perf_counter()
            cmd = [sys.executable, "-m", "dmlib", "compare", str(A), str(A2)]
            subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
            cli_runs.append(time.perf_counter() - t)
        cmp_s = statistics.median(cmp_runs)
        ident_s = statistics.median(r["seconds"] for r in ident)
        identfh_s = statistics.median(r["seconds"] for r in identfh)
        identnh_s = statistics.median(r["seconds"] for r in identnh)
        result["identical"] = {
            "cmp_runs_seconds": cmp_runs,
            "dmlib_runs_seconds": [r["seconds"] for r in ident],
            "cmp_seconds": cmp_s,
            "dmlib_seconds": ident_s,
            "dmlib_with_file_hashes_seconds": identfh_s,
            "dmlib_no_hash_seconds": identnh_s,
            "ratio_vs_cmp_no_hash": identnh_s / cmp_s,
            "dmlib_cli_process_seconds": statistics.median(cli_runs),
            "ratio_vs_cmp": ident_s / cmp_s,
            "ratio_vs_cmp_with_file_hashes": identfh_s / cmp_s,
            "dmlib_vmhwm_mib": max(r["vmhwm_mib"] for r in ident),
            "target": "ratio_vs_cmp <= 1.5",
        }
        assert ident[0]["n_diff"] == 0

        # 2. ~15 % of elements 1-2 ULP apart: numpy script vs dmlib
        warm(A, B)
        np_repeat = 1 if not args.quick and size > (1 << 29) else repeat
        # the numpy script as is (OpenBLAS picks its thread count) and with one BLAS
        # thread (faster on a busy machine): the faster of the two is the baseline
        np_default, np_runs = median_of(lambda: run_child("numpy", str(A), str(B)), np_repeat)
        np_one, np_runs1 = median_of(
            lambda: run_child("numpy", str(A), str(B), env={"OPENBLAS_NUM_THREADS": "1"}), np_repeat
        )
        np_s = min(np_default, np_one)
        dm_s, dm_runs = median_of(lambda: run_child("dmlib", str(A), str(B), "0"), repeat)
        assert np_runs[0]["n_diff"] == dm_runs[0]["n_diff"], (np_runs[0], dm_runs[0])
        result["differing"] = {
            "n_diff": dm_runs[0]["n_diff"],
            "numpy_seconds": np_s,
            "numpy_seconds_default_blas": np_default,
            "numpy_seconds_one_blas_thread": np_one,
            "dmlib_seconds": dm_s,
            "speedup": np_s / dm_s,
            "numpy_vmhwm_mib": min(r["vmhwm_mib"] for r in np_runs + np_runs1),
            "dmlib_vmhwm_mib": max(r["vmhwm_mib"] for r in dm_runs),
            "target": "speedup >= 10 and dmlib_vmhwm_mib < numpy_vmhwm_mib / 10",
        }
        result["differing"]["memory_ratio"] = (
            result["differing"]["dmlib_vmhwm_mib"] / result["differing"]["numpy_vmhwm_mib"]
        )
        A2.unlink()

        # 3. flat memory: the same statistics on a pair four times larger
        write_pair(A4, B4, 4 * size, seed=2)
        warm(A4, B4)
        big = [run_child("dmlib", str(A4), str(B4), "0") for _ in range(min(repeat, 2))]
        big_hwm = max(r["vmhwm_mib"] for r in big)
        result["flat_memory"] = {
            "size_bytes": [size, 4 * size],
            "dmlib_vmhwm_mib": [result["differing"]["dmlib_vmhwm_mib"], big_hwm],
            "dmlib_seconds": [dm_s, statistics.median(r["seconds"] for r in big)],
            "ratio": big_hwm / result["differing"]["dmlib_vmhwm_mib"],
            "target": "ratio <= 1.2",
        }
    finally:
        for f in (A, A2, B, A4, B4):
            f.unlink(missing_ok=True)

    result["loadavg_after"] = os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(RESULTS)
    i, d, m = result["identical"], result["differing"], result["flat_memory"]
    gib = size / (1 << 30)
    print(
        f"compare benchmark, {gib:.3g} GiB per checkpoint{' (QUICK: not a measurement)' if args.quick else ''}"
    )
    print(f"{'measurement':<44} {'baseline':>12} {'dmlib':>12} {'ratio':>8}  target")
    print(
        f"{'identical, per-tensor hashes: seconds (cmp)':<44} {i['cmp_seconds']:>12.3f} {i['dmlib_seconds']:>12.3f} {i['ratio_vs_cmp']:>8.2f}  <= 1.5"
    )
    print(
        f"{'identical, hash=none: seconds (cmp)':<44} {i['cmp_seconds']:>12.3f} {i['dmlib_no_hash_seconds']:>12.3f} {i['ratio_vs_cmp_no_hash']:>8.2f}  (bytes only)"
    )
    print(
        f"{'identical, + file hashes: seconds (cmp)':<44} {i['cmp_seconds']:>12.3f} {i['dmlib_with_file_hashes_seconds']:>12.3f} {i['ratio_vs_cmp_with_file_hashes']:>8.2f}"
    )
    cli = i["dmlib_cli_process_seconds"]
    print(
        f"{'identical: whole `dmlib compare` process':<44} {i['cmp_seconds']:>12.3f} {cli:>12.3f}"
        f" {cli / i['cmp_seconds']:>8.2f}  (imports included; reference only)"
    )
    print(
        f"{'15% differ: seconds (numpy script)':<44} {d['numpy_seconds']:>12.3f} {d['dmlib_seconds']:>12.3f} {d['speedup']:>8.1f}x >= 10x"
    )
    print(
        f"{'15% differ: peak RSS MiB (numpy script)':<44} {d['numpy_vmhwm_mib']:>12.0f} {d['dmlib_vmhwm_mib']:>12.0f} {d['memory_ratio']:>8.3f}  < 0.1"
    )
    print(
        f"{'peak RSS MiB, SIZE vs 4 x SIZE (dmlib)':<44} {m['dmlib_vmhwm_mib'][0]:>12.0f} {m['dmlib_vmhwm_mib'][1]:>12.0f} {m['ratio']:>8.2f}  <= 1.2"
    )
    print(
        f"load average before/after: {result['loadavg_before'][0]:.1f} / {result['loadavg_after'][0]:.1f}"
    )
    print(f"results: {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
