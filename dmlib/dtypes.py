"""Dtype names of each format, mapped to numpy dtypes (bfloat16, float8/6/4 via ml_dtypes).

Byte order is a property of the stored bytes, not of the numbers: a ``>f4`` array holds
float32 values. Every function here accepts either byte order and answers for the values
(``is_float(">f4")`` is True); :func:`native` gives the same dtype in this machine's order.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

# ml_dtypes is imported only when a bfloat16/float8/6/4 dtype is asked for: importing it
# costs about half a second, more than the rest of a small ``dmlib compare``. Lookups *by
# dtype* never need it: such a dtype object exists only once ml_dtypes has been imported.

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
# module constants made on first access (module __getattr__), with the ml_dtypes name
_ML_CONSTANTS = {
    "BFLOAT16": "bfloat16",
    "FLOAT8_E4M3FN": "float8_e4m3fn",
    "FLOAT8_E5M2": "float8_e5m2",
    "FLOAT8_E4M3FNUZ": "float8_e4m3fnuz",
    "FLOAT8_E5M2FNUZ": "float8_e5m2fnuz",
    "FLOAT8_E8M0FNU": "float8_e8m0fnu",
    "FLOAT4_E2M1FN": "float4_e2m1fn",
}
_STD_FLOAT_BITS: dict[np.dtype, np.dtype] = {
    np.dtype("<f8"): np.dtype("<u8"),
    np.dtype("<f4"): np.dtype("<u4"),
    np.dtype("<f2"): np.dtype("<u2"),
}


def _ml(name: str) -> np.dtype | None:
    """An ml_dtypes dtype by name (importing ml_dtypes), None where the release lacks it."""
    import ml_dtypes

    t = getattr(ml_dtypes, name, None)
    return None if t is None else np.dtype(t)


def ml_dtype(name: str) -> np.dtype:
    """The numpy dtype of an ml_dtypes type (``"bfloat16"``...); KeyError where there is none."""
    dt = _ml(name)
    if dt is None:
        raise KeyError(name)
    return dt


def _ml_loaded() -> bool:
    return "ml_dtypes" in sys.modules


def _float_bits() -> dict[np.dtype, np.dtype]:
    """Floating dtypes dmlib computes ULP distances for, with the unsigned type of their bits."""
    table = dict(_STD_FLOAT_BITS)
    table[ml_dtype("bfloat16")] = np.dtype("<u2")
    table[ml_dtype("float8_e4m3fn")] = np.dtype("u1")
    table[ml_dtype("float8_e5m2")] = np.dtype("u1")
    for name in ML_FLOAT_NAMES:
        dt = _ml(name)
        if dt is not None:
            table[dt] = np.dtype("u1")  # float6/float4 too: one value per byte in ml_dtypes
    return table


def __getattr__(name: str) -> Any:
    if name in _ML_CONSTANTS:
        value: Any = _ml(_ML_CONSTANTS[name])
    elif name == "FLOAT_BITS":
        value = _float_bits()
    else:
        raise AttributeError(f"module 'dmlib.dtypes' has no attribute {name!r}")
    globals()[name] = value
    return value


class LazyDtypes(Mapping[str, np.dtype]):
    """A read-only name -> numpy dtype table whose ml_dtypes entries resolve on first use.

    Values are numpy dtypes or ``"ml_dtypes:<name>"``; an entry the installed ml_dtypes
    lacks is absent. Lookups of standard names and :meth:`name_of` never import ml_dtypes.
    """

    def __init__(self, specs: Mapping[str, np.dtype | str]) -> None:
        self._specs = dict(specs)

    def __getitem__(self, key: str) -> np.dtype:
        spec = self._specs[key]
        return ml_dtype(spec.split(":", 1)[1]) if isinstance(spec, str) else spec

    def __iter__(self) -> Iterator[str]:
        return (k for k in self._specs if k in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, key: object) -> bool:
        spec = self._specs.get(key) if isinstance(key, str) else None
        if isinstance(spec, str):
            return _ml(spec.split(":", 1)[1]) is not None
        return spec is not None

    def without(self, *names: str) -> LazyDtypes:
        """A copy of the table without the entries ``names``."""
        return LazyDtypes({k: v for k, v in self._specs.items() if k not in names})

    def extended(self, extra: Mapping[str, np.dtype | str]) -> LazyDtypes:
        """A copy of the table with the entries of ``extra`` added (replacing same-named ones)."""
        return LazyDtypes({**self._specs, **extra})

    def name_of(self, dtype: np.dtype) -> str:
        """The first name whose dtype equals ``dtype`` (``KeyError`` when none does)."""
        dtype = np.dtype(dtype)
        for name, spec in self._specs.items():
            if isinstance(spec, str):
                if _ml_loaded() and name in self and self[name] == dtype:
                    return name
            elif spec == dtype:
                return name
        raise KeyError(str(dtype))


# safetensors dtype string -> numpy dtype
SAFETENSORS_DTYPES = LazyDtypes(
    {
        "F64": np.dtype("<f8"),
        "F32": np.dtype("<f4"),
        "F16": np.dtype("<f2"),
        "BF16": "ml_dtypes:bfloat16",
        "F8_E4M3": "ml_dtypes:float8_e4m3fn",
        "F8_E5M2": "ml_dtypes:float8_e5m2",
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
        "F8_E4M3FNUZ": "ml_dtypes:float8_e4m3fnuz",
        "F8_E5M2FNUZ": "ml_dtypes:float8_e5m2fnuz",
        "F8_E8M0": "ml_dtypes:float8_e8m0fnu",
    }
)


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
    dtype = (
        np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
    )
    return SAFETENSORS_DTYPES.name_of(dtype)


def _bits_of(nat: np.dtype) -> np.dtype | None:
    if nat in _STD_FLOAT_BITS:
        return _STD_FLOAT_BITS[nat]
    if not _ml_loaded():
        return None
    table: dict[np.dtype, np.dtype] = __getattr__("FLOAT_BITS")
    return table.get(nat)


def is_float(dtype: np.dtype) -> bool:
    """True for every floating dtype dmlib knows bits for (f64/f32/f16/bf16/f8/f6/f4), either byte order."""
    return _bits_of(native(dtype)) is not None


def bits_dtype(dtype: np.dtype) -> np.dtype:
    """The unsigned integer dtype with the same width and byte order, for viewing bit patterns."""
    dtype = np.dtype(dtype)
    known = _bits_of(native(dtype))
    bits = (
        known
        if known is not None
        else np.dtype(f"u{dtype.itemsize}")
        if dtype.itemsize > 1
        else np.dtype("u1")
    )
    # viewing big-endian bytes through a big-endian integer gives the right bit pattern
    return bits.newbyteorder(">") if dtype.byteorder == ">" and bits.itemsize > 1 else bits


def from_label(label: str) -> np.dtype:
    """The numpy dtype a :func:`dtype_label` names (ml_dtypes names import ml_dtypes)."""
    try:
        return np.dtype(label)
    except TypeError:
        return ml_dtype(label)


def dtype_label(dtype: np.dtype) -> str:
    """Short readable name: float32, bfloat16, float8_e4m3fn, int64, bool..."""
    return np.dtype(dtype).name
