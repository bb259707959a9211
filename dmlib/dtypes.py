"""Dtype names of each format, mapped to numpy dtypes (bfloat16 and float8 via ml_dtypes)."""

from __future__ import annotations

import ml_dtypes  # noqa: F401  (registers bfloat16/float8 with numpy before any lookup)
import numpy as np

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
FLOAT8_E4M3FN = np.dtype(ml_dtypes.float8_e4m3fn)
FLOAT8_E5M2 = np.dtype(ml_dtypes.float8_e5m2)

#: Floating dtypes dmlib computes ULP distances for, with the unsigned type of their bits.
FLOAT_BITS: dict[np.dtype, np.dtype] = {
    np.dtype("<f8"): np.dtype("<u8"),
    np.dtype("<f4"): np.dtype("<u4"),
    np.dtype("<f2"): np.dtype("<u2"),
    BFLOAT16: np.dtype("<u2"),
    FLOAT8_E4M3FN: np.dtype("u1"),
    FLOAT8_E5M2: np.dtype("u1"),
}

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
}


def safetensors_name(dtype: np.dtype) -> str:
    """The safetensors dtype string of a numpy dtype (raises ``KeyError`` when there is none)."""
    dtype = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    for name, dt in SAFETENSORS_DTYPES.items():
        if dt == dtype:
            return name
    raise KeyError(str(dtype))


def is_float(dtype: np.dtype) -> bool:
    """True for every floating dtype dmlib knows bits for (f64/f32/f16/bf16/f8)."""
    return np.dtype(dtype) in FLOAT_BITS


def bits_dtype(dtype: np.dtype) -> np.dtype:
    """The unsigned integer dtype with the same width, for viewing bit patterns."""
    dtype = np.dtype(dtype)
    if dtype in FLOAT_BITS:
        return FLOAT_BITS[dtype]
    return np.dtype(f"<u{dtype.itemsize}") if dtype.itemsize > 1 else np.dtype("u1")


def dtype_label(dtype: np.dtype) -> str:
    """Short readable name: float32, bfloat16, float8_e4m3fn, int64, bool..."""
    return np.dtype(dtype).name
