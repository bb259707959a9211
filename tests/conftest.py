"""Shared test fixtures.

Real Burn checkpoints live outside the repository, in ``../shared/fixtures`` beside the
checkout; tests that need them skip with a clear reason when that folder is absent.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_FIXTURES = (REPO / ".." / "shared" / "fixtures").resolve()
BURNPACK_FIXTURES = SHARED_FIXTURES / "burnpack"

# dmlib keeps rebuilt Hugging Face parameter orders in a cache folder (dmlib.io._hf_names):
# the tests, and the commands they start, use a folder of their own, never the user's
os.environ["DMLIB_CACHE_DIR"] = tempfile.mkdtemp(prefix="dmlib-test-cache-")


@pytest.fixture
def burnpack_fixtures() -> Path:
    """The folder of real Burn checkpoints; skips the test when it is not there."""
    if not BURNPACK_FIXTURES.is_dir():
        pytest.skip(
            f"real Burn fixtures not found at {BURNPACK_FIXTURES} (../shared/fixtures beside the checkout)"
        )
    return BURNPACK_FIXTURES


@pytest.fixture(scope="session")
def hf_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real ``transformers.Trainer`` runs and an Accelerate state (tests/_support/hf_train.py),
    trained once per session in a subprocess; skips without transformers/accelerate."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    root = tmp_path_factory.mktemp("hf")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "_support" / "hf_train.py"), str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root


# Modules whose tests start notebook kernels, a Dask cluster or real models: marked `slow`
# here, in one place, so that `pytest -m "not slow"` is a quick inner loop; `make test` runs
# everything. A test of another module that takes more than ~10 s marks itself.
SLOW_MODULES = {
    "test_notebooks.py": "runs the report notebooks in kernels",
    "test_report_study.py": "builds reports (notebook kernels)",
    "test_engine_dask.py": "a Dask LocalCluster",
    "test_engine_dask_forensics.py": "a Dask LocalCluster",
    "test_lab_ladder.py": "trains the lab's ladder runs",
    "test_lab_qr.py": "runs the lab's QR generator",
    "test_lab_packed_ops.py": "captures the lab's packed model at op level",
    "test_localize_minilm.py": "the real MiniLM model",
    "test_minilm.py": "the real MiniLM model",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
