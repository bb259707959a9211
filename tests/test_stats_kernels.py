"""The optional compiled kernel (dmlib/kernels/_fused.c) against the numpy kernels and numpy.

Oracles: numpy on the bits for what differs and where, the ULP distance as a rank
difference computed in Python integers, float64 sums from numpy for a.a, a.d, d.d; the
numpy kernels (a separate implementation) for every statistic. Inputs carry what a
chunk can hold: NaNs with several payloads, infinities of both signs, +0/-0, denormals,
pairs across zero, distances past the exact histogram, lengths that end mid-lane and
mid-block.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import dmlib.kernels.stream as K
from dmlib.kernels.ulp import float_bits
from dmlib.stats.compare import compare
from dmlib.tensor import ArrayTensorSet

pytestmark = pytest.mark.skipif(
    K._fused is None or not K.USE_COMPILED,
    reason="dmlib.kernels._fused is not built (no C compiler when dmlib was installed) or "
    "DMLIB_KERNELS=numpy: the numpy kernels run everywhere",
)

WIDTH = {np.float32: (np.uint32, 32), np.float64: (np.uint64, 64)}


def _rank(bits: np.ndarray, nbits: int) -> list[int]:
    out = []
    for v in bits.tolist():
        mag = v & ((1 << (nbits - 1)) - 1)
        out.append(-mag if v >> (nbits - 1) else mag)
    return out


def _pair(dtype: type, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Bit views of two chunks: ~20% of pairs moved by 1..3 ULP, and special values."""
    ubits, _ = WIDTH[dtype]
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)
    ua = a.view(ubits).copy()
    ub = ua.copy()
    moved = rng.random(n) < 0.2
    ub[moved] += rng.integers(1, 4, int(moved.sum())).astype(ubits)
    f = np.finfo(dtype)
    special = [
        (np.inf, np.inf), (np.inf, -np.inf), (np.nan, 1.0), (1.0, np.nan), (0.0, -0.0),
        (-0.0, 0.0), (f.tiny / 4, -f.tiny / 4), (f.max, -f.max), (1.0, 1e6), (-2.0, 3.0),
        (np.inf, 5.0),
    ]  # fmt: skip
    spots = rng.choice(n, size=min(n, len(special) + 3), replace=False)
    for (x, y), i in zip(special, spots, strict=False):
        ua[i] = np.array([x], dtype).view(ubits)[0]
        ub[i] = np.array([y], dtype).view(ubits)[0]
    if n > len(special) + 2:  # two NaNs with different payloads, and equal NaNs
        nan = np.array([np.nan], dtype).view(ubits)[0]
        ua[spots[-3]], ub[spots[-3]] = nan, nan | ubits(1)
        ua[spots[-2]], ub[spots[-2]] = nan, nan
    return ua, ub


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 4095, 4096, 4097, 20_011])
def test_compiled_kernel_against_numpy(dtype, n):
    # (float64 max - -max overflows to inf, as the comparison loop allows)
    with np.errstate(over="ignore", invalid="ignore"):
        _against_numpy(dtype, n)


def _against_numpy(dtype: type, n: int) -> None:
    ubits, nbits = WIDTH[dtype]
    info = float_bits(np.dtype(dtype))
    for seed in range(3):
        ua, ub = _pair(dtype, n, seed)
        fast, slow = K.Acc(), K.Acc()
        fast_aa, slow_aa = K.Acc(), K.Acc()
        K.float_pair(fast_aa, fast, ua, ub, 1000, info)
        K.USE_COMPILED = False
        try:
            K.add_aa(slow_aa, ua, ub, info)
            K.float_chunk(slow, ua, ub, 1000, info)
        finally:
            K.USE_COMPILED = True
        # what differs and where: numpy on the bits
        differ = np.flatnonzero(ua != ub)
        assert fast.n_diff == slow.n_diff == differ.size
        assert fast.first == slow.first == (1000 + int(differ[0]) if differ.size else None)
        for key in ("n_nan_payload", "n_nan_vs_num", "n_inf_mismatch", "max_ulp"):
            assert getattr(fast, key) == getattr(slow, key), key
        # ULP counts: rank differences in Python integers over finite differing pairs
        a, b = ua.view(dtype), ub.view(dtype)
        fin = np.isfinite(a) & np.isfinite(b) & (ua != ub)
        ra, rb = _rank(ua[fin], nbits), _rank(ub[fin], nbits)
        dist = np.minimum([abs(p - q) for p, q in zip(ra, rb, strict=True)], K.ULP_EXACT + 1)
        want = np.bincount(np.asarray(dist, np.int64), minlength=1)
        got = np.trim_zeros(fast.counts, "b")
        np.testing.assert_array_equal(got, np.trim_zeros(want, "b"))
        np.testing.assert_array_equal(got, np.trim_zeros(slow.counts, "b"))
        # sums in float64: another order than numpy's, equal to the last few bits
        both = np.isfinite(a) & np.isfinite(b)
        x = a[both].astype(np.float64)
        assert math.isclose(fast_aa.aa, float(np.sum(x * x)), rel_tol=1e-12)
        assert math.isclose(fast_aa.aa, slow_aa.aa, rel_tol=1e-12)
        xa, d = a[fin].astype(np.float64), b[fin].astype(np.float64) - a[fin].astype(np.float64)
        assert math.isclose(fast.sdd, float(np.sum(d * d)), rel_tol=1e-12, abs_tol=0.0)
        assert math.isclose(fast.sad, float(np.sum(xa * d)), rel_tol=1e-9, abs_tol=1e-300)
        assert math.isclose(fast.sad, slow.sad, rel_tol=1e-9, abs_tol=1e-300)
        assert fast.max_abs == slow.max_abs == (float(np.max(np.abs(d))) if d.size else 0.0)


def test_rows_with_and_without_the_compiled_kernel():
    rng = np.random.default_rng(4)
    a = {
        f"w{i}": rng.standard_normal(30_000).astype([np.float32, np.float64][i % 2])
        for i in range(6)
    }
    b = {k: v.copy() for k, v in a.items()}
    for v in list(b.values())[::2]:
        v[rng.choice(v.size, 3000, replace=False)] *= 1 + 1e-6
    fast = compare(ArrayTensorSet(a), ArrayTensorSet(b), chunk_bytes=65_536)
    K.USE_COMPILED = False
    try:
        slow = compare(ArrayTensorSet(a), ArrayTensorSet(b), chunk_bytes=65_536)
    finally:
        K.USE_COMPILED = True
    floats = ["max_abs", "rel_fro", "cosine"]
    rest = [c for c in fast.columns if c not in floats]
    pd.testing.assert_frame_equal(fast[rest], slow[rest])
    np.testing.assert_allclose(fast[floats].astype(float), slow[floats].astype(float), rtol=1e-10)
    assert K.kernel_name() == "compiled"
