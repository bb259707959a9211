"""element_stats: the comparison's statistics and NaN policy, checked against numpy."""

import numpy as np
import pytest

import dmlib
from dmlib.localize.boundaries import element_stats


def _ordered(x: np.ndarray) -> np.ndarray:
    """float32 bit patterns on one integer line (the ULP count between two is their distance)."""
    i = x.view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def _oracle(a: np.ndarray, b: np.ndarray) -> dict:
    differ = a.view(np.uint32) != b.view(np.uint32)
    fin = np.isfinite(a) & np.isfinite(b)
    fa, fb = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):
        d = np.where(fin, fa - fb, 0.0)
    na = np.sqrt(np.sum(np.where(fin, fa, 0.0) ** 2))
    both = differ & fin
    return {
        "n_diff": int(differ.sum()),
        "n_diff_rows": int(differ.reshape(a.shape[0], -1).any(axis=1).sum()),
        "max_abs": float(np.abs(d[both]).max()) if both.any() else 0.0,
        "rel_fro": float(np.sqrt(np.sum(d**2)) / na),
        "max_ulp": int(np.abs(_ordered(a) - _ordered(b))[both].max()) if both.any() else 0,
    }


def test_against_numpy_with_nan_and_inf():
    rng = np.random.default_rng(7)
    a = rng.standard_normal((16, 33)).astype(np.float32)
    b = a.copy()
    b[1, 2] = np.nextafter(b[1, 2], np.float32(np.inf))
    b[3] += np.float32(1e-3) * rng.standard_normal(33).astype(np.float32)
    b[5, 0] = np.nan  # NaN against a number: counted, never in max_abs / rel_fro / max_ulp
    a[6, 1] = b[6, 1] = np.inf  # equal infinities: not a difference
    b[7, 4] = -np.inf  # an infinity against a number
    a[8, 8], b[8, 8] = np.float32(0.0), np.float32(-0.0)  # +0 / -0: differs, 0 apart
    got = element_stats(a, b)
    want = _oracle(a, b)
    assert got["n_diff"] == want["n_diff"] == 1 + 33 + 1 + 1 + 1
    assert got["n_diff_rows"] == want["n_diff_rows"] == 5
    assert got["max_abs"] == pytest.approx(want["max_abs"], rel=1e-12)
    assert got["rel_fro"] == pytest.approx(want["rel_fro"], rel=1e-9)
    assert got["max_ulp"] == want["max_ulp"]
    assert np.isfinite(got["max_abs"]) and np.isfinite(got["rel_fro"])


def test_same_as_the_comparison_row():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 5)).astype(np.float32)
    b = a + np.float32(1e-4)
    b[0, 0] = np.nan
    row = dmlib.compare(
        dmlib.ArrayTensorSet({"t": a}), dmlib.ArrayTensorSet({"t": b}), progress=False
    ).iloc[0]
    got = element_stats(a, b)
    assert got["n_diff"] == row["n_diff"] and got["max_ulp"] == row["max_ulp"]
    assert got["max_abs"] == row["max_abs"] and got["rel_fro"] == row["rel_fro"]


def test_same_bits_nan_is_equal_and_identical_arrays():
    a = np.array([[1.0, np.nan], [2.0, 3.0]], np.float32)
    got = element_stats(a, a.copy())
    assert got == {"n_diff": 0, "n_diff_rows": 0, "max_abs": 0.0, "rel_fro": 0.0, "max_ulp": 0}


def test_integers_bools_and_mismatch():
    a = np.array([[1, 2], [3, 4]], np.int32)
    b = np.array([[1, 2], [3, -4]], np.int32)
    got = element_stats(a, b)
    assert got == {"n_diff": 1, "n_diff_rows": 1, "max_abs": 8.0, "rel_fro": None, "max_ulp": None}
    m = np.array([True, False, True])
    assert element_stats(m, ~m)["n_diff"] == 3 and element_stats(m, ~m)["n_diff_rows"] == 3
    none = element_stats(a, a.astype(np.int64))
    assert set(none.values()) == {None}
    empty = np.zeros((0, 3), np.float32)
    assert element_stats(empty, empty)["n_diff"] == 0
