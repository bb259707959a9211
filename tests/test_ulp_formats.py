"""ulp_distance on every ml_dtypes float format, exhaustively, against a rank oracle.

The oracle knows nothing of bit layouts: it reads every bit pattern of the format through
ml_dtypes, sorts the distinct non-NaN values, and measures a distance as the difference
of ranks (so -0 and +0, one value, share a rank). All pairs of all patterns are checked.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dmlib.dtypes import is_float
from dmlib.kernels.ulp import ULP_NAN, float_bits, ulp_distance

FORMATS = [
    ("float8_e4m3fn", 8),
    ("float8_e5m2", 8),
    ("float8_e3m4", 8),
    ("float8_e4m3", 8),
    ("float8_e4m3fnuz", 8),
    ("float8_e4m3b11fnuz", 8),
    ("float8_e5m2fnuz", 8),
    ("float8_e5m3fnu", 8),
    ("float8_e8m0fnu", 8),
    ("float6_e2m3fn", 6),
    ("float6_e3m2fn", 6),
    ("float4_e2m1fn", 4),
]
PRESENT = [(n, w) for n, w in FORMATS if hasattr(ml_dtypes, n)]


def test_the_installed_ml_dtypes_has_every_listed_format():
    # the test environment pins an ml_dtypes recent enough for all of them
    assert [n for n, _ in PRESENT] == [n for n, _ in FORMATS]


def test_every_ml_dtypes_float_is_known():
    names = [n for n in dir(ml_dtypes) if n.startswith(("float", "bfloat"))]
    missing = []
    for n in names:
        dt = np.dtype(getattr(ml_dtypes, n))
        try:
            ml_dtypes.finfo(dt)
        except (ValueError, TypeError, KeyError):
            continue  # not a float format (e.g. an int type)
        if not is_float(dt):
            missing.append(n)
    assert missing == []


def _values(dtype: np.dtype, width: int) -> np.ndarray:
    bits = np.arange(1 << width, dtype=np.uint8)
    with np.errstate(invalid="ignore", over="ignore"):
        return bits.view(dtype).astype(np.float64)


@pytest.mark.parametrize(("name", "width"), PRESENT)
def test_exhaustive_against_rank_oracle(name, width):
    dtype = np.dtype(getattr(ml_dtypes, name))
    vals = _values(dtype, width)
    table = np.unique(vals[~np.isnan(vals)])
    bits = np.arange(1 << width, dtype=np.uint8)
    ba, bb = (x.ravel() for x in np.meshgrid(bits, bits, indexing="ij"))
    va, vb = vals[ba], vals[bb]
    nan = np.isnan(va) | np.isnan(vb)
    want = np.abs(np.searchsorted(table, va) - np.searchsorted(table, vb)).astype(np.uint64)
    want[nan] = ULP_NAN
    want[nan & (ba == bb)] = 0  # the same NaN pattern is 0 apart
    got = ulp_distance(ba.view(dtype), bb.view(dtype))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(("name", "width"), PRESENT)
def test_finite_and_nan_masks_match_ml_dtypes(name, width):
    dtype = np.dtype(getattr(ml_dtypes, name))
    info = float_bits(dtype)
    bits = np.arange(1 << width, dtype=np.uint8)
    vals = _values(dtype, width)
    np.testing.assert_array_equal(info.nan(bits), np.isnan(vals))
    np.testing.assert_array_equal(info.finite(bits), np.isfinite(vals))


@pytest.mark.parametrize(("name", "width"), [(n, w) for n, w in PRESENT if w < 8])
def test_patterns_beyond_a_narrow_format_are_not_values(name, width):
    dtype = np.dtype(getattr(ml_dtypes, name))
    stray = np.array([1 << width], np.uint8).view(dtype)  # a bit above the format's width
    zero = np.zeros(1, np.uint8).view(dtype)
    assert int(ulp_distance(stray, zero)[0]) == ULP_NAN
    assert int(ulp_distance(stray, stray)[0]) == 0


def test_hand_cases_of_new_formats():
    e8m0 = np.dtype(ml_dtypes.float8_e8m0fnu)
    fnuz = np.dtype(ml_dtypes.float8_e4m3fnuz)
    f4 = np.dtype(ml_dtypes.float4_e2m1fn)

    def d(dt, x, y):
        return int(
            ulp_distance(np.array([x], np.uint8).view(dt), np.array([y], np.uint8).view(dt))[0]
        )

    assert d(e8m0, 0x7F, 0x80) == 1  # 1.0 to 2.0: exponents only, one step
    assert d(e8m0, 0x00, 0xFE) == 0xFE  # 2**-127 to 2**127
    assert d(e8m0, 0xFF, 0x7F) == ULP_NAN  # 0xFF is e8m0's NaN
    assert d(fnuz, 0x01, 0x81) == 2  # no -0: the two smallest values are 2 apart
    assert d(fnuz, 0x80, 0x00) == ULP_NAN  # 0x80 is fnuz's NaN, not -0
    assert d(f4, 0x7, 0xF) == 14  # 6.0 to -6.0: 7 steps each side of zero
    assert d(f4, 0x0, 0x8) == 0  # +0 and -0


@pytest.mark.parametrize(("name", "width"), PRESENT)
def test_compare_statistics_on_every_format(name, width):
    """dmlib.compare on each format; expectations from ml_dtypes values and the rank oracle."""
    import dmlib
    from dmlib.tensor import ArrayTensorSet

    dtype = np.dtype(getattr(ml_dtypes, name))
    rng = np.random.default_rng(width)
    ba = rng.integers(0, 1 << width, 5000).astype(np.uint8)
    bb = ba.copy()
    flip = rng.random(ba.size) < 0.3
    bb[flip] = rng.integers(0, 1 << width, int(flip.sum())).astype(np.uint8)
    va, vb = _values(dtype, width)[ba], _values(dtype, width)[bb]
    vals = _values(dtype, width)
    table = np.unique(vals[~np.isnan(vals)])
    differ = ba != bb
    fin = np.isfinite(va) & np.isfinite(vb) & differ
    nan_a, nan_b = np.isnan(va), np.isnan(vb)
    ranks = np.abs(np.searchsorted(table, va) - np.searchsorted(table, vb))
    df = dmlib.compare(ArrayTensorSet({"w": ba.view(dtype)}), ArrayTensorSet({"w": bb.view(dtype)}))
    (row,) = df.to_dict("records")
    assert row["n_diff"] == int(differ.sum())
    assert int(row["max_ulp"]) == int(ranks[fin].max())
    assert row["max_abs"] == float(np.max(np.abs(vb[fin] - va[fin])))
    assert row["n_nan_vs_num"] == int(((nan_a ^ nan_b) & differ).sum())
    assert row["n_nan_payload"] == int((nan_a & nan_b & differ).sum())
    assert row["ulp_nonfinite"] == int((~fin & differ).sum())
    both = np.isfinite(va) & np.isfinite(vb)
    d, ref = vb[both] - va[both], va[both]
    assert row["rel_fro"] == pytest.approx(np.linalg.norm(d) / np.linalg.norm(ref), rel=1e-9)
