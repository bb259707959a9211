"""The CBOR encoding Burn's burnpack writer produces (ciborium's rules).

Definite lengths, minimal-length integer heads, map keys in insertion order, and floats
in the shortest width that is lossless (f16, then f32, then f64). ``cbor2``'s default
encoder writes every float as f64 and its canonical mode reorders map keys, so neither
reproduces Burn's bytes; decoding uses ``cbor2``.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np


def _head(major: int, value: int) -> bytes:
    if value < 0:
        raise ValueError("CBOR head value must be non-negative")
    if value < 24:
        return bytes([(major << 5) | value])
    if value < 1 << 8:
        return bytes([(major << 5) | 24, value])
    if value < 1 << 16:
        return bytes([(major << 5) | 25]) + struct.pack(">H", value)
    if value < 1 << 32:
        return bytes([(major << 5) | 26]) + struct.pack(">I", value)
    if value < 1 << 64:
        return bytes([(major << 5) | 27]) + struct.pack(">Q", value)
    raise ValueError(f"integer {value} does not fit in 64 bits")


def _float(value: float) -> bytes:
    if math.isnan(value):
        return b"\xf9\x7e\x00"  # canonical half-precision NaN
    f16 = np.float16(value)
    if float(f16) == value:
        return b"\xf9" + struct.pack(">e", value)
    f32 = np.float32(value)
    if float(f32) == value:
        return b"\xfa" + struct.pack(">f", value)
    return b"\xfb" + struct.pack(">d", value)


def encode(obj: Any) -> bytes:
    """Encode ``obj`` (dict/list/tuple/str/bytes/int/float/bool/None) with Burn's rules."""
    out = bytearray()
    _encode(obj, out)
    return bytes(out)


def _encode(obj: Any, out: bytearray) -> None:
    if obj is True:
        out += b"\xf5"
    elif obj is False:
        out += b"\xf4"
    elif obj is None:
        out += b"\xf6"
    elif isinstance(obj, (int, np.integer)):
        v = int(obj)
        out += _head(0, v) if v >= 0 else _head(1, -1 - v)
    elif isinstance(obj, (float, np.floating)):
        out += _float(float(obj))
    elif isinstance(obj, str):
        b = obj.encode("utf-8")
        out += _head(3, len(b)) + b
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        b = bytes(obj)
        out += _head(2, len(b)) + b
    elif isinstance(obj, Mapping):
        out += _head(5, len(obj))
        for k, v in obj.items():
            _encode(k, out)
            _encode(v, out)
    elif isinstance(obj, (list, tuple)):
        out += _head(4, len(obj))
        for v in obj:
            _encode(v, out)
    else:
        raise TypeError(f"cannot CBOR-encode {type(obj).__name__}")
