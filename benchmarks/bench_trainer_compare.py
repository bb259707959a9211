"""``dmlib compare`` of two Hugging Face Trainer checkpoints, a first and a later time.

Two real ``transformers.Trainer`` runs of a tiny Llama (tests/_support/hf_train.py, 6
steps, same seed) are trained under benchmarks/_work/ and deleted at the end. Whole
``dmlib compare runs/A/checkpoint-6 runs/B/checkpoint-6`` processes, through the
measuring launcher (benchmarks/_proc.py), best of ``--repeat``:

- ``cold``: with an empty parameter-order cache (``DMLIB_CACHE_DIR`` a new folder each
  run): transformers is imported to rebuild the order that names the optimizer moments;
- ``warm``: with the order already cached (the common case: the same model again);
- ``off``: ``DMLIB_CACHE_DIR=off`` (no cache; as before the cache existed);
- ``weights``: the same compare of the two ``model.safetensors`` alone (the floor).

Reported: seconds and ratios to ``weights``.

    python -m benchmarks.bench_trainer_compare [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._proc import run_cpu

HERE = Path(__file__).resolve().parent
WORK = HERE / "_work" / "trainer"
RESULTS = HERE / "results" / "trainer_compare.json"
TRAIN = """
import sys
sys.path.insert(0, sys.argv[1])
from _support import hf_train
hf_train.train(sys.argv[2] + "/A", seed=0)
hf_train.train(sys.argv[2] + "/B", seed=0)
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one run of each")
    args = p.parse_args(argv)
    repeat = 1 if args.quick else args.repeat
    WORK.mkdir(parents=True, exist_ok=True)
    env_base = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", TRAIN, str(HERE.parent / "tests"), str(WORK)],
                   check=True, capture_output=True, env=env_base, timeout=900)  # fmt: skip
    a, b = WORK / "A" / "checkpoint-6", WORK / "B" / "checkpoint-6"
    dmlib = [sys.executable, "-m", "dmlib", "compare"]
    warm_cache = tempfile.mkdtemp(prefix="dmlib-bench-cache-")
    best: dict[str, float] = {}
    try:
        for _ in range(repeat):
            cold_cache = tempfile.mkdtemp(prefix="dmlib-bench-cache-")
            runs = {
                "cold": (dmlib + [str(a), str(b)], cold_cache),
                "warm": (dmlib + [str(a), str(b)], warm_cache),
                "off": (dmlib + [str(a), str(b)], "off"),
                "weights": (dmlib + [str(a / "model.safetensors"), str(b / "model.safetensors")],
                            "off"),
            }  # fmt: skip
            for name, (cmd, cache) in runs.items():
                os.environ["DMLIB_CACHE_DIR"] = cache  # the launcher passes the environment on
                dt, _, _ = run_cpu(cmd)
                best[name] = min(best.get(name, dt), dt)
            shutil.rmtree(cold_cache, ignore_errors=True)
    finally:
        os.environ.pop("DMLIB_CACHE_DIR", None)
        shutil.rmtree(warm_cache, ignore_errors=True)
        shutil.rmtree(WORK, ignore_errors=True)
    floor = best["weights"]
    out = {k: {"s": v, "ratio_to_weights": v / floor} for k, v in best.items()}
    for k, v in out.items():
        print(f"{k}: {v['s']:.2f} s ({v['ratio_to_weights']:.1f}x the weights-only compare)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
