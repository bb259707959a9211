"""flax's msgpack checkpoints (``flax.serialization.to_bytes``), read with msgpack.

flax serialises a state dict (nested maps of string keys) as MessagePack, with arrays as
extension types whose payload is itself MessagePack: ``(shape, dtype name, raw bytes)``
(ext 1: an ndarray; ext 3: a numpy scalar; ext 2: a Python complex as ``(re, im)``).
Arrays larger than flax's chunk limit are written as maps marked
``__msgpack_chunked_array__`` holding the shape and the flattened pieces. Plain numbers,
strings and booleans are leaves too; they become ``scalars``.

Names are the key paths joined with ``.``; the recorded step (``scalars['step']``) is a
0-d ``step`` leaf, else an optax ``count``, as for Orbax. The file is decoded whole when
opened (msgpack has no index); nothing in it is executed: only the three extension codes
above are accepted, and each payload is checked (shape, dtype, byte length).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np

from dmlib import _limits
from dmlib.errors import FormatError, MissingDependencyError, UnsupportedError
from dmlib.io._checks import shape_problem, short_repr
from dmlib.safepaths import read_regular
from dmlib.tensor import ArrayTensorSet, TensorSet
from dmlib.textsafe import shown

__all__ = ["can_open", "open_flax_msgpack"]

_MAPS = (b"\xde", b"\xdf") + tuple(bytes([b]) for b in range(0x80, 0x90))
# ext 1 or 3 whose payload is a 3-element array: flax's encoding of an array
_ARRAY_EXT = re.compile(rb"(?:\xc7.|\xc8..|\xc9....|[\xd4-\xd8])[\x01\x03]\x93", re.DOTALL)


class _Ext:
    __slots__ = ("code", "data")

    def __init__(self, code: int, data: bytes) -> None:
        self.code = code
        self.data = data


class _Counted:
    """msgpack hooks counting the maps and arrays decoded and their items, refusing past
    what one file may flatten to (:func:`dmlib._limits.max_entries` entries and
    :func:`dmlib._limits.max_containers` containers) while msgpack is still decoding: a
    small file of empty arrays would otherwise be tens of times its size in memory first.

    Not :class:`dmlib._limits.Flattening`, which bounds the walk over the finished tree
    (named leaves, the characters of their names, containers): this counts while msgpack is
    still building that tree, where no name exists yet and a child is not yet known to be a
    leaf or a container, so it bounds children of either kind (entries plus containers)
    and containers. The walk then counts the same maps and arrays again against
    :func:`dmlib._limits.max_containers`; one counter shared by both would count each
    container twice and halve the limit."""

    __slots__ = ("path", "items", "containers", "bounds")

    def __init__(self, path: str) -> None:
        self.path, self.items, self.containers = path, 0, 0
        self.bounds = (_limits.max_entries() + _limits.max_containers(), _limits.max_containers())

    def _count(self, n: int) -> None:
        self.items += n
        self.containers += 1
        if self.items > self.bounds[0] or self.containers > self.bounds[1]:
            raise FormatError(
                f"refused: more than {self.bounds[1]:,} maps and arrays or {self.bounds[0]:,} "
                "items, more than one file may hold on this machine (set DMLIB_MAX_ENTRIES "
                "to read a file you trust)",
                path=self.path,
            )

    def map(self, d: dict[Any, Any]) -> dict[Any, Any]:
        self._count(len(d))
        return d

    def list(self, items: list[Any]) -> list[Any]:
        self._count(len(items))
        return items


def can_open(head: bytes, path: str) -> bool:
    """A MessagePack map, named ``.msgpack`` or holding flax's array extension early on."""
    if head[:1] not in _MAPS:
        return False
    return path.lower().endswith(".msgpack") or _ARRAY_EXT.search(head) is not None


def _dtype(name: Any, where: str, path: str) -> np.dtype:
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise FormatError(f"{where}: dtype {short_repr(name)} is not a dtype name", path=path)
    try:
        import ml_dtypes

        if hasattr(ml_dtypes, name) and name not in ("finfo", "iinfo"):
            dt = np.dtype(getattr(ml_dtypes, name))
        else:
            dt = np.dtype(name)
    except TypeError:
        raise UnsupportedError(f"{where}: dtype {name!r} is not supported", path=path) from None
    # numbers only: no object, string or structured dtypes
    if dt.kind not in "biufc" and not dt.type.__module__.startswith("ml_dtypes"):
        raise UnsupportedError(f"{where}: dtype {name!r} is not a numeric dtype", path=path)
    return dt


def _array(ext: _Ext, where: str, path: str) -> Any:
    import msgpack

    try:
        payload = msgpack.unpackb(ext.data, raw=False, strict_map_key=False)
    except Exception as err:  # msgpack raises several types for damaged data
        raise FormatError(
            f"{where}: damaged array payload ({type(err).__name__})", path=path
        ) from None
    if ext.code == 2:
        if not (
            isinstance(payload, (list, tuple))
            and len(payload) == 2
            and all(type(x) in (int, float) for x in payload)
        ):
            raise FormatError(f"{shown(where)}: complex payload is not (re, im)", path=path)
        try:
            return complex(float(payload[0]), float(payload[1]))
        except OverflowError:  # an int past the float range
            raise FormatError(f"{shown(where)}: complex payload out of range", path=path) from None
    if not (
        isinstance(payload, (list, tuple)) and len(payload) == 3 and isinstance(payload[2], bytes)
    ):
        raise FormatError(f"{where}: array payload is not (shape, dtype, bytes)", path=path)
    shape, dname, raw = payload
    dtype = _dtype(dname, where, path)
    problem = shape_problem(
        list(shape) if isinstance(shape, (list, tuple)) else shape, dtype.itemsize
    )
    if problem:
        raise FormatError(f"{where}: {problem}", path=path)
    want = math.prod(shape) * dtype.itemsize
    if len(raw) != want:
        raise FormatError(
            f"{where}: {len(raw)} bytes for shape {list(shape)} {dtype.name} ({want})", path=path
        )
    return np.frombuffer(raw, dtype).reshape(tuple(shape))


def _chunked(node: dict[str, Any], where: str, path: str) -> np.ndarray:
    shape_d, chunks_d = node.get("shape"), node.get("chunks")
    if not isinstance(shape_d, dict) or not isinstance(chunks_d, dict):
        raise FormatError(f"{where}: chunked array without shape and chunks maps", path=path)
    shape = tuple(shape_d.get(str(i)) for i in range(len(shape_d)))
    pieces = [chunks_d.get(str(i)) for i in range(len(chunks_d))]
    arrays = [p for p in pieces if isinstance(p, np.ndarray)]
    if len(arrays) != len(pieces) or not pieces:
        raise FormatError(f"{where}: chunked array pieces are not arrays", path=path)
    if len({p.dtype for p in arrays}) != 1:  # concatenate would convert them silently
        raise FormatError(f"{shown(where)}: chunked array pieces of different dtypes", path=path)
    flat = np.concatenate([p.reshape(-1) for p in arrays])
    problem = shape_problem(list(shape), flat.dtype.itemsize)
    if problem or math.prod(shape) != flat.size:  # type: ignore[arg-type]
        raise FormatError(
            f"{where}: chunks hold {flat.size} values, shape {list(shape)}", path=path
        )
    return flat.reshape(shape)  # type: ignore[arg-type]


def _flatten(
    node: Any,
    prefix: str | None,
    out: tuple[dict[str, np.ndarray], dict[str, Any]],
    budget: _limits.Flattening,
    path: str,
    depth: int = 0,
) -> None:
    """Arrays into ``out[0]``, plain values into ``out[1]``, under their key paths joined
    with ``.`` (``prefix`` None at the top). Names, entries and maps are counted by
    ``budget`` (a name longer than a few KB is refused before it is made); two entries
    that flatten to one name are refused, never one hiding the other."""
    where = prefix or "root"
    if depth > _limits.MAX_NESTING:
        raise FormatError(f"{shown(where)}: nested deeper than {_limits.MAX_NESTING}", path=path)
    if isinstance(node, _Ext):
        if node.code not in (1, 2, 3):
            raise UnsupportedError(
                f"{shown(where)}: msgpack extension type {node.code} (flax uses 1-3)", path=path
            )
        node = _array(node, where, path)
    if isinstance(node, dict) and node.get("__msgpack_chunked_array__") is not True:
        budget.container()
        for k, v in node.items():
            if not isinstance(k, (str, int)):
                raise FormatError(
                    f"{shown(where)}: map key {short_repr(k)} is not a string", path=path
                )
            _flatten(v, budget.name(prefix, k), out, budget, path, depth + 1)
        return
    if isinstance(node, (list, tuple)):
        budget.container()
        for i, v in enumerate(node):
            _flatten(v, budget.name(prefix, i), out, budget, path, depth + 1)
        return
    name = prefix or ""
    budget.leaf(name)
    if name in out[0] or name in out[1]:
        raise UnsupportedError(
            f"two entries flatten to the name {short_repr(name, 200)}; dmlib names entries by joining "
            "keys with '.', so one would hide the other",
            path=path,
        )
    if isinstance(node, dict):  # a chunked array
        out[0][name] = _chunked(_resolve(node, name, path), name, path)
    elif isinstance(node, np.ndarray):
        out[0][name] = node
    elif node is None or isinstance(node, (bool, int, float, str, complex)):
        out[1][name] = node if not isinstance(node, complex) else str(node)
    else:
        raise FormatError(
            f"{shown(where)}: unexpected value of type {type(node).__name__}", path=path
        )


def _resolve(node: dict[str, Any], where: str, path: str) -> dict[str, Any]:
    """A chunked-array map with its extension-typed pieces decoded."""
    chunks = node.get("chunks")
    if isinstance(chunks, dict):
        chunks = {
            k: _array(v, f"{where}.chunks.{k}", path) if isinstance(v, _Ext) else v
            for k, v in chunks.items()
        }
    return {**node, "chunks": chunks}


def open_flax_msgpack(path: str | os.PathLike[str]) -> TensorSet:
    """Open a ``flax.serialization.to_bytes`` file as a TensorSet (decoded when opened)."""
    path = os.fspath(path)
    try:
        import msgpack
    except ImportError:
        raise MissingDependencyError(
            "reading flax msgpack files needs msgpack: pip install 'dmlib[formats]'", path=path
        ) from None
    # decoded whole: a file larger than one piece may take is refused before it is read
    data = read_regular(
        os.path.realpath(path), where=path, error=FormatError, limit=_limits.max_decompressed(),
        kind="a msgpack file", hint=f"it is decoded whole in memory: {_limits.limit_hint()}",
    )  # fmt: skip
    try:
        counted = _Counted(path)
        tree = msgpack.unpackb(
            data, raw=False, strict_map_key=False, ext_hook=_Ext, use_list=True,
            object_hook=counted.map, list_hook=counted.list,
        )  # fmt: skip
    except FormatError:
        raise
    except Exception as err:  # ExtraData, ValueError, UnpackValueError, ...
        raise FormatError(
            f"not a valid msgpack file ({type(err).__name__}: {short_repr(str(err), 120)})",
            path=path,
        ) from None
    if not isinstance(tree, dict):
        raise FormatError(
            f"top level is {type(tree).__name__}, not a map (a flax state dict)", path=path
        )
    arrays: dict[str, np.ndarray] = {}
    scalars: dict[str, Any] = {}
    _flatten(tree, None, (arrays, scalars), _limits.Flattening(path), path)
    ts = ArrayTensorSet(arrays, path=path, format="flax-msgpack", scalars=scalars)
    from dmlib.io.orbax import recorded_step

    step, where = recorded_step(ts)
    if step is None and isinstance(scalars.get("step"), int):
        step, where = scalars["step"], "scalar 'step'"
    if step is not None:
        ts.scalars["step"] = step
        ts.layout["step_from"] = where
    ts.layout["layout"] = "flax-msgpack"
    return ts
