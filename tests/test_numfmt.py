"""dmlib.numfmt, the one way numbers are written, and the CLI's exit status of a result.

Every expected string is worked out by hand from the documented rule (4 significant
digits, scientific with 3 decimals below 1e-3 and from 1e4; integers whole in prose).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from dmlib import numfmt
from dmlib.cli._common import exit_code
from dmlib.cli._table import fmt as cell
from dmlib.report import prose


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.0, "0"),
        (-0.0, "-0"),  # the sign of a negative zero is kept in a table cell
        (float("nan"), "-"),
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (1e-17, "1.000e-17"),  # tiny is not zero
        (0.001, "0.001"),  # the boundary itself is plain
        (0.000999, "9.990e-04"),
        (9999.0, "9999"),
        (12346.0, "1.235e+04"),
        (1 / 3, "0.3333"),
        (-2.5, "-2.5"),
    ],
)
def test_short(value: float, text: str) -> None:
    assert numfmt.short(value) == text
    assert cell(value) == text  # a table cell of a float is exactly that


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "-"),
        (pd.NA, "-"),
        (10**20, "100000000000000000000"),  # an int is never rounded
        (-3, "-3"),
        ((2, 3), "(2,3)"),
        ("name", "name"),
    ],
)
def test_table_cell(value: object, text: str) -> None:
    assert cell(value) == text


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "-"),
        (pd.NA, "-"),
        (float("nan"), "-"),
        (np.float32("nan"), "-"),
        (0, "0"),
        (0.0, "0"),
        (-0.0, "0"),  # a whole number in a sentence: no sign on zero
        (1e-17, "1e-17"),  # not rounded to zero
        (math.inf, "inf"),
        (-math.inf, "-inf"),
        (10**20, "100000000000000000000"),
        (123456.0, "123456"),
        (1e15, "1e+15"),  # integral floats from 1e15 on are not written out
        (2 / 3, "0.667"),
        (np.float32(0.5), "0.5"),
        (np.int64(7), "7"),
    ],
)
def test_prose(value: object, text: str) -> None:
    assert numfmt.prose(value) == text
    assert prose.fmt(value) == text


def test_prose_digits() -> None:
    assert numfmt.prose(2 / 3, digits=5) == "0.66667"
    assert numfmt.prose(12345.678, digits=2) == "1.2e+04"


def test_sci_and_general() -> None:
    assert numfmt.sci(None) == "-"
    assert numfmt.sci(1.0) == "1.000e+00"
    assert numfmt.sci(0.00012346) == "1.235e-04"
    assert numfmt.sci(3) == "3"  # a ULP count stays an integer
    assert numfmt.general(None) == "-"
    assert numfmt.general(0.5) == "0.5"
    assert numfmt.general(2.0) == "2"
    assert numfmt.general(1e-7) == "1e-07"


def test_missing() -> None:
    assert numfmt.missing(None) and numfmt.missing(pd.NA)
    assert not numfmt.missing(float("nan")) and not numfmt.missing(0)


# ----------------------------------------------------------------------------------------
# exit_code: hand-made results of each kind


def _capture(first=None, held=True, passed=None, status="identical"):
    """A CaptureVerdict made by hand (the fields compare_captures fills)."""
    from dmlib.localize.culprits import CaptureVerdict

    return CaptureVerdict(
        status=status, n_comparable=3, unjudged=[], first_divergent_boundary=first,
        culprit=None, culprits=[], undetermined=[], entry=None, culprit_op=None,
        op_alignment=None, layout_inputs=[], stats_missing=[],
        repeat_control=None if held is None else {"held": held},
        negative_control={"passed": passed}, valid=None,
    )  # fmt: skip


def _arbitration(verdict):
    from dmlib.localize.arbitrate import Arbitration

    return Arbitration(op="aten.mm", verdict=verdict, reason="", table=pd.DataFrame())


def _repeats(verdict):
    from dmlib.localize.rates import RepeatStudy

    return RepeatStudy(table=pd.DataFrame(), observer=None, verdict=verdict, reason="")


def _runs(bit_exact, steps=(1,)):
    """Two Trainer runs compared (compare_runs' RunsVerdict), made by hand."""
    from dmlib.stats.verdicts import RunsVerdict

    first = None if bit_exact or not steps else 1
    return RunsVerdict(
        steps=list(steps), only_in_a=[], only_in_b=[], by_step={}, first_diff={},
        first_step=first, first_components=[] if first is None else ["weights"],
        loss_parts_at=None, bit_exact=bit_exact, inconclusive=[],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("result", "code"),
    [
        (_runs(True), 0),
        (_runs(False), 1),  # a difference at step 1
        (_runs(False, steps=[]), 1),  # the runs share no step: nothing compared
        (_capture(), 0),
        (_capture(first="enc.0", status="different"), 1),
        (_capture(held=False), 1),  # a failed repeat control is never "same"
        (_capture(held=None, passed=False), 1),
        (_capture(status="inconclusive"), 3),
        (_capture(status="inconclusive", held=False), 1),  # inconclusive, but a control failed
        (_arbitration("both-close"), 0),
        (_repeats("deterministic"), 0),
        (_arbitration("a-departs"), 1),
        (_repeats(None), 1),  # withheld
    ],
)
def test_exit_code(result: object, code: int) -> None:
    assert exit_code(result) == code


def test_exit_code_of_a_judged_table() -> None:
    assert exit_code(differs=False) == 0 and exit_code(differs=True) == 1


def test_exit_code_refuses_what_it_cannot_judge() -> None:
    with pytest.raises(TypeError):
        exit_code({"rows": []})
    for keys in (
        {"identical": True},
        {"first_divergent_boundary": None, "status": "identical"},
        {"bit_exact": True, "steps": [1]},  # two runs' verdict is a RunsVerdict, not a dict
    ):
        with pytest.raises(TypeError):  # a result is recognised by its type, not its keys
            exit_code(keys)
    with pytest.raises(TypeError):
        exit_code(SimpleNamespace(verdict="both-close"))
    with pytest.raises(TypeError):
        exit_code(None)
