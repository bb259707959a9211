"""ULP distance: how many representable values lie between two floats.

Computed on the integer bit patterns, never on float arithmetic, for every float dtype
dmlib reads (float64, float32, float16, bfloat16, float8_e4m3fn, float8_e5m2).

The sign-magnitude bit pattern is mapped onto a monotonic integer line: a value with
sign bit clear maps to its magnitude bits ``m``, one with sign bit set to ``-m``. Both
zeros map to 0, so ``-0`` and ``+0`` are 0 ULP apart, the smallest positive and the
smallest negative subnormal are 2 ULP apart, and infinity (where the format has one)
sits one step above the largest finite value. The distance is the absolute difference
of the two integers (``|ma - mb|`` for equal signs, ``ma + mb`` across zero), exact in
the format's own unsigned width and returned as ``uint64``.

NaN policy: a pair whose bit patterns are equal is 0 apart (NaN included); a pair in
which either side is a NaN with a different bit pattern has no meaningful distance and
gets the sentinel :data:`ULP_NAN` (the largest ``uint64``), which no real distance
reaches (the widest, float64 ``-inf`` to ``+inf``, is ``2**64 - 2**53``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dmlib.dtypes import BFLOAT16, FLOAT8_E4M3FN, FLOAT8_E5M2, FLOAT_BITS
from dmlib.errors import DmlibError, UnsupportedError

#: Distance returned for a pair involving a NaN whose bit patterns differ.
ULP_NAN = np.iinfo(np.uint64).max


@dataclass(frozen=True)
class FloatBits:
    """Bit-level facts of one float dtype, enough to classify values without float math."""

    dtype: np.dtype
    bits: np.dtype  # unsigned integer dtype of the same width
    sign: int  # the sign bit
    mag_mask: int  # every bit but the sign
    inf_mag: int | None  # magnitude bits of +-inf; None when the format has no infinity
    nan_min: int  # magnitudes >= this are NaN

    @property
    def finite_lim(self) -> int:
        """Magnitudes strictly below this are finite."""
        return self.inf_mag if self.inf_mag is not None else self.nan_min


def _ieee(dtype: np.dtype, exp_bits: int, man_bits: int) -> FloatBits:
    nbits = 1 + exp_bits + man_bits
    inf_mag = ((1 << exp_bits) - 1) << man_bits
    return FloatBits(
        dtype, FLOAT_BITS[dtype], 1 << (nbits - 1), (1 << (nbits - 1)) - 1, inf_mag, inf_mag + 1
    )


_INFO: dict[np.dtype, FloatBits] = {
    np.dtype("<f8"): _ieee(np.dtype("<f8"), 11, 52),
    np.dtype("<f4"): _ieee(np.dtype("<f4"), 8, 23),
    np.dtype("<f2"): _ieee(np.dtype("<f2"), 5, 10),
    BFLOAT16: _ieee(BFLOAT16, 8, 7),
    FLOAT8_E5M2: _ieee(FLOAT8_E5M2, 5, 2),
    # e4m3fn ("finite"): no infinities; S.1111.111 is the only NaN, 448 = 0x7E the largest value
    FLOAT8_E4M3FN: FloatBits(FLOAT8_E4M3FN, np.dtype("u1"), 0x80, 0x7F, None, 0x7F),
}


def float_bits(dtype: np.dtype) -> FloatBits:
    """Bit facts of a float dtype; :class:`UnsupportedError` for anything else."""
    dt = np.dtype(dtype)
    if dt.byteorder == ">":
        dt = dt.newbyteorder("<")
    try:
        return _INFO[dt]
    except KeyError:
        names = ", ".join(d.name for d in _INFO)
        raise UnsupportedError(
            f"ULP distance is defined for float dtypes ({names}), not {dt.name}"
        ) from None


def int_distance(ka: np.ndarray, kb: np.ndarray) -> np.ndarray:
    """``|ka - kb|`` as uint64, exact even where the int64 difference would overflow."""
    # Two's-complement wrap-around keeps the low 64 bits of the true difference, and the
    # true |difference| is < 2**64, so reading the wrapped value as unsigned is exact.
    d = ka - kb
    return np.where(ka >= kb, d, -d).view(np.uint64)


def ulp_bits(ua: np.ndarray, ub: np.ndarray, info: FloatBits) -> np.ndarray:
    """ULP distance of non-NaN bit patterns, in their own unsigned dtype (it always fits).

    Same sign: ``|ma - mb|`` of the magnitude bits; opposite signs: ``ma + mb`` (the
    values on both sides of zero, which is counted once). Magnitudes are below half the
    type's range, so neither can wrap around.
    """
    mm = info.bits.type(info.mag_mask)
    ma, mb = ua & mm, ub & mm
    ulp = np.maximum(ma, mb)
    ulp -= np.minimum(ma, mb)
    cross = (ua ^ ub) >= info.bits.type(info.sign)
    if cross.any():
        ulp[cross] = ma[cross] + mb[cross]
    return ulp


def is_nan_bits(bits: np.ndarray, info: FloatBits) -> np.ndarray:
    return (bits & info.bits.type(info.mag_mask)) >= info.nan_min


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise distance in units in the last place between two float arrays.

    Parameters
    ----------
    a, b
        Arrays of the same float dtype (float64/32/16, bfloat16, float8_e4m3fn,
        float8_e5m2) and broadcast-compatible shapes.

    Returns
    -------
    numpy.ndarray
        ``uint64`` distances. ``-0`` vs ``+0`` is 0; a crossing of zero counts every
        value passed; equal bit patterns (NaN included) are 0; a NaN against anything
        with different bits is :data:`ULP_NAN`.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    shape = np.broadcast_shapes(a.shape, b.shape)
    if a.dtype != b.dtype:
        raise DmlibError(
            f"ulp_distance needs one dtype on both sides, got {a.dtype.name} and {b.dtype.name}"
        )
    info = float_bits(a.dtype)
    # at least 1-d: the in-place steps of ulp_bits need arrays, not numpy scalars
    a, b = np.broadcast_arrays(np.atleast_1d(a), np.atleast_1d(b))
    ua = np.ascontiguousarray(a).view(info.bits)
    ub = np.ascontiguousarray(b).view(info.bits)
    dist = ulp_bits(ua, ub, info).astype(np.uint64)
    nan = (is_nan_bits(ua, info) | is_nan_bits(ub, info)) & (ua != ub)
    if nan.any():
        dist = np.where(nan, ULP_NAN, dist)
    return dist.reshape(shape)
