"""ulp_distance: hand-computed cases, numpy's nulp_diff, and exhaustive rank oracles."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numpy.testing._private.utils import nulp_diff

from dmlib import DmlibError, UnsupportedError
from dmlib.kernels.ulp import ULP_NAN, ulp_distance

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
BITS = {
    np.dtype("f8"): np.uint64,
    np.dtype("f4"): np.uint32,
    np.dtype("f2"): np.uint16,
    BF16: np.uint16,
    E4M3: np.uint8,
    E5M2: np.uint8,
}


def from_bits(bits: list[int], dtype: np.dtype) -> np.ndarray:
    return np.array(bits, dtype=BITS[np.dtype(dtype)]).view(dtype)


# (dtype, bits of a, bits of b, expected distance) -- worked out by hand from the formats
HAND = [
    ("f4", 0x3F800000, 0x3F800001, 1),  # 1.0 and the next float32
    ("f4", 0x3F800000, 0x40000000, 1 << 23),  # 1.0 to 2.0: one binade of 2**23 steps
    ("f4", 0x00000000, 0x80000000, 0),  # +0 vs -0
    ("f4", 0x00000001, 0x80000001, 2),  # +-smallest subnormal: crossing zero counts 2
    ("f4", 0x80000003, 0x00000002, 5),  # -3 steps to +2 steps
    ("f4", 0x7F7FFFFF, 0x7F800000, 1),  # largest finite to +inf
    ("f4", 0xFF800000, 0x7F800000, 2 * 0x7F800000),  # -inf to +inf
    ("f4", 0x7FC00000, 0x7FC00000, 0),  # the same NaN
    ("f4", 0x7FC00000, 0x7FC00001, ULP_NAN),  # NaN payloads differ
    ("f4", 0x7FC00000, 0x3F800000, ULP_NAN),  # NaN vs a number
    ("f8", 0x3FF0000000000000, 0x3FF0000000000001, 1),
    ("f8", 0xFFF0000000000000, 0x7FF0000000000000, (1 << 64) - (1 << 53)),  # beyond int64
    ("f8", 0x8000000000000000, 0x0000000000000000, 0),
    ("f2", 0x3C00, 0x3C01, 1),
    ("f2", 0x7BFF, 0xFBFF, 2 * 0x7BFF),  # 65504 to -65504
    (BF16, 0x3F80, 0x4000, 128),  # 1.0 to 2.0: 7 mantissa bits
    (BF16, 0x8000, 0x0001, 1),
    (E4M3, 0x7E, 0xFE, 2 * 0x7E),  # 448 to -448
    (E4M3, 0x7E, 0x7F, ULP_NAN),  # 0x7F is NaN in e4m3fn (no infinities)
    (E4M3, 0xFF, 0xFF, 0),
    (E5M2, 0x7B, 0x7C, 1),  # 57344 to +inf
    (E5M2, 0x7D, 0x7E, ULP_NAN),
]


@pytest.mark.parametrize(("dtype", "xa", "xb", "expected"), HAND)
def test_hand_cases(dtype, xa, xb, expected):
    a, b = from_bits([xa], dtype), from_bits([xb], dtype)
    got = ulp_distance(a, b)
    assert got.dtype == np.uint64
    assert int(got[0]) == expected
    assert int(ulp_distance(b, a)[0]) == expected  # symmetric


def test_scalars_and_shapes():
    one = np.float32(1.0)
    assert int(ulp_distance(one, np.nextafter(one, np.float32(2)))) == 1
    a = np.zeros((2, 3), np.float32)
    assert ulp_distance(a, np.float32(-0.0)).shape == (2, 3)


def test_rejects_bad_dtypes():
    with pytest.raises(UnsupportedError, match="int32"):
        ulp_distance(np.arange(3, dtype=np.int32), np.arange(3, dtype=np.int32))
    with pytest.raises(DmlibError, match="float32 and float64"):
        ulp_distance(np.zeros(2, np.float32), np.zeros(2, np.float64))


def signed_magnitude(bits: np.ndarray, nbits: int) -> np.ndarray:
    """Independent oracle: Python-int reading of the sign-magnitude bit pattern."""
    out = []
    for v in bits.tolist():
        mag = v & ((1 << (nbits - 1)) - 1)
        out.append(-mag if v >> (nbits - 1) else mag)
    return np.array(out, dtype=object)


@pytest.mark.parametrize(
    ("dtype", "ubits", "nbits", "exact"),
    [("f2", np.uint16, 16, 11), ("f4", np.uint32, 32, 24), ("f8", np.uint64, 64, 53)],
)
def test_agrees_with_numpy_nulp_diff(dtype, ubits, nbits, exact):
    rng = np.random.default_rng(nbits)
    n = 3000
    xa = rng.integers(0, np.iinfo(ubits).max, n, dtype=ubits, endpoint=True)
    # half the pairs near each other (incl. across zero), half anywhere
    step = rng.integers(-40, 40, n).astype(np.int64)
    near = signed_magnitude(xa, nbits) + step.astype(object)
    far = rng.integers(0, np.iinfo(ubits).max, n, dtype=ubits, endpoint=True)
    sign = 1 << (nbits - 1)
    xb = (
        np.array([(-k | sign) if k < 0 else k for k in near.tolist()], dtype=object)
        .astype(np.uint64)
        .astype(ubits)
    )
    xb[::2] = far[::2]
    a, b = xa.view(dtype), xb.view(dtype)
    keep = ~(np.isnan(a) | np.isnan(b))
    a, b = a[keep], b[keep]
    got = ulp_distance(a, b)
    want = np.abs(signed_magnitude(a.view(ubits), nbits) - signed_magnitude(b.view(ubits), nbits))
    assert [int(g) for g in got] == list(want)
    # numpy subtracts in the signed type and returns the float type: compare where that is exact
    ok = np.array([w < (1 << exact) for w in want])
    assert ok.sum() > n // 3
    np.testing.assert_array_equal(
        got[ok].astype(np.float64), nulp_diff(a[ok], b[ok]).reshape(-1).astype(np.float64)
    )


def rank_oracle(dtype: np.dtype, nbits: int):
    """Distance by rank among all distinct non-NaN values of the format (via ml_dtypes)."""
    allbits = np.arange(1 << nbits, dtype=np.uint64).astype(BITS[np.dtype(dtype)])
    with np.errstate(invalid="ignore"):  # NaN patterns: ml_dtypes flags the cast
        vals = allbits.view(dtype).astype(np.float64)
    table = np.unique(vals[~np.isnan(vals)])  # -0 and +0 merge: they are one value

    def dist(ba, bb):
        with np.errstate(invalid="ignore"):
            va = ba.view(dtype).astype(np.float64)
            vb = bb.view(dtype).astype(np.float64)
        ra = np.searchsorted(table, va)
        rb = np.searchsorted(table, vb)
        return np.abs(ra - rb), np.isnan(va) | np.isnan(vb)

    return dist


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_exhaustive(dtype):
    bits = np.arange(256, dtype=np.uint8)
    ba, bb = np.meshgrid(bits, bits, indexing="ij")
    ba, bb = ba.ravel(), bb.ravel()
    want, nan = rank_oracle(dtype, 8)(ba, bb)
    want = want.astype(np.uint64)
    want[nan] = ULP_NAN
    want[nan & (ba == bb)] = 0
    got = ulp_distance(ba.view(dtype), bb.view(dtype))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [BF16, np.dtype("f2")])
def test_16bit_all_pairs_of_a_sample(dtype):
    rng = np.random.default_rng(16)
    sample = rng.choice(1 << 16, 1500, replace=False).astype(np.uint16)
    sample[:4] = [0x0000, 0x8000, 0x0001, 0x8001]
    ba, bb = np.meshgrid(sample, sample, indexing="ij")
    ba, bb = ba.ravel(), bb.ravel()
    want, nan = rank_oracle(dtype, 16)(ba, bb)
    got = ulp_distance(ba.view(dtype), bb.view(dtype))
    np.testing.assert_array_equal(got[~nan], want[~nan].astype(np.uint64))
    assert np.all(got[nan & (ba != bb)] == ULP_NAN)
