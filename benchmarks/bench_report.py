"""``dmlib report`` on a study of 4 runs x 6 checkpoints of a 0.5M-parameter model.

Side by side in one run: the whole report (every notebook the study feeds, HTML, the
self-contained file, provenance) against its floor, the same number of kernels started
by the same runner that only import what the notebooks import and read the study. The
target is the whole report in under 30 s on a 2-core machine, kernel starts included.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import numpy as np

from dmlib.io.safetensors import write_safetensors
from dmlib.report.build import build_report
from dmlib.report.runner import run_notebooks
from dmlib.report.study import load_study

RESULTS = Path(__file__).parent / "results"
# 0.49M float32 parameters: two 512 x 384 matrices, a 256 x 384 head and their biases
SHAPES = {
    "body.0.weight": (512, 384),
    "body.0.bias": (512,),
    "body.1.weight": (384, 512),
    "body.1.bias": (384,),
    "head.weight": (256, 384),
    "head.bias": (256,),
}
STEPS = (5, 10, 15, 20, 25, 30)


def make_study(root: Path, n_runs: int = 4) -> Path:
    """Runs drifting apart by a growing number of one-ULP changes; the last is another seed."""
    for r in range(n_runs):
        seed = 1 if r == n_runs - 1 else 0
        base = np.random.default_rng(seed)
        params = {k: base.standard_normal(s).astype(np.float32) * 0.05 for k, s in SHAPES.items()}
        noise = np.random.default_rng(100 + r)
        (root / f"run{r}").mkdir(parents=True)
        for i, step in enumerate(STEPS):
            out = {}
            for k, v in params.items():
                v = v.copy()
                if r and seed == 0:  # runs 1..n-2: rounding-level drift that grows with the step
                    hit = noise.random(v.shape) < 0.01 * (i + 1)
                    v[hit] = np.nextafter(v[hit], np.float32(np.inf))
                out[k] = v
            write_safetensors(
                root / f"run{r}" / f"step{step:03d}.safetensors", out, metadata={"step": str(step)}
            )
    runs = "\n".join(f'run{r} = "run{r}/"' for r in range(n_runs))
    (root / "study.toml").write_text(
        f'title = "benchmark"\ncontrol = "run{n_runs - 1}"\n\n[runs]\n{runs}\n\n[repeats]\nrun1 = "run0"\n'
    )
    return root / "study.toml"


def floor_notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            'STUDY = "study.toml"\nFIGURE_DIR = "figures"\nSMALL = False',
            metadata={"tags": ["parameters"]},
        ),
        nbformat.v4.new_code_cell(
            "import matplotlib.pyplot as plt\nimport pandas as pd\nimport dmlib\n"
            "from dmlib import plots, report\nfrom dmlib.report import prose\nstudy = report.load_study(STUDY)"
        ),
    ]
    nbformat.write(nb, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="accepted for benchmarks.run; same sizes")
    p.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="dmlib-bench-report-"))
    try:
        study_path = make_study(tmp / "study")
        study = load_study(study_path)
        n_params = sum(int(np.prod(s)) for s in SHAPES.values())
        t0 = time.perf_counter()
        results = build_report(study, tmp / "report")
        full = time.perf_counter() - t0
        ran = [r for r in results if not r.skipped]
        assert all(r.ok for r in ran), [r.describe() for r in ran]
        # floor: as many kernels, by the same runner, importing and reading the study only
        nbdir = tmp / "floor"
        nbdir.mkdir()
        for r in ran:
            floor_notebook(nbdir / f"{r.name}.ipynb")
        shutil.copy(tmp / "report" / "study.toml", tmp / "study.toml")
        t0 = time.perf_counter()
        run_notebooks(sorted(nbdir.glob("*.ipynb")), tmp, {"STUDY": "study.toml"})
        floor = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {
        "study": f"4 runs x {len(STEPS)} checkpoints, {n_params:,} float32 parameters each",
        "notebooks_run": [r.name for r in ran],
        "report_s": round(full, 2),
        "floor_s": round(floor, 2),
        "report_over_floor": round(full / floor, 2),
        "target_s": 30,
        "met": full < 30,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_report.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
