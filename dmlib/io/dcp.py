"""PyTorch Distributed Checkpoint (DCP) directories, read in one process.

A DCP directory holds ``.metadata`` (a pickled ``Metadata``: for each flattened state-dict
name, the global size and dtype of a tensor and the chunks it was saved in, or a
"bytes" entry for a non-tensor value) and data files ``__<rank>_<n>.distcp``, in which
every chunk is one ``torch.save`` image at a recorded offset and length.

dmlib reads this without torch.distributed and without a process group: ``.metadata`` is
unpickled with an allow-list of DCP's own metadata classes (nothing else is
constructed), every chunk's place (file, offset, length) is checked against the files,
the chunks of each tensor must tile it exactly (no gap, no overlap), and a tensor is
reassembled from its chunks only when it is loaded. Chunks are read with
``torch.load(weights_only=True)``. Non-tensor values (an ``lr``, a ``step``) that are
plain numbers, strings or bools become ``scalars``.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import warnings
import zipfile
import zlib
from typing import Any

import numpy as np

from dmlib.errors import FormatError, MissingDependencyError, TruncatedError, UnsupportedError
from dmlib.io._checks import short_repr
from dmlib.tensor import Tensor, TensorSet

METADATA = ".metadata"

# (module, name) pairs .metadata may name; each is DCP's own plain record type or a torch
# constant. Anything else is refused before it is constructed.
_ALLOWED_MODULES = {
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
}
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def can_open(path: str) -> bool:
    """A directory holding ``.metadata`` (or that file itself)."""
    if os.path.basename(path) == METADATA and os.path.isfile(path):
        return True
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, METADATA))


class _Unpickler(pickle.Unpickler):
    def __init__(self, f: Any, path: str) -> None:
        super().__init__(f)
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise FormatError(
            f"{METADATA} names {module}.{name}, which is not part of a checkpoint's metadata; refusing to unpickle it",
            path=self._path,
        )


def _read_metadata(mpath: str) -> Any:
    from torch.distributed.checkpoint import metadata as dmeta  # noqa: F401  (the allowed classes)

    try:
        with open(mpath, "rb") as f:
            md = _Unpickler(f, mpath).load()
    except FormatError:
        raise
    except Exception as err:  # a damaged pickle raises any of a dozen types
        raise FormatError(
            f"unreadable {METADATA} ({type(err).__name__}: {short_repr(str(err), 200)})", path=mpath
        ) from None
    if not isinstance(md, dmeta.Metadata) or not isinstance(md.state_dict_metadata, dict):
        raise FormatError(
            f"{METADATA} does not hold a checkpoint Metadata ({type(md).__name__})", path=mpath
        )
    if not isinstance(md.storage_data, dict):
        raise FormatError(
            f"{METADATA} has no storage map (saved without its storage layer?)", path=mpath
        )
    return md


def _numpy_dtype(tdtype: Any, name: str, path: str) -> np.dtype:
    import torch

    from dmlib.io._torch_parts import _dense

    if not isinstance(tdtype, torch.dtype):
        raise FormatError(
            f"tensor {name!r}: dtype {short_repr(tdtype)} is not a torch dtype", path=path
        )
    probe = _dense(name, torch.empty(2, dtype=tdtype), path)
    if probe.packing is not None or probe.opaque:
        raise UnsupportedError(
            f"tensor {name!r}: dtype {tdtype} is not supported in DCP checkpoints", path=path
        )
    return probe.dtype


def _boxes_tile(
    size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> str | None:
    """Why the chunks do not tile a tensor of ``size`` exactly (None when they do)."""
    for off, sz in chunks:
        if len(off) != len(size) or len(sz) != len(size):
            return f"a chunk at {list(off)} of {list(sz)} has another rank than the tensor {list(size)}"
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, sz, size)):
            return f"chunk at {list(off)} of {list(sz)} lies outside the tensor {list(size)}"
    total = sum(math.prod(sz) for _, sz in chunks)
    if total != math.prod(size):
        return f"chunks hold {total} elements, the tensor {list(size)} has {math.prod(size)}"
    nonempty = [(o, s) for o, s in chunks if math.prod(s)]
    for i, (oa, sa) in enumerate(nonempty):
        for ob, sb in nonempty[i + 1 :]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(oa, sa, ob, sb)):
                return f"chunks at {list(oa)} and {list(ob)} overlap"
    return None


def open_dcp(path: str | os.PathLike[str]) -> TensorSet:
    """Open a DCP directory as a lazy TensorSet (tensors reassembled on ``load()``)."""
    path = os.fspath(path)
    if os.path.basename(path) == METADATA:
        path = os.path.dirname(path) or "."
    try:
        import torch  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "reading DCP checkpoints needs torch: pip install 'dmlib[torch]'", path=path
        ) from None
    md = _read_metadata(os.path.join(path, METADATA))
    from torch.distributed.checkpoint import metadata as dmeta

    sizes: dict[str, int] = {}
    maps: dict[str, np.ndarray] = {}

    def where(fqn: str, info: Any) -> tuple[str, int, int]:
        rel = getattr(info, "relative_path", None)
        off, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not isinstance(rel, str) or os.path.basename(rel) != rel or not rel:
            raise FormatError(
                f"tensor {fqn!r}: data file {short_repr(rel)} is not a file name in the checkpoint",
                path=path,
            )
        if getattr(info, "transform_descriptors", None):
            raise UnsupportedError(
                f"tensor {fqn!r}: stored with transforms {info.transform_descriptors}", path=path
            )
        if rel not in sizes:
            fpath = os.path.join(path, rel)
            if not os.path.isfile(fpath):
                raise FormatError(f"tensor {fqn!r}: data file {rel!r} does not exist", path=path)
            sizes[rel] = os.path.getsize(fpath)
        if not (isinstance(off, int) and isinstance(length, int) and 0 <= off and 0 < length):
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

    def blob(rel: str, off: int, length: int) -> bytes:
        if rel not in maps:
            maps[rel] = np.memmap(os.path.join(path, rel), dtype=np.uint8, mode="r")
        return bytes(maps[rel][off : off + length])

    def load_obj(fqn: str, rel: str, off: int, length: int) -> Any:
        import torch

        image = io.BytesIO(blob(rel, off, length))
        # torch.load checks no CRC: a damaged byte would give a silently wrong value
        try:
            with zipfile.ZipFile(image) as z:
                bad = z.testzip()
        except (
            zipfile.BadZipFile,
            zlib.error,
            EOFError,
            ValueError,
            NotImplementedError,
            RuntimeError,
            OSError,
        ):
            bad = "(the archive itself)"
        if bad is not None:
            raise FormatError(
                f"tensor {fqn!r}: chunk in {rel} at {off} is not a loadable torch.save image (damaged member {bad})",
                path=path,
            )
        image.seek(0)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message=".*TypedStorage is deprecated", category=UserWarning
                )
                return torch.load(image, map_location="cpu", weights_only=True)
        except Exception as err:  # torch raises many types for damaged images
            raise FormatError(
                f"tensor {fqn!r}: chunk in {rel} at {off} is not a loadable torch.save image ({type(err).__name__})",
                path=path,
            ) from None

    # storage places by (fqn, chunk offsets)
    places: dict[tuple[str, tuple[int, ...] | None], tuple[str, int, int]] = {}
    for key, info in md.storage_data.items():
        fqn = getattr(key, "fqn", None)
        if not isinstance(fqn, str):
            raise FormatError(f"storage entry {short_repr(key)} has no name", path=path)
        offset = getattr(key, "offset", None)
        places[(fqn, None if offset is None else tuple(int(o) for o in offset))] = where(fqn, info)

    tensors: dict[str, Tensor] = {}
    scalars: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    multi: dict[str, int] = {}
    for fqn, meta in md.state_dict_metadata.items():
        if isinstance(meta, dmeta.BytesStorageMetadata):
            place = places.get((fqn, None))
            if place is None:
                raise FormatError(f"value {fqn!r} has no stored bytes", path=path)
            value = load_obj(fqn, *place)
            if isinstance(value, (bool, int, float, str)) or value is None:
                scalars[fqn] = value
            else:
                skipped[fqn] = type(value).__name__
            continue
        if not isinstance(meta, dmeta.TensorStorageMetadata):
            raise FormatError(
                f"entry {fqn!r} is a {type(meta).__name__}, not tensor or bytes metadata", path=path
            )
        size = tuple(int(s) for s in meta.size)
        dtype = _numpy_dtype(meta.properties.dtype, fqn, path)
        chunks = [
            (tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes)) for c in meta.chunks
        ]
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
            located.append((off, sz, place))
        if len(chunks) > 1:
            multi[fqn] = len(chunks)
        tensors[fqn] = Tensor(
            fqn, dtype, size, nbytes=math.prod(size) * dtype.itemsize, path=path,
            dtype_name=str(meta.properties.dtype).removeprefix("torch."),
            source=_assembler(fqn, size, dtype, located, load_obj, path),
        )  # fmt: skip
    layout: dict[str, Any] = {"files": sorted(sizes)}
    if multi:
        layout["sharded"] = multi
    if skipped:  # named, never silently dropped
        layout["skipped_values"] = skipped
    meta_out = {"dcp_version": str(md.version)} if getattr(md, "version", None) else {}
    return TensorSet(
        tensors, path=path, format="dcp", metadata=meta_out, scalars=scalars, layout=layout
    )


def _assembler(
    fqn: str, size: tuple[int, ...], dtype: np.dtype, located: list, load_obj: Any, path: str
) -> Any:
    """A callable giving the tensor's bytes, its chunks read and put in place."""

    def assemble() -> np.ndarray:
        import torch

        from dmlib.io._torch_parts import _dense

        full = np.empty(size, dtype)
        for off, sz, place in located:
            chunk = load_obj(fqn, *place)
            if not isinstance(chunk, torch.Tensor) or tuple(chunk.shape) != sz:
                got = (
                    tuple(chunk.shape) if isinstance(chunk, torch.Tensor) else type(chunk).__name__
                )
                raise FormatError(
                    f"tensor {fqn!r}: chunk at {list(off)} holds {got}, metadata says {list(sz)}",
                    path=path,
                )
            arr = _dense(fqn, chunk, path).load()
            if arr.dtype != dtype:
                raise FormatError(
                    f"tensor {fqn!r}: chunk at {list(off)} is {arr.dtype}, metadata says {dtype}",
                    path=path,
                )
            full[tuple(slice(o, o + s) for o, s in zip(off, sz))] = arr
        return full.reshape(-1).view(np.uint8)

    return assemble
