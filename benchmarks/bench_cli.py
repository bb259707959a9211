"""Whole ``dmlib`` processes next to their baselines, as a user runs them, in one run.

Every measurement is a child process timed from spawn to exit, its peak RSS and CPU
seconds (user + system, all threads) taken from ``wait4``; the programs of one row run interleaved (dmlib, baseline,
dmlib, ...) so that load from other processes falls on both alike, and the best of N
runs is kept for each. Page cache warm unless said otherwise.

1. start-up: ``dmlib compare`` on two 64-byte files, next to ``python -c pass`` and
   ``python -c "import numpy"`` (the floor any numpy program pays);
2. identical pair: ``dmlib compare A A_copy`` vs ``cmp A A_copy``;
3. differing pair (~15 % of elements 1-2 ULP apart): ``dmlib compare`` vs the numpy
   script of ``bench_compare.py`` (both files whole in memory); time and peak memory;
4. ``dmlib matrix`` of 7 runs (6 bit-identical + 1 differing) vs one differing
   ``dmlib compare``.

Files: safetensors with 64 float32 tensors (``--size-mib`` per checkpoint, default 512),
under benchmarks/_work/, deleted at the end.

Bytecode: dmlib's modules are compiled first (``compileall``), as they are on a user's
machine (pip compiles them at install; an editable install writes them at first import).
Where ``PYTHONDONTWRITEBYTECODE`` is set and nothing compiled them, every ``dmlib`` start
compiles its modules from source again: the start-up row then reads about 0.05 s higher.

The text output of ``dmlib compare`` shows no hash, so none is computed (the bytes are
compared); ``--json`` reports a BLAKE3 hash per tensor (one side of a bit-identical
pair): its row is measured too, next to ``cmp``.

    python -m benchmarks.bench_cli [--size-mib 512] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from benchmarks._proc import run_cpu

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / "_work_cli"
RESULTS = HERE / "results" / "cli.json"
N_TENSORS = 64


def write_pair(path_a: Path, path_b: Path, nbytes: int, seed: int, frac: float = 0.15) -> None:
    """Two safetensors files of N_TENSORS float32 tensors; b has ~frac of elements +1/+2 ULP."""
    per = max(4, nbytes // N_TENSORS // 4 * 4)
    header, off = {}, 0
    for i in range(N_TENSORS):
        header[f"blocks.{i}.weight"] = {
            "dtype": "F32",
            "shape": [per // 4],
            "data_offsets": [off, off + per],
        }
        off += per
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    rng = np.random.default_rng(seed)
    with open(path_a, "wb") as fa, open(path_b, "wb") as fb:
        for f in (fa, fb):
            f.write(len(hb).to_bytes(8, "little") + hb)
        left = per * N_TENSORS
        while left:
            n = min(1 << 24, left) // 4
            a = rng.standard_normal(n, dtype=np.float32)
            fa.write(a.tobytes())
            bits = a.view(np.uint32)
            moved = rng.random(n, dtype=np.float32) < frac
            bits[moved] += rng.integers(1, 3, int(moved.sum()), dtype=np.uint32)
            fb.write(bits.tobytes())
            left -= n * 4


def warm(*paths: Path) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


def interleaved(cmds: dict[str, list[str]], repeat: int) -> dict[str, dict]:
    """Best-of-``repeat`` seconds and peak RSS of each command, runs interleaved."""
    runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cmds}
    for _ in range(repeat):
        for k, cmd in cmds.items():
            runs[k].append(run_cpu(cmd, cwd=ROOT))
    return {
        k: {
            "best_seconds": min(s for s, _, _ in v),
            "runs_seconds": [round(s, 4) for s, _, _ in v],
            "peak_rss_mib": max(m for _, m, _ in v),
            # CPU seconds (user + system, every thread): what a loaded machine does not inflate
            "best_cpu_seconds": min(c for _, _, c in v),
            "runs_cpu_seconds": [round(c, 4) for _, _, c in v],
        }
        for k, v in runs.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--size-mib", type=int, default=512, help="size of each checkpoint (default 512)"
    )
    p.add_argument("--repeat", type=int, default=3, help="runs per command (best of)")
    p.add_argument(
        "--quick", action="store_true", help="tiny files: a smoke test, not a measurement"
    )
    args = p.parse_args(argv)
    import compileall

    compileall.compile_dir(str(ROOT / "dmlib"), quiet=1)
    size = (4 << 20) if args.quick else args.size_mib << 20
    repeat = 1 if args.quick else args.repeat
    py = sys.executable
    dm = [py, "-m", "dmlib"]
    WORK.mkdir(parents=True, exist_ok=True)
    A, B, A2 = WORK / "a.safetensors", WORK / "b.safetensors", WORK / "a_copy.safetensors"
    T1, T2 = WORK / "tiny_a.safetensors", WORK / "tiny_b.safetensors"
    copies = [WORK / f"run{i}.safetensors" for i in range(5)]
    from dmlib.kernels.stream import kernel_name

    result: dict = {
        "kernels": kernel_name(),
        "size_bytes": size,
        "repeat": repeat,
        "cpus": os.cpu_count(),
        "quick": args.quick,
    }
    result["loadavg_before"] = os.getloadavg()
    try:
        write_pair(A, B, size, seed=1)
        shutil.copyfile(A, A2)
        for c in copies:
            shutil.copyfile(A, c)
        # 64-byte files: one float32 tensor of 4 elements each
        hdr = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}'
        hdr += b" " * (-len(hdr) % 8)
        for t in (T1, T2):
            t.write_bytes(
                len(hdr).to_bytes(8, "little") + hdr + np.arange(4, dtype=np.float32).tobytes()
            )
        warm(A, A2, B, *copies, T1, T2)

        r = interleaved(
            {
                "dmlib compare (64-byte files)": [*dm, "compare", str(T1), str(T2)],
                "python -c pass": [py, "-c", "pass"],
                "python -c 'import numpy'": [py, "-c", "import numpy"],
            },
            max(repeat, 5),
        )
        result["startup"] = r

        warm(A, A2)
        result["identical"] = interleaved(
            {
                "dmlib compare": [*dm, "compare", str(A), str(A2)],
                "cmp": ["cmp", str(A), str(A2)],
                "dmlib compare --json": [*dm, "compare", "--json", str(A), str(A2)],
            },
            repeat,
        )
        warm(A, B)
        numpy_script = [py, "-m", "benchmarks.bench_compare", "--child", "numpy", str(A), str(B)]
        result["differing"] = interleaved(
            {
                "dmlib compare": [*dm, "compare", str(A), str(B)],
                "numpy script": numpy_script,
                # the same command without the compiled kernel (dmlib/kernels/_fused.c)
                "dmlib compare, numpy kernels": [
                    "env", "DMLIB_KERNELS=numpy", *dm, "compare", str(A), str(B),
                ],
            },
            min(repeat, 2),  # the numpy script takes tens of seconds a run here
        )  # fmt: skip
        runs = [f"r{i}={c}" for i, c in enumerate([A, A2, *copies])] + [f"ctrl={B}"]
        warm(A, A2, B, *copies)
        result["matrix"] = interleaved(
            {
                "dmlib matrix (7 runs, 6 identical)": [*dm, "matrix", *runs, "--control", "ctrl"],
                "dmlib compare (differing pair)": [*dm, "compare", str(A), str(B)],
            },
            repeat,
        )
    finally:
        for f in (A, B, A2, T1, T2, *copies):
            f.unlink(missing_ok=True)
    result["loadavg_after"] = os.getloadavg()

    s, i, d, m = result["startup"], result["identical"], result["differing"], result["matrix"]
    rows = [
        (
            "start-up: dmlib compare, 64-byte files (s)",
            None,
            s["dmlib compare (64-byte files)"]["best_seconds"],
            "<= 0.35 s",
        ),
        (
            "  python -c pass / import numpy (s)",
            s["python -c pass"]["best_seconds"],
            s["python -c 'import numpy'"]["best_seconds"],
            "floor",
        ),
        (
            "identical: seconds (cmp)",
            i["cmp"]["best_seconds"],
            i["dmlib compare"]["best_seconds"],
            "<= 1.2x",
        ),
        (
            "identical, --json (BLAKE3 of one side) (cmp)",
            i["cmp"]["best_seconds"],
            i["dmlib compare --json"]["best_seconds"],
            "(hashes shown)",
        ),
        (
            "15% differ: seconds (numpy script)",
            d["numpy script"]["best_seconds"],
            d["dmlib compare"]["best_seconds"],
            ">= 15x faster",
        ),
        (
            "15% differ, numpy kernels: seconds (script)",
            d["numpy script"]["best_seconds"],
            d["dmlib compare, numpy kernels"]["best_seconds"],
            ">= 15x faster",
        ),
        (
            "identical: CPU seconds (cmp)",
            i["cmp"]["best_cpu_seconds"],
            i["dmlib compare"]["best_cpu_seconds"],
            "<= 1.2x",
        ),
        (
            "15% differ: CPU seconds (numpy script)",
            d["numpy script"]["best_cpu_seconds"],
            d["dmlib compare"]["best_cpu_seconds"],
            ">= 15x faster",
        ),
        (
            "15% differ: peak RSS MiB (numpy script)",
            d["numpy script"]["peak_rss_mib"],
            d["dmlib compare"]["peak_rss_mib"],
            "<= 0.1",
        ),
        (
            "matrix 7 runs vs one differing compare (s)",
            m["dmlib compare (differing pair)"]["best_seconds"],
            m["dmlib matrix (7 runs, 6 identical)"]["best_seconds"],
            "<= 3x",
        ),
    ]
    result["ratios"] = {
        "identical_vs_cmp": i["dmlib compare"]["best_seconds"] / i["cmp"]["best_seconds"],
        "identical_json_vs_cmp": i["dmlib compare --json"]["best_seconds"]
        / i["cmp"]["best_seconds"],
        "differing_speedup_vs_numpy": d["numpy script"]["best_seconds"]
        / d["dmlib compare"]["best_seconds"],
        "differing_numpy_kernels_speedup_vs_numpy": d["numpy script"]["best_seconds"]
        / d["dmlib compare, numpy kernels"]["best_seconds"],
        "identical_cpu_vs_cmp": i["dmlib compare"]["best_cpu_seconds"]
        / i["cmp"]["best_cpu_seconds"],
        "differing_cpu_speedup_vs_numpy": d["numpy script"]["best_cpu_seconds"]
        / d["dmlib compare"]["best_cpu_seconds"],
        "differing_memory_vs_numpy": d["dmlib compare"]["peak_rss_mib"]
        / d["numpy script"]["peak_rss_mib"],
        "matrix_vs_one_compare": m["dmlib matrix (7 runs, 6 identical)"]["best_seconds"]
        / m["dmlib compare (differing pair)"]["best_seconds"],
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(
        f"whole processes, {size >> 20} MiB per checkpoint, best of {repeat}"
        f"{' (QUICK: not a measurement)' if args.quick else ''}"
    )
    print(f"{'measurement':<46} {'baseline':>10} {'dmlib':>10} {'ratio':>8}  target")
    for name, base, val, target in rows:
        ratio = "" if base is None else f"{(base / val if 'faster' in target else val / base):8.3g}"
        b = "" if base is None else f"{base:10.3f}"
        print(f"{name:<46} {b:>10} {val:>10.3f} {ratio:>8}  {target}")
    la, lb = result["loadavg_before"][0], result["loadavg_after"][0]
    print(
        f"load average before/after: {la:.1f} / {lb:.1f} (a shared machine: ratios, not absolutes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
