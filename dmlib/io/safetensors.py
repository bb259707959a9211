"""safetensors, parsed by dmlib itself: 8-byte LE header length, JSON header, data.

Offsets are relative to the byte after the header. Every tensor is checked against its
dtype x shape, the file length and its neighbours before anything is returned. Sharded
checkpoints (``*.safetensors.index.json``) open as one TensorSet.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any, cast

import numpy as np

from dmlib import _atomic
from dmlib import dtypes as _dtypes
from dmlib.dtypes import SAFETENSORS_DTYPES, SAFETENSORS_SUBBYTE, safetensors_name
from dmlib.errors import FormatError, LayoutError, TruncatedError, UnsupportedError
from dmlib.io._checks import offsets_problem, shape_problem, short_repr, tiling_problem
from dmlib.tensor import FileStamp, Tensor, TensorSet

MAX_HEADER = 100 * 1024 * 1024  # the reference implementation's own limit


def can_open(head: bytes, path: str) -> bool:
    """At least 10 bytes: a little-endian u64 header length from 2 to :data:`MAX_HEADER`,
    then a header starting with ``{`` (any name).
    """
    if len(head) < 10:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= MAX_HEADER and head[8:9] == b"{"


class _DuplicateKey(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads keeps the last of duplicate keys; a second entry for a tensor name
    # would silently hide the first, so refuse instead
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(short_repr(k, 60))
        out[k] = v
    return out


def _header(path: str, size: int, f) -> tuple[int, dict[str, Any]]:
    if size < 8:
        raise TruncatedError(
            f"{size} bytes, shorter than the 8-byte safetensors header length", path=path
        )
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_HEADER:
        raise FormatError(f"header length {n} exceeds the {MAX_HEADER}-byte limit", path=path)
    if 8 + n > size:
        raise TruncatedError(
            f"header length {n} runs past the end of the file ({size} bytes)", path=path
        )
    try:
        header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(f"corrupt JSON header ({err})", path=path) from None
    except _DuplicateKey as err:
        raise FormatError(
            f"JSON header names {err.args[0]} twice; refusing to pick one", path=path
        ) from None
    except RecursionError:
        raise FormatError(
            "JSON header nests too deeply to be a safetensors header", path=path
        ) from None
    if not isinstance(header, dict):
        raise FormatError("JSON header is not an object", path=path)
    return 8 + n, header


def open_safetensors(path: str | os.PathLike[str]) -> TensorSet:
    """Open a safetensors file as a lazy TensorSet over one memory map.

    Steps: the header (length and JSON), the ``__metadata__`` map, every descriptor
    checked and turned into a Tensor, then the tiling of the data section.
    """
    path = os.fspath(path)
    stamp = FileStamp.take(path)  # before the header is read
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        base, header = _header(path, size, f)
    meta = _metadata(header.pop("__metadata__", {}), path)
    buf = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    tensors = {name: _tensor(name, d, base, buf, path) for name, d in header.items()}
    # Like the reference implementation: tensors tile the data section exactly, in
    # offset order, with no gap, no overlap and nothing after the last one. Bytes that
    # belong to no tensor are where a dropped duplicate or a shifted offset would hide.
    offsets = {name: cast(int, t.offset) for name, t in tensors.items()}  # set by _tensor
    spans = [(offsets[n] - base, offsets[n] - base + t.nbytes, n) for n, t in tensors.items()]
    problem = tiling_problem(spans, size - base, base=base)
    if problem is not None:
        cls = TruncatedError if problem.kind == "bounds" else LayoutError
        raise cls(problem.message, path=path)
    layout: dict[str, Any] = {"data_base": base, "header_size": base - 8}
    opaque = [t.name for t in tensors.values() if t.opaque]
    if opaque:  # listed, hashed and compared byte by byte; never silently dropped
        layout["opaque"] = opaque
    return TensorSet(
        tensors,
        path=path,
        format="safetensors",
        metadata=meta,
        layout=layout,
        buffer=buf,
        stamp=stamp,
    )


def _metadata(meta: Any, path: str) -> dict[str, str]:
    """The header's ``__metadata__``, checked to be a str -> str map."""
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise FormatError("__metadata__ is not a str -> str map", path=path)
    return meta


def _tensor(name: str, d: Any, base: int, buf: np.ndarray, path: str) -> Tensor:
    """The Tensor a header descriptor ``d`` describes, after checking its fields and size."""
    if not isinstance(d, dict) or not {"dtype", "shape", "data_offsets"} <= set(d):
        raise FormatError(
            f"tensor {name!r}: descriptor must have dtype, shape, data_offsets", path=path
        )
    dname = d["dtype"]
    if not isinstance(dname, str) or not dname:
        raise FormatError(
            f"tensor {name!r}: dtype {short_repr(dname)} is not a dtype name", path=path
        )
    shape, offs = d["shape"], d["data_offsets"]
    problem = shape_problem(shape, 1) or offsets_problem(offs)
    if problem is not None:
        raise FormatError(f"tensor {name!r}: {problem}", path=path)
    kind, dt, packing = _element(dname)
    if kind != "unknown":
        _check_length(name, dname, shape, offs, kind, dt, path)
    return Tensor(
        name,
        dt,
        tuple(shape),
        nbytes=offs[1] - offs[0],
        offset=base + offs[0],
        dtype_name=dname,
        source=buf,
        path=path,
        in_buffer=True,
        packing=packing,
        opaque=kind in ("opaque", "unknown"),
    )


def _check_length(
    name: str, dname: str, shape: list, offs: list, kind: str, dt: np.dtype, path: str
) -> None:
    """A known dtype's tensor holds whole bytes, exactly as many as its offsets span."""
    numel = math.prod(shape)
    bits = numel * (dt.itemsize * 8 if kind == "plain" else SAFETENSORS_SUBBYTE[dname])
    if bits % 8:
        raise LayoutError(
            f"tensor {name!r}: {dname} x {shape} is {bits} bits, not a whole number of bytes",
            path=path,
        )
    need = bits // 8
    if offs[1] - offs[0] != need:
        raise LayoutError(
            f"tensor {name!r}: {offs[1] - offs[0]} bytes at {offs} but {dname} x {shape} needs {need}",
            path=path,
        )


def _element(dname: str) -> tuple[str, np.dtype, str | None]:
    """(kind, numpy dtype, packing) of a safetensors dtype name.

    kind: ``"plain"`` (one element per ``itemsize`` bytes), ``"packed"`` (F4: unpacked on
    load), ``"opaque"`` (a known sub-byte dtype whose bit order is not defined: its size
    is still checked) or ``"unknown"`` (a name this release does not know: its bytes are
    kept as they are, so one new dtype never makes the other tensors unreadable).
    """
    if dname in SAFETENSORS_DTYPES:
        return "plain", SAFETENSORS_DTYPES[dname], None
    if dname == "F4" and _dtypes.FLOAT4_E2M1FN is not None:
        return "packed", _dtypes.FLOAT4_E2M1FN, "fp4x2"
    if dname in SAFETENSORS_SUBBYTE:
        return "opaque", np.dtype("u1"), None
    return "unknown", np.dtype("u1"), None


def _encoded(
    tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[np.ndarray]]:
    """The file's length prefix and header, and each tensor's little-endian C-order bytes (views where possible)."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    chunks, off = [], 0
    for name, arr in tensors.items():
        a = np.asarray(arr)
        a = np.ascontiguousarray(a).reshape(a.shape)  # ascontiguousarray makes 0-d arrays 1-d
        try:
            dname = safetensors_name(a.dtype)
        except KeyError:
            raise UnsupportedError(
                f"tensor {name!r}: safetensors has no dtype for numpy {a.dtype}"
            ) from None
        b = a.astype(a.dtype.newbyteorder("<"), copy=False).reshape(-1).view(np.uint8)
        header[name] = {"dtype": dname, "shape": list(a.shape), "data_offsets": [off, off + b.size]}
        chunks.append(b)
        off += b.size
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hb += b" " * (-len(hb) % 8)  # keep the data section 8-byte aligned
    return struct.pack("<Q", len(hb)) + hb, chunks


def encode_safetensors(
    tensors: Mapping[str, np.ndarray], *, metadata: Mapping[str, str] | None = None
) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (and ``metadata``), built in memory."""
    head, chunks = _encoded(tensors, metadata)
    return head + b"".join(c.tobytes() for c in chunks)


def write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, np.ndarray],
    *,
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file atomically, each tensor's bytes straight from its array (no copy)."""
    head, chunks = _encoded(tensors, metadata)
    with _atomic.atomic_write(path) as f:
        f.write(head)
        for c in chunks:
            f.write(c.data)
