"""GGUF (llama.cpp's format), parsed by dmlib itself and memory-mapped.

Layout (the GGUF spec in llama.cpp's ``docs/gguf.md``): magic ``GGUF``, version (2 or 3),
tensor count and key/value count (u64), the key/values, one info per tensor (name, dims
with the fastest-varying first, ggml type, offset relative to the data section), then the
data section at the next multiple of ``general.alignment`` (default 32). Files written
big-endian are recognised by their version field and read in that byte order.

What is checked: magic and version; every count and string length against the bytes
left; array nesting; the alignment (a power of two); every tensor's dims (at most 4,
non-negative, a whole number of quantization blocks per row), offset (aligned, inside
the file) and byte length (dims x type size); no two tensors overlapping or sharing a
name, and no more than alignment padding between consecutive tensors. F32/F16/BF16/F64 and integer tensors load as numpy arrays (zero copy). Quantized
tensors (Q8_0, Q4_K, ...) are their stored blocks: ``quantized`` with ``dtype_name`` the
type's name, compared byte by byte; ``open_gguf(path, dequantize=True)`` gives their
float32 values instead (needs the ``gguf`` package: ``pip install 'dmlib[formats]'``).
Key/values become ``metadata`` (long arrays as their length and a digest).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from typing import Any, Literal

import numpy as np

from dmlib import _limits
from dmlib import dtypes as _dtypes
from dmlib.errors import (
    FormatError,
    LayoutError,
    MissingDependencyError,
    TruncatedError,
    UnsupportedError,
)
from dmlib.io._checks import short_repr, tiling_problem
from dmlib.tensor import FileStamp, Tensor, TensorSet

MAGIC = b"GGUF"
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 8
SHORT_ARRAY = 64  # arrays longer than this go into metadata as a digest

# ggml type id -> (name, elements per block, bytes per block, numpy dtype for unquantized)
GGML_TYPES: dict[int, tuple[str, int, int, str | None]] = {
    0: ("F32", 1, 4, "f4"),
    1: ("F16", 1, 2, "f2"),
    2: ("Q4_0", 32, 18, None),
    3: ("Q4_1", 32, 20, None),
    6: ("Q5_0", 32, 22, None),
    7: ("Q5_1", 32, 24, None),
    8: ("Q8_0", 32, 34, None),
    9: ("Q8_1", 32, 40, None),
    10: ("Q2_K", 256, 84, None),
    11: ("Q3_K", 256, 110, None),
    12: ("Q4_K", 256, 144, None),
    13: ("Q5_K", 256, 176, None),
    14: ("Q6_K", 256, 210, None),
    15: ("Q8_K", 256, 292, None),
    16: ("IQ2_XXS", 256, 66, None),
    17: ("IQ2_XS", 256, 74, None),
    18: ("IQ3_XXS", 256, 98, None),
    19: ("IQ1_S", 256, 50, None),
    20: ("IQ4_NL", 32, 18, None),
    21: ("IQ3_S", 256, 110, None),
    22: ("IQ2_S", 256, 82, None),
    23: ("IQ4_XS", 256, 136, None),
    24: ("I8", 1, 1, "i1"),
    25: ("I16", 1, 2, "i2"),
    26: ("I32", 1, 4, "i4"),
    27: ("I64", 1, 8, "i8"),
    28: ("F64", 1, 8, "f8"),
    29: ("IQ1_M", 256, 56, None),
    30: ("BF16", 1, 2, "bf16"),
    34: ("TQ1_0", 256, 54, None),
    35: ("TQ2_0", 256, 66, None),
    39: ("MXFP4", 32, 17, None),
    40: ("NVFP4", 64, 36, None),
    41: ("Q1_0", 128, 18, None),
}

# GGUF value type -> struct code (None: string, array)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_TYPE_NAMES = {
    0: "u8",
    1: "i8",
    2: "u16",
    3: "i16",
    4: "u32",
    5: "i32",
    6: "f32",
    7: "bool",
    8: "str",
    9: "array",
    10: "u64",
    11: "i64",
    12: "f64",
}


def can_open(head: bytes, path: str) -> bool:
    """A file starting with the magic ``GGUF`` (any name)."""
    return head.startswith(MAGIC)


class _Cursor:
    """Reads the header through the memory map, every read checked against the file end."""

    def __init__(self, buf: np.ndarray, path: str, order: str) -> None:
        self.buf, self.path, self.order, self.pos = buf, path, order, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise TruncatedError(
                f"{what} at byte {self.pos} needs {n} bytes, the file has {len(self.buf) - self.pos} left",
                path=self.path,
            )
        out = self.buf[self.pos : self.pos + n].tobytes()
        self.pos += n
        return out

    def view(self, n: int, what: str) -> np.ndarray:
        """Like :meth:`take`, without a copy: a view of the next ``n`` bytes of the map."""
        if n < 0 or self.pos + n > len(self.buf):
            raise TruncatedError(
                f"{what} at byte {self.pos} needs {n} bytes, the file has {len(self.buf) - self.pos} left",
                path=self.path,
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, code: str, what: str) -> Any:
        return struct.unpack(self.order + code, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("Q", what + " length")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise FormatError(
                f"{what} at byte {self.pos - n} is not UTF-8", path=self.path
            ) from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            v = self.scalar(_SCALARS[vtype], what)
            return bool(v) if vtype == 7 else v
        if vtype == 8:
            return self.string(what)
        if vtype == 9:
            if depth >= MAX_NESTING:
                raise FormatError(
                    f"{what}: arrays nested more than {MAX_NESTING} deep", path=self.path
                )
            etype = self.scalar("I", what + " element type")
            n = self.scalar("Q", what + " length")
            if etype in _SCALARS:  # fixed width: check the length before reading
                size = struct.calcsize(_SCALARS[etype])
                return _Array(etype, n, self.view(n * size, what))
            if etype not in (8, 9):
                raise FormatError(f"{what}: unknown array element type {etype}", path=self.path)
            if n > len(self.buf) - self.pos:  # every element takes at least one byte
                raise TruncatedError(
                    f"{what}: {n} elements cannot fit in the bytes left", path=self.path
                )
            start = self.pos
            # a long array is kept as its length and digest only: its items are walked
            # (and checked) but not held, so a vocabulary of millions costs no objects
            items: list | None = [] if n <= SHORT_ARRAY else None
            for _ in range(n):
                item = self.value(etype, what, depth + 1)
                if items is not None:
                    items.append(item)
            return _Array(etype, n, self.buf[start : self.pos], items)
        raise FormatError(f"{what}: unknown value type {vtype}", path=self.path)


class _Array:
    def __init__(self, etype: int, n: int, raw: Any, items: list | None = None) -> None:
        self.etype, self.n, self.raw, self.items = etype, n, raw, items

    def text(self, order: str) -> str:
        if self.n <= SHORT_ARRAY:
            if self.items is None:
                code = _SCALARS[self.etype]
                vals = list(struct.unpack(f"{order}{self.n}{code}", self.raw))
            else:
                vals = [v.text(order) if isinstance(v, _Array) else v for v in self.items]
            return json.dumps(vals)
        digest = hashlib.sha256(self.raw).hexdigest()[:16]
        return f"<array of {self.n} {_TYPE_NAMES.get(self.etype, self.etype)}, sha256 {digest}>"


def _byte_order(head: bytes, path: str) -> Literal["<", ">"]:
    le, be = struct.unpack("<I", head[4:8])[0], struct.unpack(">I", head[4:8])[0]
    if le in (2, 3):
        return "<"
    if be in (2, 3):
        return ">"
    v = le if le < be else be
    raise UnsupportedError(f"GGUF version {v}: dmlib reads versions 2 and 3", path=path)


def open_gguf(path: str | os.PathLike[str], *, dequantize: bool = False) -> TensorSet:
    """Open a GGUF file as a lazy TensorSet (quantized blocks as bytes, or dequantized).

    Steps: the fixed header (magic, byte order, counts), the key/values, the tensor
    infos, every tensor checked and made, then the tiling of the data section.
    """
    path = os.fspath(path)
    stamp = FileStamp.take(path)  # before the header is read
    size = os.path.getsize(path)
    buf, order = _open_map(path, size)
    cur = _Cursor(buf, path, order)
    cur.pos = 4
    version = cur.scalar("I", "version")
    n_tensors = cur.scalar("Q", "tensor count")
    n_kv = cur.scalar("Q", "key/value count")
    # every key/value takes at least 12 bytes, every tensor info at least 24
    if n_kv * 12 + n_tensors * 24 > size:
        raise TruncatedError(
            f"{n_kv} key/values and {n_tensors} tensors cannot fit in {size} bytes", path=path
        )
    metadata, alignment = _key_values(cur, n_kv)
    infos = _tensor_infos(cur, n_tensors)
    base = -(-cur.pos // alignment) * alignment
    tensors: dict[str, Tensor] = {}
    spans = []
    quant: list[str] = []
    for name, dims, gtype, offset in infos:
        if name in tensors:
            raise FormatError(f"tensor {name!r} appears twice", path=path)
        tensors[name], nbytes = _tensor(
            buf, path, name, dims, gtype, base + offset, order, dequantize
        )
        spans.append((offset, offset + nbytes, name))
        if GGML_TYPES[gtype][3] is None:
            quant.append(name)
    # Writers (llama.cpp's and the gguf package) lay tensors back to back, each padded to
    # the alignment: bytes that belong to no tensor are where a shifted offset would hide
    problem = tiling_problem(
        spans, size - base, base=base, align=alignment, exact_end=False, empty_may_overlap=True
    )
    if problem is not None:
        raise (TruncatedError if problem.kind == "bounds" else LayoutError)(
            problem.message, path=path
        )
    layout: dict[str, Any] = {
        "version": version,
        "data_base": base,
        "alignment": alignment,
        "byte_order": order,
    }
    if quant:
        layout["quantized" if not dequantize else "dequantized"] = quant
    return TensorSet(
        tensors,
        path=path,
        format="gguf",
        metadata=metadata,
        layout=layout,
        buffer=buf,
        stamp=stamp,
    )


def _open_map(path: str, size: int) -> tuple[np.ndarray, Literal["<", ">"]]:
    """The file's memory map and byte order, after its size and magic are checked."""
    if size < 24:
        raise TruncatedError(f"{size} bytes, shorter than the 24-byte GGUF header", path=path)
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    if buf[:4].tobytes() != MAGIC:
        raise FormatError(f"not a GGUF file (magic {buf[:4].tobytes()!r})", path=path)
    return buf, _byte_order(buf[:8].tobytes(), path)


def _key_values(cur: _Cursor, n_kv: int) -> tuple[dict[str, str], int]:
    """The ``n_kv`` key/values as text, and the data alignment (``general.alignment``)."""
    metadata: dict[str, str] = {}
    alignment = 32
    for i in range(n_kv):
        key = cur.string(f"key {i}")
        vtype = cur.scalar("I", f"type of {key!r}")
        value = cur.value(vtype, f"value of {key!r}")
        if key in metadata:
            raise FormatError(f"key {key!r} appears twice", path=cur.path)
        metadata[key] = value.text(cur.order) if isinstance(value, _Array) else str(value)
        if key == "general.alignment":
            if vtype not in (4, 10) or not (
                isinstance(value, int) and value > 0 and value & (value - 1) == 0
            ):
                raise FormatError(
                    f"general.alignment {short_repr(value)} is not a power of two", path=cur.path
                )
            alignment = value
    return metadata, alignment


def _tensor_infos(cur: _Cursor, n_tensors: int) -> list[tuple[str, list[int], int, int]]:
    """The tensor infos: (name, ggml dims, ggml type, data offset) each."""
    infos = []
    for i in range(n_tensors):
        name = cur.string(f"name of tensor {i}")
        n_dims = cur.scalar("I", f"dims of {name!r}")
        if n_dims > MAX_DIMS:
            raise FormatError(
                f"tensor {name!r}: {n_dims} dimensions (at most {MAX_DIMS})", path=cur.path
            )
        dims = [cur.scalar("Q", f"dim of {name!r}") for _ in range(n_dims)]
        gtype = cur.scalar("I", f"type of {name!r}")
        offset = cur.scalar("Q", f"offset of {name!r}")
        infos.append((name, dims, gtype, offset))
    return infos


def _tensor(
    buf: np.ndarray,
    path: str,
    name: str,
    dims: list[int],
    gtype: int,
    start: int,
    order: Literal["<", ">"],
    dequantize: bool,
) -> tuple[Tensor, int]:
    """The Tensor of one tensor info starting at byte ``start``, and the bytes it holds."""
    if gtype not in GGML_TYPES:
        raise UnsupportedError(f"tensor {name!r}: unknown ggml type {gtype}", path=path)
    tname, block, bsize, np_code = GGML_TYPES[gtype]
    numel = math.prod(dims)
    if numel >= 1 << 62:
        raise FormatError(f"tensor {name!r}: dims {dims} claim {numel} elements", path=path)
    if dims and dims[0] % block:
        raise LayoutError(
            f"tensor {name!r}: rows of {dims[0]} {tname} values are not whole blocks of {block}",
            path=path,
        )
    nbytes = numel // block * bsize
    shape = tuple(reversed(dims))  # ggml's first dim varies fastest: numpy's last
    if np_code is not None:
        dt = (_dtypes.BFLOAT16 if np_code == "bf16" else np.dtype(np_code)).newbyteorder(order)
        return Tensor(
            name, dt, shape, nbytes=nbytes, offset=start, dtype_name=tname, source=buf,
            path=path, in_buffer=True,
        ), nbytes  # fmt: skip
    if dequantize:
        if numel * 4 > _limits.max_decompressed():
            raise FormatError(
                f"tensor {name!r}: dequantized it would take {_limits.human(numel * 4)}, "
                f"more than the {_limits.human(_limits.max_decompressed())} allowed on this "
                f"machine; {_limits.limit_hint()}",
                path=path,
            )
        return Tensor(
            name, np.dtype("f4"), shape, nbytes=numel * 4, dtype_name=f"{tname}->F32", path=path,
            source=_dequantizer(buf, start, nbytes, gtype, shape, path, name),
        ), nbytes  # fmt: skip
    return Tensor(
        name, np.dtype("u1"), shape, nbytes=nbytes, offset=start, dtype_name=tname,
        source=buf, path=path, in_buffer=True, quantized=True,
    ), nbytes  # fmt: skip


def _dequantizer(
    buf: np.ndarray,
    start: int,
    nbytes: int,
    gtype: int,
    shape: tuple[int, ...],
    path: str,
    name: str,
) -> Any:
    def values() -> np.ndarray:
        try:
            from gguf import quants
            from gguf.constants import GGMLQuantizationType
        except ImportError:
            raise MissingDependencyError(
                "dequantizing GGUF tensors needs gguf: pip install 'dmlib[formats]'", path=path
            ) from None
        blocks = (
            np.asarray(buf[start : start + nbytes]).reshape(*shape[:-1], -1)
            if shape
            else np.asarray(buf[start : start + nbytes])
        )
        try:
            out = quants.dequantize(blocks, GGMLQuantizationType(gtype))
        except (NotImplementedError, ValueError) as err:
            raise UnsupportedError(
                f"tensor {name!r}: gguf cannot dequantize {GGML_TYPES[gtype][0]} ({err})", path=path
            ) from None
        return np.ascontiguousarray(out, dtype=np.float32).reshape(-1).view(np.uint8)

    return values
