"""Shared test fixtures.

Real Burn checkpoints live outside the repository, in ``../shared/fixtures`` beside the
checkout; tests that need them skip with a clear reason when that folder is absent.
"""

from __future__ import annotations

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
