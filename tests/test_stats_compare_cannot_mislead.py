"""Comparisons that cannot mislead: every edge case gives an explicit row or attr, and
``summarize`` says "identical" only when every common tensor was compared and matched.

Inputs are tiny hand-made arrays; every expected number is worked out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

import dmlib
from dmlib.tensor import ArrayTensorSet

NAN = np.float32("nan")


def _cmp(a: dict, b: dict, **kw):
    return dmlib.compare(ArrayTensorSet(a), ArrayTensorSet(b), **kw)


def _row(df, name: str) -> dict:
    rows = df[df["name"] == name].to_dict("records")
    assert len(rows) == 1, f"no single row for {name!r}"
    return rows[0]


def test_identical_sets_are_identical() -> None:
    a = {"w": np.array([1.0, -2.0], np.float32), "i": np.array([3, 4], np.int64)}
    s = dmlib.summarize(_cmp(a, {k: v.copy() for k, v in a.items()}))
    assert s["identical"] is True and s["n_tensors"] == 2 and s["n_diff"] == 0


def test_one_sided_names_are_listed_and_forbid_identical() -> None:
    same = np.ones(2, np.float32)
    df = _cmp({"w": same, "only_a": same}, {"w": same, "only_b": same})
    assert df.attrs["only_in_a"] == ["only_a"] and df.attrs["only_in_b"] == ["only_b"]
    assert list(df["name"]) == ["w"]
    s = dmlib.summarize(df)
    assert (
        s["identical"] is False and s["n_diff"] == 0
    )  # every compared byte equal, yet not identical


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (np.ones(2, np.float32), np.ones(2, np.float16)),  # dtype
        (np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)),  # shape, same numel
        (np.array([1, 0], np.uint8), np.array([True, False])),  # same bytes, other dtype
        (np.ones(4, np.int32), np.ones(4, np.float32)),
    ],
)
def test_dtype_or_shape_mismatch_is_explicit_not_compared(a: np.ndarray, b: np.ndarray) -> None:
    df = _cmp({"t": a, "ok": np.zeros(1, np.float32)}, {"t": b, "ok": np.zeros(1, np.float32)})
    assert "t" not in set(df["name"])
    (m,) = df.attrs["mismatched"]
    assert m["name"] == "t" and (m["dtype_a"], m["shape_a"]) != (m["dtype_b"], m["shape_b"])
    s = dmlib.summarize(df)
    assert s["mismatched"] == ["t"] and s["identical"] is False


def test_empty_tensors_get_a_row() -> None:
    e = np.zeros((0, 3), np.float32)
    r = _row(_cmp({"e": e}, {"e": e.copy()}), "e")
    assert (r["numel"], r["n_diff"], r["frac_diff"]) == (0, 0, 0.0)


def test_all_nan_tensors() -> None:
    a = np.full(3, NAN, np.float32)
    other_payload = (a.view(np.uint32) | np.uint32(1)).view(np.float32)  # still NaN, other bits
    r = _row(_cmp({"n": a}, {"n": a.copy()}), "n")
    assert r["n_diff"] == 0  # same NaN bits: equal
    df = _cmp({"n": a}, {"n": other_payload})
    r = _row(df, "n")
    assert (r["n_diff"], r["n_nan_payload"], r["ulp_nonfinite"]) == (3, 3, 3)
    assert dmlib.summarize(df)["identical"] is False
    r = _row(_cmp({"n": a}, {"n": np.array([NAN, 1.0, 2.0], np.float32)}), "n")
    assert (r["n_diff"], r["n_nan_vs_num"], r["first_diff"]) == (2, 2, (1,))


def test_zero_norm_reference() -> None:
    z = np.zeros(3, np.float32)
    r = _row(_cmp({"z": z}, {"z": np.array([0.0, 0.5, 0.0], np.float32)}), "z")
    assert r["rel_fro"] == np.inf and r["cosine"] == 0.0 and r["max_abs"] == 0.5
    r = _row(_cmp({"z": z}, {"z": z.copy()}), "z")
    assert r["rel_fro"] == 0.0 and r["cosine"] == 1.0 and r["n_diff"] == 0


def test_signed_zero_is_a_difference() -> None:
    df = _cmp({"z": np.array([0.0, 1.0], np.float32)}, {"z": np.array([-0.0, 1.0], np.float32)})
    r = _row(df, "z")
    assert (r["n_diff"], r["n_signed_zero"], r["max_abs"]) == (1, 1, 0.0)
    assert dmlib.summarize(df)["identical"] is False


def test_bools_compare_by_truth_value() -> None:
    r = _row(_cmp({"m": np.array([True, False, True])}, {"m": np.array([True, True, True])}), "m")
    assert (r["n_diff"], r["first_diff"]) == (1, (1,))


def test_summarize_of_a_filtered_frame_is_not_identical() -> None:
    """pandas copies attrs onto filtered frames; a frame missing rows must not pass as identical."""
    df = _cmp(
        {"x": np.array([1, 2], np.float32), "y": np.ones(2, np.float32)},
        {"x": np.array([1, 3], np.float32), "y": np.ones(2, np.float32)},
    )
    assert dmlib.summarize(df)["identical"] is False
    assert dmlib.summarize(df[df["n_diff"] == 0])["identical"] is False
    assert dmlib.summarize(df.head(0))["identical"] is False


def test_summarize_of_an_empty_selection_is_not_identical() -> None:
    """include/exclude that match nothing would compare nothing: refused, never "identical"."""
    x = {"x": np.array([1, 2], np.float32)}
    with pytest.raises(dmlib.DmlibError, match="matches no tensor name"):
        _cmp(x, x, include="no-such-name")
    with pytest.raises(dmlib.DmlibError, match="leaves no tensor"):
        _cmp(x, x, include="x", exclude="x")
