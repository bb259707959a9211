"""ULP distance: how many representable values lie between two floats.

Computed on the integer bit patterns, never on float arithmetic, for every float dtype
dmlib reads: float64, float32, float16, bfloat16 and every ml_dtypes float (float8
e4m3fn/e5m2/e4m3/e3m4, the fnuz variants, the unsigned e8m0fnu/e5m3fnu, float6_e2m3fn,
float6_e3m2fn, float4_e2m1fn), in either byte order.

The sign-magnitude bit pattern is mapped onto a monotonic integer line: a value with
sign bit clear maps to its magnitude bits ``m``, one with sign bit set to ``-m``. Both
zeros map to 0, so ``-0`` and ``+0`` are 0 ULP apart, the smallest positive and the
smallest negative subnormal are 2 ULP apart, and infinity (where the format has one)
sits one step above the largest finite value. Formats without a sign bit (e8m0) are
already monotonic in their bits; fnuz formats have no -0 (that pattern is their NaN),
so their smallest values of either sign are 2 apart as well. The distance is the absolute difference
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

from dmlib import dtypes as _dt
from dmlib.dtypes import native
from dmlib.errors import DmlibError, UnsupportedError

#: Distance returned for a pair involving a NaN whose bit patterns differ.
ULP_NAN = np.iinfo(np.uint64).max


@dataclass(frozen=True)
class FloatBits:
    """Bit-level facts of one float dtype, enough to classify values without float math.

    Formats narrower than their storage (ml_dtypes keeps float6/float4 one per byte) have
    ``width`` below the storage bits; a stored pattern with a bit set above ``width`` is
    no value of the format and is treated as a NaN.
    """

    dtype: np.dtype
    bits: np.dtype  # unsigned integer dtype of the same width
    sign: int  # the sign bit; 0 for unsigned formats (e8m0, e5m3fnu)
    mag_mask: int  # every bit of the format but the sign
    inf_mag: int | None  # magnitude bits of +-inf; None when the format has no infinity
    nan_min: int  # magnitudes >= this are NaN
    nan_bits: int | None = None  # one whole pattern that is NaN (fnuz: the would-be -0)
    width: int = 0  # bits of the format; 0 = the whole storage word

    @property
    def finite_lim(self) -> int:
        """Magnitudes strictly below this are finite (but see ``nan_bits``)."""
        return self.inf_mag if self.inf_mag is not None else self.nan_min

    @property
    def irregular(self) -> bool:
        """True when a NaN can hide below ``finite_lim`` (fnuz, or bits above ``width``)."""
        return self.nan_bits is not None or bool(self.width)

    def nan(self, u: np.ndarray) -> np.ndarray:
        """Mask of NaN bit patterns (and patterns that are no value of a narrow format)."""
        out = (u & self.bits.type(self.mag_mask)) >= self.bits.type(self.nan_min)
        if self.nan_bits is not None:
            out |= u == self.bits.type(self.nan_bits)
        if self.width:
            out |= u >= self.bits.type(1 << self.width)
        return out

    def finite(self, u: np.ndarray) -> np.ndarray:
        """Mask of finite values (neither NaN nor infinite)."""
        out = (u & self.bits.type(self.mag_mask)) < self.bits.type(self.finite_lim)
        if self.irregular:
            out &= ~self.nan(u)
        return out


def _ieee(dtype: np.dtype, exp_bits: int, man_bits: int) -> FloatBits:
    nbits = 1 + exp_bits + man_bits
    inf_mag = ((1 << exp_bits) - 1) << man_bits
    return FloatBits(
        dtype, _dt.bits_dtype(dtype), 1 << (nbits - 1), (1 << (nbits - 1)) - 1, inf_mag, inf_mag + 1
    )


def _u8(name: str, **facts: int | None) -> tuple[np.dtype, FloatBits] | None:
    t = _dt._ml(name)
    if t is None:  # an older ml_dtypes release
        return None
    return t, FloatBits(t, np.dtype("u1"), **facts)  # type: ignore[arg-type]


_INFO: dict[np.dtype, FloatBits] = {
    np.dtype("<f8"): _ieee(np.dtype("<f8"), 11, 52),
    np.dtype("<f4"): _ieee(np.dtype("<f4"), 8, 23),
    np.dtype("<f2"): _ieee(np.dtype("<f2"), 5, 10),
}


def _ml_info() -> None:
    """Add the ml_dtypes formats to _INFO (the first time such a dtype is seen)."""
    bf16, e5m2, e4m3fn = _dt.BFLOAT16, _dt.FLOAT8_E5M2, _dt.FLOAT8_E4M3FN
    _INFO[bf16] = _ieee(bf16, 8, 7)
    _INFO[e5m2] = _ieee(e5m2, 5, 2)
    # e4m3fn ("finite"): no infinities; S.1111.111 is the only NaN, 448 = 0x7E the largest value
    _INFO[e4m3fn] = FloatBits(e4m3fn, np.dtype("u1"), 0x80, 0x7F, None, 0x7F)
    # The formats of the OCP microscaling spec, AMD/Graphcore's fnuz and ml_dtypes' own;
    # facts from each format's definition (ml_dtypes' README): IEEE-like ones have inf =
    # all-ones exponent, "fn" ones no inf, "fnuz" ones no inf, no -0, and 0x80 as their
    # one NaN, "fnu" ones no sign bit and 0xFF as their one NaN; float6/float4 have no inf
    # and no NaN.
    for entry in (
        _u8("float8_e3m4", sign=0x80, mag_mask=0x7F, inf_mag=0x70, nan_min=0x71),
        _u8("float8_e4m3", sign=0x80, mag_mask=0x7F, inf_mag=0x78, nan_min=0x79),
        _u8("float8_e4m3fnuz", sign=0x80, mag_mask=0x7F, inf_mag=None, nan_min=0x80, nan_bits=0x80),
        _u8(
            "float8_e4m3b11fnuz",
            sign=0x80,
            mag_mask=0x7F,
            inf_mag=None,
            nan_min=0x80,
            nan_bits=0x80,
        ),
        _u8("float8_e5m2fnuz", sign=0x80, mag_mask=0x7F, inf_mag=None, nan_min=0x80, nan_bits=0x80),
        _u8("float8_e5m3fnu", sign=0, mag_mask=0xFF, inf_mag=None, nan_min=0xFF),
        _u8("float8_e8m0fnu", sign=0, mag_mask=0xFF, inf_mag=None, nan_min=0xFF),
        _u8("float6_e2m3fn", sign=0x20, mag_mask=0x1F, inf_mag=None, nan_min=0x20, width=6),
        _u8("float6_e3m2fn", sign=0x20, mag_mask=0x1F, inf_mag=None, nan_min=0x20, width=6),
        _u8("float4_e2m1fn", sign=0x8, mag_mask=0x7, inf_mag=None, nan_min=0x8, width=4),
    ):
        if entry is not None:
            _INFO[entry[0]] = entry[1]


def float_bits(dtype: np.dtype) -> FloatBits:
    """Bit facts of a float dtype (either byte order); :class:`UnsupportedError` for anything else."""
    dt = native(dtype)
    if dt not in _INFO and _dt.is_float(dt):
        _ml_info()
    try:
        return _INFO[dt]
    except KeyError:
        names = "float64, float32, float16, bfloat16 and the ml_dtypes floats"
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
    if info.sign:  # unsigned formats (e8m0) never cross zero
        cross = ((ua ^ ub) & info.bits.type(info.sign)) != 0
        if cross.any():
            ulp[cross] = ma[cross] + mb[cross]
    return ulp


def is_nan_bits(bits: np.ndarray, info: FloatBits) -> np.ndarray:
    """Mask of NaN bit patterns (:meth:`FloatBits.nan`: with the non-values of narrow formats)."""
    return info.nan(bits)


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Element-wise distance in units in the last place between two float arrays.

    Parameters
    ----------
    a, b
        Arrays of the same float dtype (float64/32/16, bfloat16, or any ml_dtypes
        float8/float6/float4 format), in either byte order, with broadcast-compatible
        shapes.

    Returns
    -------
    numpy.ndarray
        ``uint64`` distances. ``-0`` vs ``+0`` is 0; a crossing of zero counts every
        value passed; equal bit patterns (NaN included) are 0; a NaN against anything
        with different bits is :data:`ULP_NAN`.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    # the bits are read as this machine's integers: bring big-endian data to that order
    a = a.astype(native(a.dtype), copy=False)
    b = b.astype(native(b.dtype), copy=False)
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
