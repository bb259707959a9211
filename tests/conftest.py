"""Shared test fixtures.

Real Burn checkpoints live outside the repository, in ``../shared/fixtures`` beside the
checkout; tests that need them skip with a clear reason when that folder is absent.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_FIXTURES = (REPO / ".." / "shared" / "fixtures").resolve()
BURNPACK_FIXTURES = SHARED_FIXTURES / "burnpack"


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
    """Real ``transformers.Trainer`` runs and an Accelerate state (tests/_hf_train.py),
    trained once per session in a subprocess; skips without transformers/accelerate."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    root = tmp_path_factory.mktemp("hf")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "_hf_train.py"), str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root
