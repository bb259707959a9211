"""dmlib._json.jsonable: the one JSON rule, case by case (expectations written by hand)."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pandas as pd
import pytest

from dmlib._json import jsonable
from dmlib.errors import DmlibError

CASES = [
    (None, None),
    (True, True),
    ("x", "x"),
    (3, 3),
    (0.5, 0.5),
    (math.nan, None),
    (math.inf, "inf"),
    (-math.inf, "-inf"),
    (pd.NA, None),
    (pd.NaT, None),
    (np.bool_(True), True),
    (np.int8(-3), -3),
    (np.uint64(2**64 - 1), 2**64 - 1),
    (np.float32(0.25), 0.25),
    (np.float16("inf"), "inf"),
    (np.float64("nan"), None),
    (ml_dtypes.bfloat16(-1.5), -1.5),
    (np.array([1.0, np.nan, -np.inf]), [1.0, None, "-inf"]),
    (np.array(7), 7),
    ((1, [2, {3: np.int64(4)}]), [1, [2, {"3": 4}]]),
    (pd.Series([1, None], dtype="Int64"), [1, None]),
]


@pytest.mark.parametrize(("value", "expected"), CASES, ids=[repr(c[0])[:30] for c in CASES])
def test_each_kind_of_value(value, expected):
    out = jsonable(value)
    assert out == expected
    json.dumps(out, allow_nan=False)  # strictly valid JSON: no NaN, no Infinity


def test_a_frame_becomes_its_rows():
    df = pd.DataFrame({"name": ["a", "b"], "rel_fro": [0.0, math.inf]})
    df["n"] = pd.array([1, None], dtype="Int64")
    assert jsonable(df) == [
        {"name": "a", "rel_fro": 0.0, "n": 1},
        {"name": "b", "rel_fro": "inf", "n": None},
    ]


def test_what_json_cannot_hold_raises_or_goes_through_default():
    with pytest.raises(DmlibError, match=r"record\('x'\): cannot store a bytes"):
        jsonable({"k": b"\x00"}, what="record('x')")
    assert jsonable({"k": b"\x00"}, default=str) == {"k": "b'\\x00'"}
