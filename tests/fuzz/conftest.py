"""Hypothesis profiles for the fuzz suites, and a count of the cases each one ran.

``DMLIB_FUZZ_PROFILE=fast`` (the default, used by ``make test``) runs a few dozen
derandomized examples per test, so CI is reproducible; ``DMLIB_FUZZ_PROFILE=long``
(``make fuzz``) runs many more, randomly. The profiles are applied per test through
``@fuzzlib.fuzz()`` rather than loaded globally, so other hypothesis tests keep their own
settings.
"""

from __future__ import annotations

import os
import time

import pytest
from _support import fuzzlib
from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
    print_blob=True,
)
settings.register_profile("dmlib-fast", max_examples=40, derandomize=True, database=None, **_COMMON)
settings.register_profile("dmlib-long", max_examples=2500, **_COMMON)

PROFILE = fuzzlib.PROFILE

#: ``DMLIB_FUZZ_SECONDS`` (``make fuzz`` sets it): the run's time budget. A fuzz test that
#: would start after it is spent is skipped, saying so; one already running finishes its
#: examples (a failure is never cut short or hidden).
BUDGET = float(os.environ.get("DMLIB_FUZZ_SECONDS") or 0)
_STARTED = time.monotonic()


def pytest_runtest_setup(item) -> None:  # noqa: ARG001
    if BUDGET and time.monotonic() - _STARTED > BUDGET:
        pytest.skip(f"the fuzz budget of {BUDGET:g} s (DMLIB_FUZZ_SECONDS) is spent")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if not fuzzlib.COUNTS:
        return
    tr = terminalreporter
    tr.section(f"dmlib fuzz cases (profile {PROFILE})")
    total = 0
    for target in sorted(fuzzlib.COUNTS):
        c = fuzzlib.COUNTS[target]
        n = c["read"] + c["refused"]
        total += n
        tr.write_line(
            f"{target:<28} {n:6d} cases: {c['read']:6d} read correctly, {c['refused']:6d} refused"
        )
    tr.write_line(f"{'total':<28} {total:6d} cases")
