"""The CBOR encoding Burn's burnpack writer produces (ciborium's rules).

Definite lengths, minimal-length integer heads, map keys in insertion order, and floats
in the shortest width that is lossless (f16, then f32, then f64). ``cbor2``'s default
encoder writes every float as f64 and its canonical mode reorders map keys, so neither
reproduces Burn's bytes. Decoding is strict (see :func:`decode`): a metadata blob that
``cbor2`` would quietly accept (a duplicate name, trailing bytes) is refused.
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


# ----------------------------------------------------------------------------- decoder

MAX_DEPTH = 64  # burnpack metadata nests four deep; anything far deeper is hostile


class CBORError(ValueError):
    """Malformed or unexpected CBOR; the message gives the byte position."""


def decode(data: bytes | memoryview | np.ndarray) -> Any:
    """Decode one CBOR item that fills ``data`` exactly, strictly.

    Unlike ``cbor2.loads`` this refuses what Burn never writes and what could make a
    reader lie or stall: duplicate map keys (a second descriptor for a name would hide
    the first), trailing bytes, tags, unhashable keys and nesting deeper than
    ``MAX_DEPTH``. A claimed length is checked against the bytes actually left before
    anything is allocated, so a header claiming 2**64 items fails at once.
    """
    mv = memoryview(bytes(data))
    value, pos = _decode(mv, 0, 0)
    if value is _BREAK:
        raise CBORError("a lone break byte (0xff) instead of a CBOR item")
    if pos != len(mv):
        raise CBORError(f"{len(mv) - pos} trailing bytes after the CBOR item (at byte {pos})")
    return value


_BREAK = object()


def _need(mv: memoryview, pos: int, n: int) -> None:
    if n > len(mv) - pos:
        raise CBORError(f"item at byte {pos} needs {n} bytes but only {len(mv) - pos} remain")


def _arg(mv: memoryview, pos: int, info: int) -> tuple[int | None, int]:
    """The head's argument (None for indefinite length) and the position after it."""
    if info < 24:
        return info, pos
    if info in (24, 25, 26, 27):
        n = 1 << (info - 24)
        _need(mv, pos, n)
        return int.from_bytes(mv[pos : pos + n], "big"), pos + n
    if info == 31:
        return None, pos
    raise CBORError(f"reserved additional information {info} at byte {pos - 1}")


def _decode(mv: memoryview, pos: int, depth: int) -> tuple[Any, int]:
    """The item starting at byte ``pos``, and the byte after it (one step per major type)."""
    if depth > MAX_DEPTH:
        raise CBORError(f"nesting deeper than {MAX_DEPTH} at byte {pos}")
    _need(mv, pos, 1)
    start = pos
    ib = mv[pos]
    major, info = ib >> 5, ib & 31
    arg, pos = _arg(mv, pos + 1, info)
    if major == 0 or major == 1:
        if arg is None:
            raise CBORError(f"indefinite-length integer at byte {start}")
        return (arg if major == 0 else -1 - arg), pos
    if major in (2, 3):
        return _string(mv, pos, major, arg, start, depth)
    if major == 4:
        return _array(mv, pos, arg, depth)
    if major == 5:
        return _map(mv, pos, arg, depth)
    if major == 6:
        raise CBORError(f"tag {arg} at byte {start} (burnpack metadata uses no tags)")
    return _simple(mv, pos, info, arg, start)  # major 7


def _string(
    mv: memoryview, pos: int, major: int, arg: int | None, start: int, depth: int
) -> tuple[bytes | str, int]:
    """A byte string (major 2) or a UTF-8 text string (major 3), definite or in chunks."""
    if arg is None:  # indefinite: definite chunks of the same major type
        parts = []
        while True:
            _need(mv, pos, 1)
            if mv[pos] == 0xFF:
                pos += 1
                break
            if mv[pos] >> 5 != major or mv[pos] & 31 == 31:
                raise CBORError(f"bad chunk in indefinite string at byte {pos}")
            chunk, pos = _decode(mv, pos, depth + 1)
            parts.append(chunk)
        return (b"".join(parts) if major == 2 else "".join(parts)), pos
    _need(mv, pos, arg)
    raw = bytes(mv[pos : pos + arg])
    if major == 2:
        return raw, pos + arg
    try:
        return raw.decode("utf-8"), pos + arg
    except UnicodeDecodeError:
        raise CBORError(f"text string at byte {start} is not valid UTF-8") from None


def _array(mv: memoryview, pos: int, arg: int | None, depth: int) -> tuple[list[Any], int]:
    """An array of ``arg`` items (None: up to a break)."""
    out: list[Any] = []
    if arg is not None:
        _need(mv, pos, arg)  # every item takes at least one byte
    while arg is None or len(out) < arg:
        item, pos = _decode(mv, pos, depth + 1)
        if item is _BREAK:
            if arg is not None:
                raise CBORError(f"unexpected break at byte {pos - 1}")
            break
        out.append(item)
    return out, pos


def _map(mv: memoryview, pos: int, arg: int | None, depth: int) -> tuple[dict[Any, Any], int]:
    """A map of ``arg`` pairs (None: up to a break); keys are scalars, each once."""
    d: dict[Any, Any] = {}
    if arg is not None:
        _need(mv, pos, 2 * arg)
    n = 0
    while arg is None or n < arg:
        kpos = pos
        key, pos = _decode(mv, pos, depth + 1)
        if key is _BREAK:
            if arg is not None:
                raise CBORError(f"unexpected break at byte {kpos}")
            break
        if not isinstance(key, (str, int, bytes, bool, float)) and key is not None:
            raise CBORError(f"map key at byte {kpos} is a {type(key).__name__}, not a scalar")
        if key in d:
            raise CBORError(f"duplicate map key {key!r:.80} at byte {kpos}")
        val, pos = _decode(mv, pos, depth + 1)
        if val is _BREAK:
            raise CBORError(f"break instead of a map value at byte {pos - 1}")
        d[key] = val
        n += 1
    return d, pos


def _simple(mv: memoryview, pos: int, info: int, arg: int | None, start: int) -> tuple[Any, int]:
    """A simple value or a float (major 7); the break code comes back as ``_BREAK``."""
    if info == 20:
        return False, pos
    if info == 21:
        return True, pos
    if info in (22, 23):
        return None, pos
    if info == 25:
        return float(np.frombuffer(mv[pos - 2 : pos], ">f2")[0]), pos
    if info == 26:
        return float(np.frombuffer(mv[pos - 4 : pos], ">f4")[0]), pos
    if info == 27:
        return float(np.frombuffer(mv[pos - 8 : pos], ">f8")[0]), pos
    if info == 31:
        return _BREAK, pos
    raise CBORError(f"unsupported simple value {info if arg is None else arg} at byte {start}")
