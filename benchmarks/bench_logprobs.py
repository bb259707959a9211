"""``dmlib logprobs`` next to the numpy script a user would write, as whole processes.

Two safetensors files of ``--seqs`` sequences x ``--tokens`` tokens: ``logprobs`` (float32),
``tokens`` (int64), ``top_logprobs`` (float32) and ``top_ids`` (int32) of the top
``--top`` ids per position (default 1,000 x 1,000 x 20: about 170 MB per file); B is A
with a perturbation of about 1e-3 on 10 % of the tokens and 3 of the 20 top ids swapped at
every position. Rows, interleaved and best of ``--repeat`` (peak RSS and CPU seconds from
``wait4``, through ``benchmarks/_proc.py``):

1. ``dmlib logprobs A B`` (every figure: the identity gate on the tokens, the sampled-token
   figures, top-k KL and overlap), and with ``--sampled-only`` (the gate and the
   sampled-token figures: the script's three and the rest of the table);
2. the numpy script: ``safetensors.numpy.load_file`` both files, then mean and max
   ``|dlogprob|`` and k3 of the sampled tokens;
3. the same script reading only the ``logprobs`` tensors (``safe_open``), the floor a
   careful user reaches for the three figures alone.

Ratios: dmlib / script (time and peak memory); target: time <= 1, memory <= 1 against
row 2. With ``--base DIR`` (a checkout of other code, e.g. ``git worktree add /tmp/base
HEAD~3``, its compiled module built there), rows 1 run once more from ``DIR`` in every
round (``python -m dmlib`` there imports that checkout's dmlib), interleaved with the
others. The load average (``os.getloadavg``) is recorded before and after every round:
the machine may be shared.

    python -m benchmarks.bench_logprobs [--seqs 1000] [--tokens 1000] [--top 20] [--repeat 3]
        [--base DIR] [--quick]
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
WORK = HERE / "_work_logprobs"
RESULTS = HERE / "results" / "logprobs.json"

SCRIPT = """
import sys
import numpy as np
from safetensors.numpy import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
x = a["logprobs"].astype(np.float64)
y = b["logprobs"].astype(np.float64)
d = y - x
ad = np.abs(d)
print(ad.mean(), ad.max(), np.mean(np.expm1(d) - d))
"""

SCRIPT_LOGPROBS_ONLY = """
import sys
import numpy as np
from safetensors import safe_open
def lp(p):
    with safe_open(p, framework="np") as f:
        return f.get_tensor("logprobs").astype(np.float64)
x, y = lp(sys.argv[1]), lp(sys.argv[2])
d = y - x
ad = np.abs(d)
print(ad.mean(), ad.max(), np.mean(np.expm1(d) - d))
"""


def write_pair(a: Path, b: Path, seqs: int, tokens: int, top: int) -> None:
    """The two files (see the module docstring)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    lp = -rng.exponential(2.0, (seqs, tokens)).astype(np.float32)
    tok = rng.integers(0, 150_000, (seqs, tokens), dtype=np.int64)
    top_lp = np.sort(-rng.exponential(3.0, (seqs, tokens, top)).astype(np.float32), axis=-1)[
        ..., ::-1
    ]
    ids = rng.integers(0, 150_000, (seqs, tokens, top), dtype=np.int32)
    save_file(
        {
            "logprobs": lp,
            "tokens": tok,
            "top_logprobs": np.ascontiguousarray(top_lp),
            "top_ids": ids,
        },
        str(a),
    )
    noisy = rng.random((seqs, tokens)) < 0.1
    lp_b = np.where(noisy, lp + rng.normal(0, 1e-3, lp.shape).astype(np.float32), lp)
    ids_b = ids.copy()
    ids_b[..., -3:] = rng.integers(0, 150_000, (seqs, tokens, 3), dtype=np.int32)
    save_file(
        {
            "logprobs": np.minimum(lp_b, 0).astype(np.float32),
            "tokens": tok,
            "top_logprobs": np.ascontiguousarray(top_lp),
            "top_ids": ids_b,
        },
        str(b),
    )


def interleaved(
    cmds: dict[str, tuple[list[str], Path]], repeat: int, loads: list[list[float]]
) -> dict[str, dict]:
    """Every command once per round, in order (each from its folder), ``repeat`` rounds;
    the 1-minute load average before and after each round appended to ``loads``."""
    runs: dict[str, list[tuple[float, float, float]]] = {k: [] for k in cmds}
    for _ in range(repeat):
        before = os.getloadavg()[0]
        for k, (cmd, cwd) in cmds.items():
            runs[k].append(run_cpu(cmd, cwd=cwd))
        loads.append([round(before, 2), round(os.getloadavg()[0], 2)])
    return {
        k: {
            "best_seconds": min(s for s, _, _ in v),
            "runs_seconds": [round(s, 3) for s, _, _ in v],
            "peak_rss_mib": max(m for _, m, _ in v),
            "best_cpu_seconds": min(c for _, _, c in v),
        }
        for k, v in runs.items()
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seqs", type=int, default=1000)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny files: a smoke test")
    p.add_argument("--base", type=Path, help="a checkout whose dmlib runs beside this one's")
    args = p.parse_args(argv)
    import compileall

    for root in (ROOT, *([args.base] if args.base else [])):
        compileall.compile_dir(str(root / "dmlib"), quiet=1)
    seqs, tokens = (50, 100) if args.quick else (args.seqs, args.tokens)
    repeat = 1 if args.quick else args.repeat
    WORK.mkdir(parents=True, exist_ok=True)
    a, b = WORK / "a.safetensors", WORK / "b.safetensors"
    try:
        write_pair(a, b, seqs, tokens, args.top)
        for path in (a, b):  # page cache warm for every row alike
            with open(path, "rb") as f:
                while f.read(1 << 24):
                    pass
        py = sys.executable
        full = [py, "-m", "dmlib", "logprobs", str(a), str(b)]
        cmds = {
            "dmlib logprobs": (full, ROOT),
            "dmlib logprobs --sampled-only": ([*full, "--sampled-only"], ROOT),
        }
        if args.base:
            cmds["base: dmlib logprobs"] = (full, args.base)
            cmds["base: dmlib logprobs --sampled-only"] = ([*full, "--sampled-only"], args.base)
        cmds["numpy script (load_file)"] = ([py, "-c", SCRIPT, str(a), str(b)], ROOT)
        cmds["numpy script (logprobs only)"] = (
            [py, "-c", SCRIPT_LOGPROBS_ONLY, str(a), str(b)],
            ROOT,
        )
        loads: list[list[float]] = []
        rows = interleaved(cmds, repeat, loads)
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    base = rows["numpy script (load_file)"]
    dm = rows["dmlib logprobs"]
    dm_sampled = rows["dmlib logprobs --sampled-only"]
    result = {
        "seqs": seqs,
        "tokens": tokens,
        "top": args.top,
        "repeat": repeat,
        "cpus": os.cpu_count(),
        "rows": rows,
        "time_ratio": dm["best_seconds"] / base["best_seconds"],
        "cpu_ratio": dm["best_cpu_seconds"] / base["best_cpu_seconds"],
        "memory_ratio": dm["peak_rss_mib"] / base["peak_rss_mib"],
        "sampled_only_time_ratio": dm_sampled["best_seconds"] / base["best_seconds"],
        "sampled_only_cpu_ratio": dm_sampled["best_cpu_seconds"] / base["best_cpu_seconds"],
        "sampled_only_memory_ratio": dm_sampled["peak_rss_mib"] / base["peak_rss_mib"],
        "load_average_per_round": loads,
    }
    for r in rows.values():
        r["vs_script"] = [
            round(r["best_seconds"] / base["best_seconds"], 3),
            round(r["best_cpu_seconds"] / base["best_cpu_seconds"], 3),
            round(r["peak_rss_mib"] / base["peak_rss_mib"], 3),
        ]
    for k, r in rows.items():
        print(
            f"{k:36s} {r['best_seconds']:7.3f} s  {r['best_cpu_seconds']:7.3f} s CPU  "
            f"{r['peak_rss_mib']:8.1f} MiB  vs script {r['vs_script']}  runs {r['runs_seconds']}"
        )
    print(f"load average before / after each round: {loads}")
    print(
        f"dmlib / numpy script: time {result['time_ratio']:.2f}x, CPU {result['cpu_ratio']:.2f}x, "
        f"peak memory {result['memory_ratio']:.2f}x (target: <= 1, <= 1)"
    )
    print(
        f"dmlib --sampled-only / numpy script: time {result['sampled_only_time_ratio']:.2f}x, "
        f"CPU {result['sampled_only_cpu_ratio']:.2f}x, peak memory "
        f"{result['sampled_only_memory_ratio']:.2f}x"
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
