"""Orbax checkpoints (JAX): step folders, item folders and CheckpointManager folders.

Orbax (orbax-checkpoint 0.12) writes, per saved step, a folder (``10/``) holding
``_CHECKPOINT_METADATA`` and one folder per item (``default/``). An item folder holds
``_METADATA`` (JSON: the pytree, one entry per leaf with its key path) and the arrays:
by default in an OCDBT database (``manifest.ocdbt``, see :mod:`dmlib.io.ocdbt`) holding
zarr v2 or v3 arrays (:mod:`dmlib.io.zarr_`) under keys ``<leaf path joined by '.'>/...``;
with ``use_ocdbt=False`` one zarr folder per leaf. A CheckpointManager folder holds the
numbered step folders; dmlib reads it as a step ladder (:func:`step_folders`).

Tensor names are the leaf key paths joined with ``.`` (``model.l1.kernel.value``: an
``nnx.State`` leaf ends in ``value``). Arrays are read, chunk by chunk, when loaded; at
open, the B+tree and every array's metadata are read and checked, and every stored chunk
key must belong to its array's chunk grid (the stored keys are checked; the grid itself is
never enumerated). Every file read (``_METADATA``, zarr metadata and chunks, the OCDBT
manifest and data files) must resolve, symlinks followed, inside the folder opened and be
a regular file: a symlink leading out, a FIFO or a device is refused naming it. The
recorded step (``scalars['step']``) is the 0-d ``step`` leaf (flax.nnx
``optimizer.step``), else an optax ``count``, else the number in the step folder's name.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from dmlib import _limits
from dmlib.errors import DmlibError, FormatError, TruncatedError
from dmlib.io._checks import short_repr
from dmlib.safepaths import bounded_json, confined_file, read_regular
from dmlib.tensor import Tensor, TensorSet

__all__ = ["can_open", "kind", "open_orbax", "recorded_step", "step_folders"]

TREE_METADATA = "_METADATA"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
V1_MARKER = "orbax.checkpoint"  # the empty file in every checkpoint of Orbax's V1 API
_ARRAY_TYPES = {"jax.Array", "np.ndarray", "scalar"}
_STEP_DIR = re.compile(r"^(?:.*_)?(\d+)$")
_MAX_JSON = _limits.MAX_TEXT_BYTES  # a _METADATA parsed takes ten to twenty times its size
_MAX_ARRAY_JSON = 1 << 20  # a .zarray or zarr.json is a few hundred bytes


def _is_item(path: str) -> bool:
    if not os.path.isdir(path):
        return False
    if os.path.isfile(os.path.join(path, "manifest.ocdbt")):
        return True
    return os.path.isfile(os.path.join(path, TREE_METADATA))


def _items(path: str) -> list[str]:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return []
    return [n for n in names if _is_item(os.path.join(path, n))]


def _is_step(path: str) -> bool:
    marks = (CHECKPOINT_METADATA, V1_MARKER)
    return any(os.path.isfile(os.path.join(path, m)) for m in marks) or bool(_items(path))


def kind(path: str | os.PathLike[str]) -> str | None:
    """``"item"``, ``"step"``, ``"manager"`` for an Orbax folder of that kind, else None."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        return None
    if _is_item(path):
        return "item"
    if _is_step(path):
        return "step"
    if step_folders(path):
        return "manager"
    return None


def can_open(path: str) -> bool:
    """A step folder or an item folder (a manager folder is a ladder, not one checkpoint)."""
    return kind(path) in ("item", "step")


#: files inside an Orbax folder that stand for the folder itself
FOLDER_FILES = ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "orbax.checkpoint")


#: format detection reads at most this many entries of one folder, and looks into at most
#: :data:`SNIFF_SUBFOLDERS` of its subfolders (a folder of 100,000 entries is not stat'ed
#: entry by entry: Orbax marks its folders with named files, and a step or manager folder
#: holds a few item or step folders)
SNIFF_ENTRIES = 1024
SNIFF_SUBFOLDERS = 16


def _subfolders(path: str, match: Callable[[str], Any]) -> list[str]:
    """Up to :data:`SNIFF_SUBFOLDERS` subfolders of ``path`` whose name ``match``es, from
    its first :data:`SNIFF_ENTRIES` entries (one ``os.scandir``, no stat per entry)."""
    found: list[str] = []
    try:
        with os.scandir(path) as it:
            for n, e in enumerate(it):
                if n >= SNIFF_ENTRIES or len(found) >= SNIFF_SUBFOLDERS:
                    break
                if match(e.name) and e.is_dir():
                    found.append(e.path)
    except OSError:
        return []
    return found


def _has_item_marks(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, m)) for m in ("manifest.ocdbt", TREE_METADATA))


def _sniff_step(path: str) -> bool:
    """:func:`_is_step` for detection: the marker files, else a bounded look for an item."""
    marks = (CHECKPOINT_METADATA, V1_MARKER)
    if any(os.path.isfile(os.path.join(path, m)) for m in marks):
        return True
    return any(map(_has_item_marks, _subfolders(path, bool)))


def _sniff_kind(path: str) -> str | None:
    """:func:`kind` in bounded work: named files, and a few subfolders looked into."""
    if not os.path.isdir(path):
        return None
    if _has_item_marks(path):
        return "item"
    if _sniff_step(path):
        return "step"
    if any(map(_sniff_step, _subfolders(path, _STEP_DIR.match))):
        return "manager"
    return None


def checkpoint_folder(path: str | os.PathLike[str]) -> str | None:
    """The Orbax folder ``path`` is (or names by one of :data:`FOLDER_FILES`), else None.

    Detection's test: bounded work whatever the folder holds (:data:`SNIFF_ENTRIES`).
    """
    path = os.fspath(path)
    if os.path.basename(path) in FOLDER_FILES and os.path.isfile(path):
        path = os.path.dirname(path) or "."
    return path if _sniff_kind(path) is not None else None


def locate(path: str | os.PathLike[str]) -> str:
    """The folder :func:`open_orbax` reads for ``path``, else a FormatError naming it."""
    folder = checkpoint_folder(path)
    if folder is None:
        raise FormatError(
            "not an Orbax checkpoint folder (no _METADATA or manifest.ocdbt)", path=os.fspath(path)
        )
    return folder


def step_folders(path: str | os.PathLike[str]) -> dict[int, str]:
    """A CheckpointManager folder's steps: step number -> step folder (numeric names)."""
    path = os.fspath(path)
    out: dict[int, str] = {}
    try:
        names = os.listdir(path)
    except OSError:
        return out
    for n in names:
        m = _STEP_DIR.match(n)
        full = os.path.join(path, n)
        if m and os.path.isdir(full) and _is_step(full):
            out.setdefault(int(m.group(1)), full)
    return dict(sorted(out.items()))


def _rel(path: str, top: str) -> str:
    return os.path.relpath(path, top).replace(os.sep, "/")


def _json(path: str, folder: str, top: str) -> Any:
    """The JSON file ``path`` (inside ``top``, a regular file, nested at most
    :data:`dmlib._limits.MAX_NESTING` deep), or None when it is not there."""
    found = confined_file(
        os.path.realpath(top), path, what=_rel(path, top), where=top, error=FormatError
    )
    if found is None:
        return None
    name = os.path.basename(path)
    # the bound checked on the file opened (fstat), not on confined_file's earlier look:
    # a larger file renamed over it in between is refused all the same
    raw = read_regular(
        found[0], what=name, where=folder, error=FormatError, limit=_MAX_JSON,
        kind="a JSON metadata file",
    )  # fmt: skip
    try:
        return bounded_json(raw.decode(), where=folder, error=FormatError)
    except UnicodeDecodeError as err:
        raise FormatError(f"{name} is not JSON ({err})", path=folder) from None
    except FormatError as err:  # not JSON, or nested too deeply: say which file
        raise FormatError(f"{name} {str(err).removeprefix(folder + ': ')}", path=folder) from None


def _leaves(md: Any, folder: str) -> tuple[dict[str, str], dict[str, str]]:
    """From ``_METADATA``: (name -> value type) for array leaves, and the skipped others."""
    tree = md.get("tree_metadata") if isinstance(md, dict) else None
    if not isinstance(tree, dict):
        raise FormatError(f"{TREE_METADATA} has no tree_metadata object", path=folder)
    arrays: dict[str, str] = {}
    other: dict[str, str] = {}
    for key, entry in tree.items():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, dict) and "key" in k for k in keys):
            raise FormatError(
                f"{TREE_METADATA}: leaf {short_repr(key)} has no key path", path=folder
            )
        name = ".".join(str(k["key"]) for k in keys)
        if len(name) > _limits.MAX_NAME_CHARS:
            raise FormatError(
                f"{TREE_METADATA}: a leaf name of {len(name):,} characters starting "
                f"{short_repr(name[:60])}, longer than the {_limits.MAX_NAME_CHARS:,} a name "
                "may have",
                path=folder,
            )
        vm = entry.get("value_metadata") or {}
        vtype = str(vm.get("value_type", "?")) if isinstance(vm, dict) else "?"
        if name in arrays or name in other:
            raise FormatError(f"{TREE_METADATA}: two leaves named {name!r}", path=folder)
        if vtype in _ARRAY_TYPES and not (isinstance(vm, dict) and vm.get("skip_deserialize")):
            arrays[name] = vtype
        else:
            other[name] = vtype
    return arrays, other


def _safe_name(name: str, folder: str) -> None:
    parts = name.split("/")
    bad = "\\" in name or "\x00" in name
    if not name or name.startswith("/") or bad or any(p in ("", ".", "..") for p in parts):
        raise FormatError(f"leaf name {name!r} is not a plain relative path", path=folder)


class _DirStore:
    """The no-OCDBT layout: each key ``<leaf>/<rest>`` a file under the item folder, which
    must resolve inside ``top`` (the folder opened) and be a regular file."""

    def __init__(self, root: str, top: str) -> None:
        self.root = root
        self.top = top
        self._real_top = os.path.realpath(top)
        self._rel_root = _rel(root, top)
        self._folders: dict[str, str] = {}  # folder -> its real path (safepaths.confined_file)

    def _found(self, key: str) -> tuple[str, int] | None:
        _safe_name(key, self.root)
        full = os.path.join(self.root, *key.split("/"))
        what = key if self._rel_root == "." else f"{self._rel_root}/{key}"
        return confined_file(
            self._real_top, full, what=what, where=self.top, error=FormatError,
            folders=self._folders,
        )  # fmt: skip

    def size(self, key: str) -> int | None:
        found = self._found(key)
        return None if found is None else found[1]

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The file's bytes (None: not there); with ``limit``, a larger file is refused."""
        found = self._found(key)
        if found is None:
            return None
        return read_regular(
            found[0], what=key, where=self.root, error=FormatError, limit=limit,
            kind="an array's metadata file",
        )  # fmt: skip

    def keys_under(self, leaf: str) -> list[str]:
        base = os.path.join(self.root, *leaf.split("/"))
        out = []
        for dirpath, _dirs, files in os.walk(base):
            rel = os.path.relpath(dirpath, self.root).replace(os.sep, "/")
            out += [f"{rel}/{f}" for f in files]
        return out


class _KvStore:
    """The OCDBT layout, through :class:`dmlib.io.ocdbt.OcdbtStore`."""

    def __init__(self, root: str, top: str) -> None:
        from dmlib.io.ocdbt import open_store

        self.root = root
        self.db = open_store(root, top)
        self._sorted = sorted(self.db.keys)

    def get(self, key: str, limit: int | None = None) -> bytes | None:
        """The value (None: no such key). ``limit`` is met once :meth:`size` was: a value
        is read as the length its reference in the tree declares, never more."""
        return self.db.get(key)

    def size(self, key: str) -> int | None:
        v = self.db.keys.get(key)
        return None if v is None else len(v) if isinstance(v, bytes) else v.length

    def keys_under(self, leaf: str) -> list[str]:
        from bisect import bisect_left

        lead = leaf + "/"
        out = []
        for k in self._sorted[bisect_left(self._sorted, lead) :]:
            if not k.startswith(lead):
                break
            out.append(k)
        return out


def _array_meta(store: Any, name: str, folder: str) -> Any:
    from dmlib.io.zarr_ import parse_metadata

    for fname, fmt in ((".zarray", 2), ("zarr.json", 3)):
        size = store.size(f"{name}/{fname}")
        if size is not None and size > _MAX_ARRAY_JSON:
            raise FormatError(
                f"leaf {name!r}: {fname} of {size} bytes, more than {_MAX_ARRAY_JSON}",
                path=folder,
            )
        raw = None if size is None else store.get(f"{name}/{fname}", limit=_MAX_ARRAY_JSON)
        if raw is not None:
            return parse_metadata(name, raw, fmt, folder)
    raise FormatError(f"leaf {name!r}: no .zarray or zarr.json stored for it", path=folder)


def _check_keys(arr: Any, store: Any, folder: str) -> None:
    """Every stored key of the leaf is its metadata or a chunk of its grid (each key
    checked; the grid, which may be vast, is not listed)."""
    meta = {f"{arr.name}/.zarray", f"{arr.name}/zarr.json", f"{arr.name}/.zattrs"}
    stray = [k for k in store.keys_under(arr.name) if k not in meta and arr.chunk_index(k) is None]
    if stray:
        raise FormatError(
            f"leaf {arr.name!r}: stored key {stray[0]!r} is not a chunk of its grid "
            f"{list(arr.grid())} ({len(stray)} such keys)",
            path=folder,
        )


def _loader(arr: Any, store: Any, folder: str, absent_ok: bool) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from dmlib.io.zarr_ import read_array

        keys = store.keys_under(arr.name)
        out = read_array(arr, store.get, folder, absent_ok=absent_ok, keys=keys)
        return np.ascontiguousarray(out).reshape(-1).view(np.uint8)

    return load


def recorded_step(ts: TensorSet) -> tuple[int | None, str]:
    """(the step a JAX checkpoint records, where): a 0-d integer ``step`` leaf (nnx's
    ``optimizer.step``), else an optax ``count`` (all agreeing); (None, why) otherwise."""
    found: dict[str, list[tuple[str, int]]] = {"step": [], "count": []}
    for name, t in ts.items():
        last = [p for p in re.split(r"[./]", name) if p != "value"][-1:]
        if t.shape == () and t.dtype.kind in "iu" and last and last[0] in found:
            found[last[0]].append((name, int(np.asarray(t.load()).item())))
    for key in ("step", "count"):
        values = {v for _, v in found[key]}
        if len(values) == 1:
            return values.pop(), found[key][0][0]
        if len(values) > 1:
            return None, f"{key} leaves disagree: {found[key]}"
    return None, "no 0-d step or count leaf"


def _open_item(
    path: str, prefix: str = "", top: str | None = None
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    top = top if top is not None else path
    md = _json(os.path.join(path, TREE_METADATA), path, top)
    ocdbt = os.path.lexists(os.path.join(path, "manifest.ocdbt"))
    store: Any = _KvStore(path, top) if ocdbt else _DirStore(path, top)
    if md is not None:
        names, other = _leaves(md, path)
    elif ocdbt:
        names = {
            k.rsplit("/", 1)[0]: "?"
            for k in store.db.keys
            if k.endswith(("/.zarray", "/zarr.json"))
        }
        other = {}
    else:
        raise FormatError(f"no {TREE_METADATA} and no manifest.ocdbt: not an Orbax item", path=path)
    absent_ok = isinstance(md, dict) and md.get("store_array_data_equal_to_fill_value") is False
    tensors: dict[str, Tensor] = {}
    arrays: dict[str, Any] = {}
    for name in names:
        _safe_name(name, path)
        arr = _array_meta(store, name, path)
        _check_keys(arr, store, path)
        full = prefix + name
        tensors[full] = Tensor(
            full,
            arr.dtype,
            arr.shape,
            nbytes=math.prod(arr.shape) * arr.dtype.itemsize,
            dtype_name=arr.dtype.name,
            source=_loader(arr, store, path, absent_ok),
            path=path,
            in_buffer=False,
        )
        arrays[full] = arr.describe()
    fmts = sorted({a["zarr_format"] for a in arrays.values()})
    layout: dict[str, Any] = {
        "layout": "orbax-ocdbt" if ocdbt else "orbax-zarr-dirs",
        "zarr_format": fmts[0] if len(fmts) == 1 else fmts,
        "compression": ",".join(sorted({a["compressor"] for a in arrays.values()})) or "-",
    }
    if ocdbt:
        layout.update(store.db.describe())
    if other:
        layout["not_read"] = {prefix + k: v for k, v in other.items()}
    layout["arrays"] = arrays
    return tensors, layout


def open_orbax(path: str | os.PathLike[str]) -> TensorSet:
    """Open an Orbax step folder or item folder as a lazy TensorSet."""
    path = os.path.abspath(os.fspath(path))
    k = kind(path)
    if k == "manager":
        steps = step_folders(path)
        raise FormatError(
            f"is an Orbax CheckpointManager folder (steps {', '.join(map(str, steps))}): open "
            "one step folder, or pass the folder to `dmlib ladder`",
            path=path,
        )
    if k is None:
        raise FormatError(
            "not an Orbax checkpoint folder (no _METADATA or manifest.ocdbt)", path=path
        )
    step_dir: str | None = None
    if k == "step":
        step_dir = path
        items = _items(path)
        if not items:
            raise TruncatedError(
                "Orbax step folder without an item folder (incomplete save?)", path=path
            )
        parts = [
            _open_item(os.path.join(path, i), "" if len(items) == 1 else f"{i}.", path)
            for i in items
        ]
        tensors = {n: t for p in parts for n, t in p[0].items()}
        layout: dict[str, Any] = (
            dict(parts[0][1])
            if len(parts) == 1
            else {"items": {i: p[1] for i, p in zip(items, parts)}}
        )
        layout["items_read"] = items
        others = sorted(
            n for n in os.listdir(path) if os.path.isdir(os.path.join(path, n)) and n not in items
        )
        if others:  # checkpointables that hold no arrays (a dataset iterator, JSON)
            layout["items_not_read"] = others
    else:
        tensors, layout = _open_item(path)
        parent = os.path.dirname(path)
        if os.path.isfile(os.path.join(parent, CHECKPOINT_METADATA)):
            step_dir = parent
    ts = TensorSet(tensors, path=path, format="orbax", layout=layout)
    _set_step(ts, step_dir)
    return ts


def _set_step(ts: TensorSet, step_dir: str | None) -> None:
    try:
        step, where = recorded_step(ts)
    except DmlibError:
        raise
    if step is None and step_dir is not None:
        m = _STEP_DIR.match(os.path.basename(step_dir))
        if m:
            step, where = int(m.group(1)), f"step folder name {os.path.basename(step_dir)!r}"
    if step is not None:
        ts.scalars["step"] = step
        ts.layout["step_from"] = where


def checkpoints_in(folder: str | os.PathLike[str]) -> list[str] | None:
    """For folder discovery (study init, ladders): a CheckpointManager folder's step
    folders in step order, ``[folder]`` for one step or item folder, None for anything else."""
    k = kind(folder)
    if k == "manager":
        return list(step_folders(folder).values())
    return [os.fspath(folder)] if k is not None else None
