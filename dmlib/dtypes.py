"""Dtype names of each format, mapped to numpy dtypes (bfloat16, float8/6/4 via ml_dtypes).

Byte order is a property of the stored bytes, not of the numbers: a ``>f4`` array holds
float32 values. Every function here accepts either byte order and answers for the values
(``is_float(">f4")`` is True); :func:`native` gives the same dtype in this machine's order.
"""

from __future__ import annotations

import ml_dtypes  # registers bfloat16/float8 with numpy before any lookup
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT8_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
FLOAT8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)


def _ml(name: str) -> np.dtype | None:
    """An ml_dtypes dtype by name, None where the installed release lacks it."""
    t = getattr(ml_dtypes, name, None)
    return None if t is None else np.dtype(t)


FLOAT8_E4M3FNUZ = _ml("float8_e4m3fnuz")
FLOAT8_E5M2FNUZ = _ml("float8_e5m2fnuz")
FLOAT8_E8M0FNU = _ml("float8_e8m0fnu")
FLOAT4_E2M1FN = _ml("float4_e2m1fn")

#: every ml_dtypes float format dmlib knows (those the installed release has)
ML_FLOAT_NAMES = (
    "float8_e3m4",
    "float8_e4m3",
    "float8_e4m3b11fnuz",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e5m3fnu",
    "float8_e8m0fnu",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "float4_e2m1fn",
)

#: Floating dtypes dmlib computes ULP distances for, with the unsigned type of their bits.
FLOAT_BITS: dict[np.dtype, np.dtype] = {
    np.dtype("<f8"): np.dtype("<u8"),
    np.dtype("<f4"): np.dtype("<u4"),
    np.dtype("<f2"): np.dtype("<u2"),
    BFLOAT16: np.dtype("<u2"),
    FLOAT8_E4M3FN: np.dtype("u1"),
    FLOAT8_E5M2: np.dtype("u1"),
}
for _name in ML_FLOAT_NAMES:
    _dt = _ml(_name)
    if _dt is not None:
        FLOAT_BITS[_dt] = np.dtype("u1")  # float6/float4 too: one value per byte in ml_dtypes

# safetensors dtype string -> numpy dtype
SAFETENSORS_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": BFLOAT16,
    "F8_E4M3": FLOAT8_E4M3FN,
    "F8_E5M2": FLOAT8_E5M2,
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
    "C64": np.dtype("<c8"),
}
for _st, _dt in (
    ("F8_E4M3FNUZ", FLOAT8_E4M3FNUZ),
    ("F8_E5M2FNUZ", FLOAT8_E5M2FNUZ),
    ("F8_E8M0", FLOAT8_E8M0FNU),
):
    if _dt is not None:
        SAFETENSORS_DTYPES[_st] = _dt


#: safetensors' sub-byte dtypes: bits per element. ``F4`` is read (two values a byte, the
#: first in the low nibble, as PyTorch's float4_e2m1fn_x2 writes it); safetensors defines
#: no bit order for the 6-bit ones, so they stay opaque bytes with their size checked.
SAFETENSORS_SUBBYTE: dict[str, int] = {"F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}


def native(dtype: np.dtype) -> np.dtype:
    """``dtype`` in this machine's byte order (unchanged when it already is, or has none)."""
    dt = np.dtype(dtype)
    return dt if dt.isnative else dt.newbyteorder("=")


def safetensors_name(dtype: np.dtype) -> str:
    """The safetensors dtype string of a numpy dtype (raises ``KeyError`` when there is none)."""
    dtype = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    for name, dt in SAFETENSORS_DTYPES.items():
        if dt == dtype:
            return name
    raise KeyError(str(dtype))


def is_float(dtype: np.dtype) -> bool:
    """True for every floating dtype dmlib knows bits for (f64/f32/f16/bf16/f8/f6/f4), either byte order."""
    return native(dtype) in FLOAT_BITS


def bits_dtype(dtype: np.dtype) -> np.dtype:
    """The unsigned integer dtype with the same width and byte order, for viewing bit patterns."""
    dtype = np.dtype(dtype)
    nat = native(dtype)
    bits = FLOAT_BITS[nat] if nat in FLOAT_BITS else np.dtype(f"u{dtype.itemsize}") if dtype.itemsize > 1 else np.dtype("u1")
    # viewing big-endian bytes through a big-endian integer gives the right bit pattern
    return bits.newbyteorder(">") if dtype.byteorder == ">" and bits.itemsize > 1 else bits


def dtype_label(dtype: np.dtype) -> str:
    """Short readable name: float32, bfloat16, float8_e4m3fn, int64, bool..."""
    return np.dtype(dtype).name
