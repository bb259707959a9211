"""PyTorch Distributed Checkpoint (DCP) directories, read in one process.

A DCP directory holds ``.metadata`` (a pickled ``Metadata``: for each flattened state-dict
name, the global size and dtype of a tensor and the chunks it was saved in, or a
"bytes" entry for a non-tensor value) and data files ``__<rank>_<n>.distcp``, in which
every chunk is one ``torch.save`` image at a recorded offset and length.

dmlib reads this without torch: ``.metadata`` goes through dmlib's restricted unpickler
with its own exact table (DCP's record classes become plain dmlib records; no torch
class is constructed, no other name resolves), every chunk's place (file, offset,
length) is checked against the files, the chunks of each tensor must tile it exactly (no
gap, no overlap: checked by a sweep, O(n log n)), their places must be able to hold the
tensor's bytes (a tensor declared at 4 TiB in a small checkpoint is refused before
anything is allocated), and a tensor is reassembled from its chunks only when it is
loaded. Chunks are ``torch.save`` images, read by :mod:`dmlib.io.torch_zip` (torch's own
``torch.load(weights_only=True)`` only for a construct that reader leaves to it).
Non-tensor values (an ``lr``, a ``step``) that are plain numbers, strings or bools
become ``scalars``.
"""

from __future__ import annotations

import bisect
import io
import math
import os
import warnings
import zipfile
import zlib
from typing import Any

import numpy as np

from dmlib.errors import (
    FormatError,
    MissingDependencyError,
    TruncatedError,
    UnsafePickleError,
    UnsupportedError,
)
from dmlib.io import _unpickle, torch_zip
from dmlib.io._checks import shape_problem, short_repr
from dmlib.io._unpickle import BASE_TABLE, Func
from dmlib.tensor import Tensor, TensorSet

METADATA = ".metadata"


class _Meta(_unpickle.Record):
    """One of DCP's metadata records, as plain attributes (``qualname`` is DCP's class)."""


def _record(module: str, name: str, fields: tuple[str, ...] = ()) -> type[_Meta]:
    return type(name, (_Meta,), {"qualname": f"{module}.{name}", "fields": fields})


_MD = "torch.distributed.checkpoint.metadata"
_RECORDS = {
    (_MD, n): _record(_MD, n, f)
    for n, f in (
        ("Metadata", ()),
        ("TensorStorageMetadata", ()),
        ("BytesStorageMetadata", ()),
        ("ChunkStorageMetadata", ()),
        ("TensorProperties", ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")),
        ("MetadataIndex", ()),
        ("StorageMeta", ()),
    )
}
_RECORDS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _record(
    "torch.distributed.checkpoint.filesystem", "_StorageInfo"
)


def _mem_format(code: Any) -> int:
    if type(code) is not int:
        raise UnsafePickleError("_MEM_FORMAT_ENCODING of something other than a number")
    return code


def _layout(name: Any) -> str:
    if type(name) is not str or len(name) > 40:
        raise UnsafePickleError("torch.serialization._get_layout of something other than a name")
    return name


def _path(*parts: Any) -> str:
    if not all(type(p) is str for p in parts):
        raise UnsafePickleError("a pathlib path of something other than strings")
    return "/".join(parts)


# (module, name) -> what .metadata may name: DCP's records, torch's constants, plain builtins
_TABLE: dict[tuple[str, str], Any] = {
    **BASE_TABLE,
    **_RECORDS,
    (_MD, "_MEM_FORMAT_ENCODING"): Func(f"{_MD}._MEM_FORMAT_ENCODING", _mem_format),
    ("torch.serialization", "_get_layout"): Func("torch.serialization._get_layout", _layout),
    ("torch", "Size"): torch_zip.TABLE[("torch", "Size")],
    **{k: v for k, v in torch_zip.TABLE.items() if isinstance(v, torch_zip.dtype)},
    **{("pathlib", n): Func(f"pathlib.{n}", _path)
       for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path")},
}  # fmt: skip


def can_open(path: str) -> bool:
    """A directory holding ``.metadata`` (or that file itself)."""
    if os.path.basename(path) == METADATA and os.path.isfile(path):
        return True
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


def locate(path: str) -> str:
    """``path`` when it is a DCP checkpoint (:func:`can_open`), else a FormatError naming it."""
    if not can_open(path):
        raise FormatError(f"not a DCP checkpoint directory (no {METADATA} in it)", path=path)
    return path


def _read_metadata(mpath: str) -> Any:
    try:
        with open(mpath, "rb") as f:
            data = f.read()
    except OSError as err:
        raise FormatError(f"cannot read {METADATA} ({err.strerror or err})", path=mpath) from None
    md = _unpickle.load(data, _TABLE, what=METADATA, path=mpath)
    if not isinstance(md, _RECORDS[(_MD, "Metadata")]) or not isinstance(
        getattr(md, "state_dict_metadata", None), dict
    ):
        raise FormatError(
            f"{METADATA} does not hold a checkpoint Metadata ({_unpickle._what(md)})", path=mpath
        )
    if not isinstance(getattr(md, "storage_data", None), dict):
        raise FormatError(
            f"{METADATA} has no storage map (saved without its storage layer?)", path=mpath
        )
    return md


def _numpy_dtype(tdtype: Any, name: str, path: str) -> np.dtype:
    if not isinstance(tdtype, torch_zip.dtype):
        raise FormatError(
            f"tensor {name!r}: dtype {_unpickle._what(tdtype)} is not a torch dtype", path=path
        )
    dname = tdtype.value
    base = torch_zip.numpy_dtype(dname)
    if base is None or dname in ("complex32", "float4_e2m1fn_x2"):
        raise UnsupportedError(
            f"tensor {name!r}: dtype {tdtype.qualname} is not supported in DCP checkpoints",
            path=path,
        )
    return base


Box = tuple[tuple[int, ...], tuple[int, ...]]


def _boxes_tile(size: tuple[int, ...], chunks: list[Box]) -> str | None:
    """Why the chunks do not tile a tensor of ``size`` exactly (None when they do).

    Every chunk inside the tensor and their volumes adding up to its volume leave one
    way to fail: two chunks overlap. That is found by a sweep, O(n log n), in one or two
    dimensions; in more, by counting chunks per cell of the grid their edges draw (any
    grid-like sharding), or by the sweep with a bounded number of comparisons.
    """
    for off, sz in chunks:
        if len(off) != len(size) or len(sz) != len(size):
            return f"a chunk at {list(off)} of {list(sz)} has another rank than the tensor {list(size)}"
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, sz, size)):
            return f"chunk at {list(off)} of {list(sz)} lies outside the tensor {list(size)}"
    total = sum(math.prod(sz) for _, sz in chunks)
    if total != math.prod(size):
        return f"chunks hold {total} elements, the tensor {list(size)} has {math.prod(size)}"
    boxes = [(o, s) for o, s in chunks if math.prod(s)]
    if len(size) == 0:
        return None if len(boxes) == 1 else "a scalar saved in more than one chunk"
    return _overlap(boxes) if len(size) <= 2 else _overlap_grid(size, boxes)


MAX_COMPARISONS = 5_000_000  # box pairs compared in 3+ dimensions before giving up


def _overlap(boxes: list[Box]) -> str | None:
    """Which two boxes overlap, or None: a sweep along the first dimension."""
    budget = MAX_COMPARISONS
    # events: (coordinate, 0 = a box ends, 1 = a box starts, index); ends first (half-open)
    events = sorted(
        [(o[0] + s[0], 0, i) for i, (o, s) in enumerate(boxes)]
        + [(o[0], 1, i) for i, (o, s) in enumerate(boxes)]
    )
    starts: list[tuple[int, int]] = []  # active boxes by (start, index) in the second dimension
    for _, kind, i in events:
        o, s = boxes[i]
        lo, hi = (o[1], o[1] + s[1]) if len(o) > 1 else (0, 1)
        key = (lo, i)
        if kind == 0:
            del starts[bisect.bisect_left(starts, key)]
            continue
        at = bisect.bisect_left(starts, key)
        if len(o) <= 2:  # active boxes are disjoint in the second dimension: check neighbours
            for j in (at - 1, at):
                if 0 <= j < len(starts):
                    b = boxes[starts[j][1]]
                    blo, bhi = (b[0][1], b[0][1] + b[1][1]) if len(o) > 1 else (0, 1)
                    if blo < hi and lo < bhi:
                        return f"chunks at {list(b[0])} and {list(o)} overlap"
        else:  # in more dimensions, every active box whose second range meets this one
            near = starts[: bisect.bisect_left(starts, (hi, -1))]
            budget -= len(near)
            if budget < 0:
                return (
                    f"its {len(boxes)} chunks could not be checked for overlaps within "
                    f"{MAX_COMPARISONS} comparisons (not compared)"
                )
            for _, j in near:
                b = boxes[j]
                if all(a < bb + m and bb < a + n for a, n, bb, m in zip(o, s, b[0], b[1])):
                    return f"chunks at {list(b[0])} and {list(o)} overlap"
        starts.insert(at, key)
    return None


MAX_CELLS = 4_000_000  # cells of the grid the chunks' edges draw, painted in 3+ dimensions


def _overlap_grid(size: tuple[int, ...], boxes: list[Box]) -> str | None:
    """Which two boxes overlap, counted on the grid of their edges (or the bounded sweep)."""
    edges = [sorted({0, d, *(o[k] for o, _ in boxes), *(o[k] + s[k] for o, s in boxes)})
             for k, d in enumerate(size)]  # fmt: skip
    if math.prod(len(e) - 1 for e in edges) > MAX_CELLS:
        return _overlap(boxes)
    count = np.zeros([len(e) - 1 for e in edges], np.int32)
    painted = 0
    spans = []
    for o, s in boxes:
        span = tuple(
            slice(bisect.bisect_left(e, a), bisect.bisect_left(e, a + n))
            for e, a, n in zip(edges, o, s)
        )
        painted += math.prod(sl.stop - sl.start for sl in span)
        if painted > 4 * MAX_CELLS:
            return _overlap(boxes)
        count[span] += 1
        spans.append(span)
    if count.max(initial=0) <= 1:
        return None
    cell = np.unravel_index(int(np.argmax(count)), count.shape)
    two = [boxes[i][0] for i, sp in enumerate(spans)
           if all(sl.start <= c < sl.stop for sl, c in zip(sp, cell))][:2]  # fmt: skip
    return f"chunks at {list(two[0])} and {list(two[1])} overlap"


def _load_image(image: bytes, what: str, path: str) -> Any:
    """The value a ``torch.save`` image holds: dmlib's reader, torch's for what it leaves."""
    try:
        return torch_zip.read_zip(image, path, what)
    except _unpickle.NeedsTorch:
        with zipfile.ZipFile(io.BytesIO(image)) as z:  # read_zip listed it: it opens
            pkl = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            with z.open(pkl[0]) as f:
                _unpickle.vet_globals(
                    f, torch_zip.TABLE, torch_zip.TORCH_ONLY, what=f"{what}: data.pkl", path=path
                )
    except FormatError as err:  # the same class, the chunk named
        text = err.message.removeprefix(f"{what}: ").removeprefix(f"{what} ")
        raise type(err)(f"{what} is not a loadable torch.save image ({text})", path=path) from None
    try:
        import torch
    except ImportError:
        raise MissingDependencyError(
            f"{what} needs torch: pip install 'dmlib[torch]'", path=path
        ) from None
    try:
        with zipfile.ZipFile(io.BytesIO(image)) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, zlib.error, EOFError, ValueError, NotImplementedError, OSError):
        bad = "(the archive itself)"
    if bad is not None:
        raise FormatError(
            f"{what} is not a loadable torch.save image (damaged member {bad})", path=path
        )
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings(
                "ignore", message=".*TypedStorage is deprecated", category=UserWarning
            )
            return torch.load(io.BytesIO(image), map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises many types for damaged images
        raise FormatError(
            f"{what} is not a loadable torch.save image ({type(err).__name__})", path=path
        ) from None


def _int_tuple(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        if all(type(v) is int for v in value):
            return tuple(value)
    return None


def _where(path: str, sizes: dict[str, int], fqn: str, info: Any) -> tuple[str, int, int]:
    """The (data file, offset, length) of one stored item, checked against the files."""
    rel = getattr(info, "relative_path", None)
    off, length = getattr(info, "offset", None), getattr(info, "length", None)
    if not isinstance(rel, str) or os.path.basename(rel) != rel or not rel or rel in (".", ".."):
        raise FormatError(
            f"tensor {fqn!r}: data file {short_repr(rel)} is not a file name in the checkpoint",
            path=path,
        )
    if getattr(info, "transform_descriptors", None):
        raise UnsupportedError(f"tensor {fqn!r}: stored with transforms", path=path)
    if rel not in sizes:
        fpath = os.path.join(path, rel)
        if not os.path.isfile(fpath):
            raise FormatError(f"tensor {fqn!r}: data file {rel!r} does not exist", path=path)
        sizes[rel] = os.path.getsize(fpath)
    if not (type(off) is int and type(length) is int and 0 <= off and 0 < length):
        raise FormatError(
            f"tensor {fqn!r}: bad place offset={short_repr(off)} length={short_repr(length)}",
            path=path,
        )
    if off + length > sizes[rel]:
        raise TruncatedError(
            f"tensor {fqn!r}: bytes [{off}, {off + length}) run past the end of {rel} ({sizes[rel]} bytes)",
            path=path,
        )
    return rel, off, length


class _Blobs:
    """Chunks of the data files: memory-mapped once per file, read as ``torch.save`` images."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._maps: dict[str, np.ndarray] = {}

    def load(self, fqn: str, rel: str, off: int, length: int) -> Any:
        if rel not in self._maps:
            self._maps[rel] = np.memmap(os.path.join(self.path, rel), dtype=np.uint8, mode="r")
        image = bytes(self._maps[rel][off : off + length])
        return _load_image(image, f"tensor {fqn!r}: chunk in {rel} at {off}", self.path)


def open_dcp(path: str | os.PathLike[str]) -> TensorSet:
    """Open a DCP directory as a lazy TensorSet (tensors reassembled on ``load()``)."""
    path = os.fspath(path)
    if os.path.basename(path) == METADATA:
        path = os.path.dirname(path) or "."
    md = _read_metadata(os.path.join(path, METADATA))
    sizes: dict[str, int] = {}
    blobs = _Blobs(path)
    # storage places by (fqn, chunk offsets)
    places: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for key, info in md.storage_data.items():
        fqn = getattr(key, "fqn", None)
        if not isinstance(fqn, str):
            raise FormatError(f"storage entry {_unpickle._what(key)} has no name", path=path)
        offset = getattr(key, "offset", None)
        where = None if offset is None else _int_tuple(offset)
        if offset is not None and where is None:
            raise FormatError(f"storage entry {fqn!r} has a malformed offset", path=path)
        places[(fqn, where)] = _where(path, sizes, fqn, info)

    tensors: dict[str, Tensor] = {}
    scalars: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    multi: dict[str, int] = {}
    for fqn, meta in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise FormatError(f"an entry named by a {type(fqn).__name__}", path=path)
        kind = getattr(meta, "qualname", "").rpartition(".")[2]
        if kind == "BytesStorageMetadata":
            place = places.get((fqn, None))
            if place is None:
                raise FormatError(f"value {fqn!r} has no stored bytes", path=path)
            value = blobs.load(fqn, *place)
            if isinstance(value, (bool, int, float, str)) or value is None:
                scalars[fqn] = value
            else:
                skipped[fqn] = type(value).__name__
            continue
        if kind != "TensorStorageMetadata":
            raise FormatError(
                f"entry {fqn!r} is a {_unpickle._what(meta)}, not tensor or bytes metadata",
                path=path,
            )
        tensors[fqn] = _tensor_of(fqn, meta, places, blobs, path, multi)
    layout: dict[str, Any] = {"files": sorted(sizes), "reader": "dmlib (torch not imported)"}
    if multi:
        layout["sharded"] = multi
    if skipped:  # named, never silently dropped
        layout["skipped_values"] = skipped
    version = getattr(md, "version", None)
    meta_out = {"dcp_version": str(version)} if isinstance(version, (str, int)) and version else {}
    return TensorSet(
        tensors, path=path, format="dcp", metadata=meta_out, scalars=scalars, layout=layout
    )


def _tensor_of(
    fqn: str, meta: Any, places: dict, blobs: _Blobs, path: str, multi: dict[str, int]
) -> Tensor:
    """One tensor's metadata checked (size, dtype, tiling, places) into a lazy Tensor."""
    size = _int_tuple(getattr(meta, "size", None))
    props = getattr(meta, "properties", None)
    dtype = _numpy_dtype(getattr(props, "dtype", None), fqn, path)
    if size is None or shape_problem(list(size), dtype.itemsize):
        why = "malformed" if size is None else shape_problem(list(size), dtype.itemsize)
        raise FormatError(f"tensor {fqn!r}: size {why}", path=path)
    raw_chunks = getattr(meta, "chunks", None)
    if not isinstance(raw_chunks, list):
        raise FormatError(f"tensor {fqn!r}: chunks are not a list", path=path)
    chunks: list[Box] = []
    for c in raw_chunks:
        off, sz = _int_tuple(getattr(c, "offsets", None)), _int_tuple(getattr(c, "sizes", None))
        if off is None or sz is None:
            raise FormatError(f"tensor {fqn!r}: a chunk with malformed offsets or sizes", path=path)
        chunks.append((off, sz))
    problem = _boxes_tile(size, chunks)
    if problem is not None:
        raise FormatError(f"tensor {fqn!r}: {problem}", path=path)
    located = []
    for off, sz in chunks:
        place = places.get((fqn, off))
        if place is None:
            raise FormatError(
                f"tensor {fqn!r}: chunk at {list(off)} has no stored bytes", path=path
            )
        if math.prod(sz) * dtype.itemsize > place[2]:
            raise FormatError(
                f"tensor {fqn!r}: chunk at {list(off)} of {list(sz)} needs "
                f"{math.prod(sz) * dtype.itemsize} bytes, its place holds {place[2]}",
                path=path,
            )
        located.append((off, sz, place))
    if len(chunks) > 1:
        multi[fqn] = len(chunks)
    dname = props.dtype.value  # type: ignore[union-attr]  # _numpy_dtype checked it
    return Tensor(
        fqn, dtype, size, nbytes=math.prod(size) * dtype.itemsize, path=path, dtype_name=dname,
        source=_assembler(fqn, size, dtype, located, blobs, path),
    )  # fmt: skip


def _assembler(
    fqn: str, size: tuple[int, ...], dtype: np.dtype, located: list, blobs: _Blobs, path: str
) -> Any:
    """A callable giving the tensor's bytes, its chunks read and put in place."""

    def assemble() -> np.ndarray:
        from dmlib.io import _torch_parts

        try:
            full = np.empty(size, dtype)
        except MemoryError:
            raise FormatError(
                f"tensor {fqn!r}: {math.prod(size) * dtype.itemsize} bytes do not fit in memory",
                path=path,
            ) from None
        for off, sz, place in located:
            chunk = blobs.load(fqn, *place)
            if isinstance(chunk, torch_zip.StoredTensor):
                if chunk.shape != sz:
                    raise FormatError(
                        f"tensor {fqn!r}: chunk at {list(off)} holds {chunk.shape}, metadata says {list(sz)}",
                        path=path,
                    )
                arr = _torch_parts.stored_entries(fqn, chunk, path)[fqn].load()
            elif type(chunk).__name__ in ("Tensor", "Parameter") and hasattr(chunk, "numpy"):
                if tuple(chunk.shape) != sz:
                    raise FormatError(
                        f"tensor {fqn!r}: chunk at {list(off)} holds {tuple(chunk.shape)}, metadata says {list(sz)}",
                        path=path,
                    )
                arr = _torch_parts._dense(fqn, chunk, path).load()
            else:
                raise FormatError(
                    f"tensor {fqn!r}: chunk at {list(off)} holds a {type(chunk).__name__}, not a tensor",
                    path=path,
                )
            if arr.dtype != dtype:
                raise FormatError(
                    f"tensor {fqn!r}: chunk at {list(off)} is {arr.dtype}, metadata says {dtype}",
                    path=path,
                )
            full[tuple(slice(o, o + s) for o, s in zip(off, sz))] = arr
        return full.reshape(-1).view(np.uint8)

    return assemble
