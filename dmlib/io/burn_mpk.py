"""Burn's named MessagePack records (``NamedMpkFileRecorder``: ``.mpk``; gzip: ``.mpk.gz``).

Layout, from Burn's source (``burn-core/src/record``): the file is one MessagePack value
written with ``rmp_serde::encode::write_named`` (structs as maps keyed by field name):
``{"metadata": {"float", "int", "format", "version", "settings"}, "item": <record>}``.
The record mirrors the module tree (a struct's fields as map keys, a ``Vec`` of modules
as an array); every parameter is ``{"id": <ParamId>, "param": <tensor>}`` and a tensor
is Burn's ``TensorData``: ``{"bytes": <bin>, "shape": [...], "dtype": <DType>}`` (Burn
0.14 and later; earlier records stored ``{"value": [numbers], "shape": [...]}``).

dmlib names each tensor by its path (``encoder.layers.0.weight``), reads the bytes as
the dtype says (little-endian, as Burn writes them), checks the byte length against the
shape, and keeps a tensor whose dtype it cannot interpret (a quantized ``QFloat``, a
variant given by index) as opaque bytes. Plain values elsewhere in the record (numbers,
strings, bools) become ``scalars``. The whole record is decoded in memory (MessagePack
has no index to seek by); a ``.mpk.gz`` is decompressed first, in a streaming way, refused as soon as it
outgrows the limits of :mod:`dmlib._limits` (which scale with the machine's memory).
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from dmlib import _limits
from dmlib.dtypes import LazyDtypes
from dmlib.errors import FormatError, MissingDependencyError, TruncatedError
from dmlib.io._checks import shape_problem, short_repr
from dmlib.tensor import FileStamp, Tensor, TensorSet

SUFFIXES = (".mpk", ".mpk.gz")
MAX_DEPTH = 64

# Burn DType name -> numpy dtype (as burnpack names them)
DTYPES = LazyDtypes(
    {
        "F64": np.dtype("<f8"),
        "F32": np.dtype("<f4"),
        "Flex32": np.dtype("<f4"),
        "F16": np.dtype("<f2"),
        "BF16": "ml_dtypes:bfloat16",
        "I64": np.dtype("<i8"),
        "I32": np.dtype("<i4"),
        "I16": np.dtype("<i2"),
        "I8": np.dtype("i1"),
        "U64": np.dtype("<u8"),
        "U32": np.dtype("<u4"),
        "U16": np.dtype("<u2"),
        "U8": np.dtype("u1"),
        "Bool": np.dtype("?"),
    }
)


def can_open(head: bytes, path: str) -> bool:
    """A ``.mpk.gz`` starting with gzip's magic ``\\x1f\\x8b``, or a ``.mpk`` whose first byte
    opens a MessagePack map (a fixmap of 2 entries, a map16 or a map32); names in any case.
    """
    low = path.lower()
    if low.endswith(".mpk.gz"):
        return head.startswith(b"\x1f\x8b")
    # a fixmap/map16/map32 holding "metadata" and "item"
    return low.endswith(".mpk") and head[:1] in (b"\x82", b"\xde", b"\xdf")


def _decode(path: str) -> Any:
    try:
        import msgpack
    except ImportError:
        raise MissingDependencyError(
            "reading Burn .mpk records needs msgpack: pip install 'dmlib[formats]'", path=path
        ) from None
    raw: bytes | bytearray
    with open(path, "rb") as f:
        head = f.read(2)
        f.seek(0)
        if path.lower().endswith(".gz") or head == b"\x1f\x8b":
            raw = _gunzip(f, os.fstat(f.fileno()).st_size, path)
        else:
            size = os.fstat(f.fileno()).st_size
            if size > _limits.max_decompressed():  # decoded whole: refuse, do not exhaust memory
                raise FormatError(
                    f"refused: a {_limits.human(size)} record is decoded whole in memory, more "
                    f"than the {_limits.human(_limits.max_decompressed())} one record may take "
                    f"on this machine; {_limits.limit_hint()}",
                    path=path,
                )
            raw = f.read()
    try:
        # strict: one value exactly; maps keyed by strings; bytes stay bytes
        return msgpack.unpackb(
            raw, raw=False, strict_map_key=False, use_list=True, max_bin_len=len(raw)
        )
    except msgpack.ExtraData:
        raise FormatError("bytes after the record's MessagePack value", path=path) from None
    except (
        ValueError,
        msgpack.UnpackException,
        msgpack.FormatError,
        msgpack.StackError,
        TypeError,
    ) as err:
        kind = (
            TruncatedError
            if "incomplete" in str(err).lower() or "insufficient" in str(err).lower()
            else FormatError
        )
        raise kind(
            f"not a readable MessagePack record ({type(err).__name__}: {short_repr(str(err), 120)})",
            path=path,
        ) from None


_CHUNK = 1 << 20  # compressed bytes fed to the decompressor at a time


def _gunzip(f: BinaryIO, size: int, path: str) -> bytearray:
    """The one gzip member in ``f``, inflated piece by piece into a buffer of the size its
    trailer declares (ISIZE, RFC 1952), refused as soon as it outgrows that or
    :func:`dmlib._limits.allowed_output` of the file's size: never inflated in full first,
    never more held than the smaller of the two."""
    allowed = _limits.allowed_output(size)
    if size < 20:  # header 10, the shortest deflate stream 2, trailer 8
        raise TruncatedError(f"{size} bytes, too short for a gzip stream", path=path)
    f.seek(size - 4)
    (declared,) = struct.unpack("<I", f.read(4))
    f.seek(0)
    if declared > allowed:
        raise FormatError(
            f"refused: {_limits.human(size)} of gzip declare {_limits.human(declared)} "
            f"inflated, more than the {_limits.human(allowed)} allowed for them on this "
            f"machine; {_limits.limit_hint()}",
            path=path,
        )
    out = bytearray(declared)  # zero pages: memory is taken as they are written
    n, target = 0, declared
    d = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        while not d.eof:
            data = d.unconsumed_tail or f.read(_CHUNK)
            if not data:
                raise TruncatedError("gzip stream ends early", path=path)
            piece = d.decompress(data, 16 * _CHUNK)
            while n + len(piece) > target:  # ISIZE is the length mod 2**32: maybe 4 GiB more
                target += 1 << 32
                if target > allowed:
                    what = (
                        f"inflate to more than {_limits.human(allowed)}, the most allowed for "
                        "them on this machine"
                        if n + len(piece) > allowed
                        else f"inflate past the {declared} bytes their trailer declares"
                    )
                    raise FormatError(
                        f"refused: {_limits.human(size)} of gzip {what}; {_limits.limit_hint()}",
                        path=path,
                    )
            if n + len(piece) > len(out):
                out += bytes(target - len(out))
            out[n : n + len(piece)] = piece
            n += len(piece)
    except zlib.error as err:
        raise FormatError(f"damaged gzip stream ({err})", path=path) from None
    if d.unused_data or f.read(1):
        raise FormatError("bytes after the gzip stream (one gzip member expected)", path=path)
    del out[n:]
    return out  # msgpack reads the bytearray itself: no second copy


def _dtype_name(value: Any) -> str | None:
    """A DType as rmp_serde writes it: the variant name, or a one-key map {name: payload}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and len(value) == 1 and isinstance(next(iter(value)), str):
        return next(iter(value))
    return None


def _is_tensor(node: Any) -> bool:
    return isinstance(node, dict) and "shape" in node and ("bytes" in node or "value" in node)


def open_mpk(path: str | os.PathLike[str]) -> TensorSet:
    """Open a Burn NamedMpk record (``.mpk`` or ``.mpk.gz``) as a TensorSet.

    Steps: the MessagePack document, its metadata, then a walk of the record's item
    tree: each tensor node becomes a Tensor named by its path, each plain value a scalar.
    """
    path = os.fspath(path)
    stamp = FileStamp.take(path)
    doc = _decode(path)
    if not isinstance(doc, dict) or "item" not in doc:
        raise FormatError("not a Burn record (no top-level 'item')", path=path)
    found = _Found(path, _record_metadata(doc.get("metadata"), path))
    _walk(doc["item"], "", 0, found)
    layout: dict[str, Any] = {"compressed": path.lower().endswith(".gz")}
    opaque = [n for n, t in found.tensors.items() if t.opaque]
    if opaque:
        layout["opaque"] = opaque
    return TensorSet(
        found.tensors,
        path=path,
        format="burn-mpk",
        metadata=found.metadata,
        scalars=found.scalars,
        layout=layout,
        stamp=stamp,
    )


@dataclass
class _Found:
    """What the walk of one record has found so far."""

    path: str
    metadata: dict[str, str]
    tensors: dict[str, Tensor] = field(default_factory=dict)
    scalars: dict[str, Any] = field(default_factory=dict)


def _record_metadata(meta_raw: Any, path: str) -> dict[str, str]:
    """The record's metadata map as text (values that are not plain are left out)."""
    if isinstance(meta_raw, dict):
        return {
            str(k): str(v) for k, v in meta_raw.items() if isinstance(v, (str, int, float, bool))
        }
    if meta_raw is not None:
        raise FormatError(f"record metadata is a {type(meta_raw).__name__}, not a map", path=path)
    return {}


def _walk(node: Any, name: str, depth: int, found: _Found) -> None:
    """Collect the tensors and scalars under ``node`` (named ``name``) into ``found``."""
    path = found.path
    if depth > MAX_DEPTH:
        raise FormatError(f"{name!r}: nested more than {MAX_DEPTH} deep", path=path)
    if isinstance(node, dict) and set(node) >= {"id", "param"} and len(node) == 2:
        param = node["param"]
        if _is_tensor(param):
            found.tensors[name] = _tensor(name, param, node["id"], found)
            return
        _walk(param, name, depth + 1, found)
        return
    if _is_tensor(node):
        found.tensors[name] = _tensor(name, node, None, found)
        return
    if isinstance(node, dict):
        for k, v in node.items():
            _walk(v, f"{name}.{k}" if name else str(k), depth + 1, found)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _walk(v, f"{name}.{i}" if name else str(i), depth + 1, found)
    elif isinstance(node, (int, float, bool, str)):
        found.scalars[name] = node
    # None (a unit / PhantomData field) carries nothing


def _tensor(name: str, node: dict, pid: Any, found: _Found) -> Tensor:
    """The Tensor of one tensor node: raw bytes (Burn 0.14 on) or a list of values."""
    path = found.path
    problem = shape_problem(node.get("shape"), 1)
    if problem is not None:
        raise FormatError(f"tensor {name!r}: {problem}", path=path)
    shape: list[int] = node["shape"]
    if "bytes" in node:
        dname, dt, arr = _bytes_of(name, node, shape, path)
        if dt is None:  # QFloat, or a variant we cannot name: its bytes, byte-wise
            label = dname or f"DType{short_repr(node.get('dtype'), 40)}"
            return Tensor(
                name, np.dtype("u1"), tuple(shape), nbytes=arr.nbytes, source=arr, path=path,
                dtype_name=label, opaque=True, param_id=pid,
            )  # fmt: skip
    else:  # Burn before 0.14: a list of numbers, element type from the record's settings
        dname, dt, arr = _values_of(name, node, shape, found.metadata, path)
    return Tensor(
        name, dt, tuple(shape), nbytes=arr.nbytes, source=arr, path=path, dtype_name=dname,
        param_id=pid,
    )  # fmt: skip


def _bytes_of(
    name: str, node: dict, shape: list[int], path: str
) -> tuple[str | None, np.dtype | None, np.ndarray]:
    """(dtype name, numpy dtype or None when unknown, bytes) of a node holding raw bytes."""
    blob, dname = node["bytes"], _dtype_name(node.get("dtype"))
    if not isinstance(blob, bytes):
        raise FormatError(
            f"tensor {name!r}: 'bytes' is a {type(blob).__name__}, not binary", path=path
        )
    arr = np.frombuffer(blob, np.uint8)
    dt = DTYPES.get(dname) if dname is not None else None
    numel = math.prod(shape)
    if dt is not None and arr.nbytes != numel * dt.itemsize:
        raise FormatError(
            f"tensor {name!r}: {arr.nbytes} bytes but {dname} x {list(shape)} needs {numel * dt.itemsize}",
            path=path,
        )
    return dname, dt, arr


def _values_of(
    name: str, node: dict, shape: list[int], metadata: dict[str, str], path: str
) -> tuple[str, np.dtype, np.ndarray]:
    """(dtype name, numpy dtype, bytes) of a node holding a list of values (Burn < 0.14)."""
    values = node["value"]
    if not isinstance(values, list) or len(values) != math.prod(shape):
        got = len(values) if isinstance(values, list) else type(values).__name__
        raise FormatError(f"tensor {name!r}: {got} values for shape {list(shape)}", path=path)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values) and not all(
        isinstance(v, bool) for v in values
    ):
        raise FormatError(f"tensor {name!r}: values are not all numbers", path=path)
    dname = _legacy_dtype(values, metadata)
    dt = DTYPES[dname]
    arr = np.asarray(values, dtype=np.float64 if dt.kind == "f" else None).astype(dt).view(np.uint8)
    if dt.kind == "f" and not np.array_equal(
        arr.view(dt).astype(np.float64), np.asarray(values, np.float64), equal_nan=True
    ):
        raise FormatError(f"tensor {name!r}: values do not fit {dname} exactly", path=path)
    return dname, dt, arr


def _legacy_dtype(values: list, metadata: dict[str, str]) -> str:
    if values and all(isinstance(v, bool) for v in values):
        return "Bool"
    if all(isinstance(v, int) for v in values):
        return {"i32": "I32", "i16": "I16", "i8": "I8", "u8": "U8"}.get(
            metadata.get("int", ""), "I64"
        )
    return {"f64": "F64", "f16": "F16", "bf16": "BF16"}.get(metadata.get("float", ""), "F32")
