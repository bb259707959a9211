"""PyTorch state dicts (``.pt``, ``.pth``, ``.bin``), read without importing torch.

``torch.save`` files (zip and legacy) are read by :mod:`dmlib.io.torch_zip` through dmlib's
restricted unpickler: nothing outside its table of names is built, no code from the file
runs. torch is imported only when the file holds a construct that reader leaves to torch
(quantized or sparse tensors, a big-endian file); then ``torch.load(weights_only=True)``
reads it. ``layout["reader"]`` says which path was taken (``dmlib inspect`` prints it).

Nested containers are flattened to dotted names (``{"model": {"fc.weight": t}}`` ->
``model.fc.weight``); tensors become the set's tensors and plain values (numbers,
strings, bools, None: a ``step``, an optimizer's ``lr`` and ``betas``) its ``scalars``.
Optimizer state is named after the parameters where the file allows it (see
``_optimizer_names``); ``metadata["optimizer_state_names"]`` says how.
"""

from __future__ import annotations

import os
import pickletools
import sys
import warnings
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

from dmlib import _limits
from dmlib.errors import (
    FormatError,
    MissingDependencyError,
    NotTensorsError,
    UnsafePickleError,
    UnsupportedError,
)
from dmlib.io import _torch_parts, _unpickle, torch_zip
from dmlib.io._checks import short_repr
from dmlib.tensor import Tensor, TensorSet
from dmlib.textsafe import shown

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


# torch.save's legacy (non-zip) files open with the pickle (protocol 2) of its magic
# number 0x1950a86a20f9469cfc6c: PROTO 2, LONG1 of 10 bytes, little-endian
LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


def can_open(head: bytes, path: str) -> bool:
    """A legacy ``torch.save`` file (it starts with :data:`LEGACY_MAGIC`; any name), or a
    file named with one of :data:`SUFFIXES` that starts as a zip (``PK``) or a protocol-2 pickle.
    """
    if head.startswith(LEGACY_MAGIC):
        return True
    return path.endswith(SUFFIXES) and (head.startswith(b"PK") or head[:2] == b"\x80\x02")


def is_torch_zip(names: list[str]) -> bool:
    """True for the member names of a ``torch.save`` zip: ``<archive>/data.pkl`` (any file name)."""
    return any(n == "data.pkl" or (n.endswith("/data.pkl") and n.count("/") == 1) for n in names)


def _is_tensor(obj: Any) -> bool:
    """A tensor of the file: read by dmlib (``StoredTensor``) or by torch (``torch.Tensor``)."""
    if isinstance(obj, torch_zip.StoredTensor):
        return True
    torch = sys.modules.get("torch")  # never imported here: only when torch read the file
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_leaf(obj: Any) -> bool:
    return _is_tensor(obj) or isinstance(obj, torch_zip.NumpyArray)


def _flatten(obj: Any, out: dict[str, Any], path: str) -> None:
    """Tensors and plain values (numbers, strings, bools, None) under dotted names.

    Two leaves that flatten to one name (``{"a.b": x, "a": {"b": y}}``, or keys ``0`` and
    ``"0"``) are refused, not overwritten. Walked with a stack, depth first in the
    containers' order (``_unpickle.check_shape`` has bounded the depth and the counts once
    shared references are expanded). Each name is made once from its parent's (never a
    tuple of keys per entry) through :class:`dmlib._limits.Flattening`, which refuses a
    name longer than a few KB and more entries or name characters than one file may hold;
    each entry keeps only a link to its parent's, from which the key path is spelled out
    if a collision is refused.
    """
    budget = _limits.Flattening(path)
    where: dict[str, Any] = {}  # name -> its key path as (parent's link, key) links
    # (node, its parent's name (None: the parent is the top), its key, the parent's link)
    stack: list[tuple[Any, str | None, Any, Any]] = [(obj, None, _TOP, None)]
    while stack:
        node, parent, key, up = stack.pop()
        top = key is _TOP
        link = None if top else (up, key)
        name = "" if top else budget.name(parent, key)
        if _is_leaf(node) or isinstance(node, (bool, int, float, str)) or node is None:
            budget.leaf(name)
            if name in out:
                raise UnsupportedError(
                    f"entries {_keypath(where[name])} and {_keypath(link)} both flatten to the "
                    f"name {short_repr(name, 200)}; dmlib names entries by joining keys with '.', so one "
                    "would hide the other",
                    path=path,
                )
            out[name] = node
            where[name] = link
            continue
        if isinstance(node, Mapping):
            items: Any = node.items()
        elif isinstance(node, (list, tuple)):
            items = enumerate(node)
        else:  # a value of another type (bytes, complex, torch.dtype...): named, not dropped
            budget.leaf(name)
            out.setdefault(SKIPPED, []).append(f"{name} ({type(node).__name__})")
            continue
        budget.container()
        mine = None if top else name
        stack.extend(reversed([(v, mine, k, link) for k, v in items]))


_TOP = object()  # the key of the top object (its name is "")


def _keypath(link: Any) -> str:
    """``['model']['fc.weight']``: the keys of a link chain, at most 200 characters."""
    keys = []
    while link is not None:
        link, key = link
        keys.append(key)
    text = "".join(f"[{k!r:.80}]" for k in reversed(keys))
    return shown(text)


SKIPPED = "\0skipped"  # key of the list of values neither tensors nor plain (never a name)


def _optimizer_names(obj: Any, path: str) -> tuple[dict[str, str], str | None]:
    """``{"<opt key>.state.<id>.": "<opt key>.state.<param name>."}`` and a note.

    Optimizer state is keyed by parameter index. The parameter's name is known when the
    param group lists ``param_names`` (written by recent PyTorch for optimizers built from
    ``named_parameters()``), or when the file holds one model state dict beside the
    optimizer whose floating tensors pair one to one, in order and shape, with the
    indices (``model.parameters()`` order, no buffers). Otherwise the ids stay and the note
    says why.
    """
    if not isinstance(obj, Mapping):
        return {}, None
    opts = [
        k
        for k, v in obj.items()
        if isinstance(v, Mapping)
        and isinstance(v.get("state"), Mapping)
        and isinstance(v.get("param_groups"), list)
    ]
    models = [
        k
        for k, v in obj.items()
        if isinstance(v, Mapping) and v and all(_is_tensor(t) for t in v.values())
    ]
    if isinstance(obj.get("state"), Mapping) and isinstance(obj.get("param_groups"), list):
        opts = [None]  # the file is an optimizer's state dict itself
    prefixes, notes = {}, []
    for ok in opts:
        opt = obj if ok is None else obj[ok]
        head = "" if ok is None else f"{ok}."
        try:
            groups = [g for g in opt["param_groups"] if isinstance(g, Mapping)]
            ids = [i for g in groups for i in g.get("params", [])]
            named = [str(n) for g in groups for n in g.get("param_names", [])]
        except TypeError:  # a malformed group: leave the ids alone
            continue
        if not all(type(i) is int for i in ids):  # ids are ints (or the group is malformed)
            continue
        how = "param_names"
        if len(named) != len(ids):
            named, how = [], ""
            if len(models) == 1 and ok is not None:
                sd = obj[models[0]]
                cand = [n for n, t in sd.items() if t.is_floating_point()]
                if len(cand) == len(ids):
                    named, how = cand, f"the order of {models[0]!r}"
        if named and how != "param_names":
            sd = obj[models[0]]
            # every per-parameter state tensor (exp_avg...) has its parameter's shape
            shapes_ok = all(
                v.dim() == 0 or v.shape == sd[n].shape
                for i, n in zip(ids, named, strict=True)
                for v in _per_param(opt["state"], i).values()
                if _is_tensor(v)
            )
            named = named if shapes_ok else []
        if named and len(set(named)) == len(named):
            for i, n in zip(ids, named, strict=True):
                prefixes[f"{head}state.{i}."] = f"{head}state.{n}."
            notes.append(f"{ok or 'optimizer'}: state named after parameters ({how})")
            continue
        notes.append(
            f"{ok or 'optimizer'}: state keeps numeric parameter ids (no param_names, and no single model "
            "state dict whose floating tensors pair with them in order and shape)"
        )
    return prefixes, "; ".join(notes) or None


def _per_param(state: Any, i: int) -> Mapping[Any, Any]:
    """An optimizer's state of parameter ``i`` (a map; anything else counts as none)."""
    found = state.get(i) if isinstance(state, Mapping) else None
    return found if isinstance(found, Mapping) else {}


def _rename_state(name: str, prefixes: dict[str, str], heads: set[str]) -> str:
    """``name`` with its ``<head>state.<id>.`` prefix renamed, found by its parts (a file
    of many ids would make a scan of every prefix for every name quadratic)."""
    for head in heads:
        if name.startswith(head):
            idx, dot, rest = name[len(head) :].partition(".")
            new = prefixes.get(f"{head}{idx}.") if dot else None
            if new is not None:
                return new + rest
    return name


def _check_archive(path: str) -> None:
    """Refuse a damaged archive before torch reads it.

    torch locates each storage through the member's local header and checks no CRC, so
    one damaged header byte yields a tensor read from a shifted window of the file.
    zipfile finds the data the same way and checks it against the central directory's
    CRC; this costs one read of the file.
    """
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (
        zipfile.BadZipFile,
        zlib.error,
        OSError,
        EOFError,
        ValueError,
        NotImplementedError,
        RuntimeError,
    ) as err:
        raise FormatError(f"damaged zip archive ({type(err).__name__}: {err})", path=path) from None
    if bad is not None:
        raise FormatError(
            f"damaged zip archive: member {bad!r} does not match its central-directory entry (header or CRC)",
            path=path,
        )


def _why(err: Exception) -> str:
    """The gist of a torch.load failure; its own messages run to paragraphs of advice."""
    text = str(err)
    if "WeightsUnpickler error:" in text:  # the advice to drop weights_only is not ours to give
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
    text = " ".join(text.split())
    return f"{type(err).__name__}: {text if len(text) <= 200 else text[:197] + '...'}"


def _torch_load(path: str, is_zip: bool) -> Any:
    """The file read by ``torch.load(weights_only=True)`` (constructs dmlib leaves to torch)."""
    try:
        import torch
    except ImportError:
        raise MissingDependencyError(
            "reading this PyTorch checkpoint needs torch: pip install 'dmlib[torch]'", path=path
        ) from None
    if is_zip:
        _check_archive(path)
    try:
        with warnings.catch_warnings():  # torch's own deprecation notes on quantized storages
            warnings.filterwarnings(
                "ignore", message=".*TypedStorage is deprecated", category=UserWarning
            )
            warnings.filterwarnings(
                "ignore", message=".*[Ss]parse.* support is in beta", category=UserWarning
            )
            warnings.filterwarnings(
                "ignore", message=".*quantized tensor creation.*deprecated", category=UserWarning
            )
            return torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except Exception as err:  # torch raises many types for corrupt or unsafe files
        raise FormatError(f"not a loadable PyTorch state dict ({_why(err)})", path=path) from None


def _vet(path: str, is_zip: bool) -> None:
    """Every global of the file's pickles is in dmlib's torch table or its torch-only list."""
    if is_zip:
        with zipfile.ZipFile(path) as z:
            pkl = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            with z.open(pkl[0]) as f:
                _unpickle.vet_globals(
                    f, torch_zip.TABLE, torch_zip.TORCH_ONLY, what="data.pkl", path=path
                )
        return
    with open(path, "rb") as f:  # magic, protocol, system info, the object, storage keys
        _unpickle.vet_globals(
            f, torch_zip.TABLE, torch_zip.TORCH_ONLY, what="the file's pickles", path=path, count=5
        )


def _top_class(path: str, is_zip: bool) -> str | None:
    """``module.Class`` when the file's pickle is one object of a class (its first global)."""
    try:
        if is_zip:
            with zipfile.ZipFile(path) as z:
                pkl = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
                with z.open(pkl[0]) as f:
                    head = f.read(4096)
        else:
            with open(path, "rb") as f:
                head = f.read(4096)
        strings: list[str] = []
        for op, arg, _pos in pickletools.genops(head):
            if op.name in ("PROTO", "FRAME", "MEMOIZE", "BINPUT", "PUT", "LONG_BINPUT"):
                continue
            if op.name == "GLOBAL":
                module, _, name = str(arg).partition(" ")
                break
            if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE") and len(strings) < 2:
                strings.append(str(arg))
                continue
            if op.name == "STACK_GLOBAL" and len(strings) == 2:
                module, name = strings
                break
            return None
        else:
            return None
    except Exception:  # only a better message was at stake
        return None
    return f"{module}.{name}" if name[:1].isupper() and "." not in name else None


def open_torch(path: str | os.PathLike[str]) -> TensorSet:
    """Open a ``torch.save`` file (zip or legacy) as a TensorSet, without torch where it can.

    dmlib's restricted unpickler reads it; a construct that reader leaves to torch makes
    ``torch.load(weights_only=True)`` read it instead (``layout["reader"]`` says which).
    Nested containers become dotted names and plain values ``scalars``; optimizer state is
    named after the parameters where the file allows it and no name would collide. A file
    that is one pickled object of a class dmlib refuses raises NotTensorsError; an object
    that is no mapping and holds no tensor, UnsupportedError.
    """
    path = os.fspath(path)
    try:
        is_zip = zipfile.is_zipfile(path)
    except zipfile.BadZipFile as err:  # is_zipfile itself raises on some damaged end records
        raise FormatError(f"damaged zip archive ({err})", path=path) from None
    if not is_zip:
        with open(path, "rb") as f:
            if not f.read(len(LEGACY_MAGIC)).startswith(LEGACY_MAGIC):
                raise FormatError(
                    "not a loadable PyTorch state dict (neither a torch.save zip archive "
                    "nor a legacy torch.save file)",
                    path=path,
                )
    try:
        obj = torch_zip.read_zip(path, path) if is_zip else torch_zip.read_legacy(path)
        reader = "dmlib (torch not imported)"
    except _unpickle.NeedsTorch as why:
        _vet(path, is_zip)  # no name outside dmlib's table and its torch-only list reaches torch
        obj = _torch_load(path, is_zip)
        _unpickle.check_shape(obj, what="the file", path=path)
        reader = f"torch.load(weights_only=True) (the file holds {why.what})"
    except UnsafePickleError as err:
        cls = _top_class(path, is_zip)
        if cls is not None and f"names {cls}," in err.message:  # the object itself is refused
            raise NotTensorsError(
                f"a pickled object of class {cls}, no tensors (dmlib does not unpickle it)",
                path=path,
            ) from None
        raise
    flat: dict[str, Any] = {}
    _flatten(obj, flat, path)
    if not any(_is_tensor(v) for v in flat.values()) and not isinstance(obj, Mapping):
        raise UnsupportedError(
            f"holds a {type(obj).__name__}, not a state dict of tensors", path=path
        )
    prefixes, note = _optimizer_names(obj, path)
    if prefixes:
        heads = {k.rsplit("state.", 1)[0] + "state." for k in prefixes}
        budget = _limits.Flattening(path)  # a parameter's name is repeated in every state entry
        renamed = {}
        for k, v in flat.items():
            new = _rename_state(k, prefixes, heads) if k != SKIPPED else k
            if new != k:
                budget.leaf(new)
            renamed[new] = v
        if len(renamed) == len(flat):  # a parameter name that collides keeps the numeric ids
            flat = renamed
        else:
            note = "optimizer state keeps numeric parameter ids (parameter names would collide)"
    metadata = {} if note is None else {"optimizer_state_names": note}
    skipped = flat.pop(SKIPPED, None)
    if skipped:
        metadata["entries_not_read"] = ", ".join(skipped)
    scalars = {k: v for k, v in flat.items() if not _is_leaf(v)}
    tensors: dict[str, Tensor] = {}
    for name, t in flat.items():
        if name in scalars:
            continue
        if isinstance(t, torch_zip.StoredTensor):
            parts = _torch_parts.stored_entries(name, t, path)
        elif isinstance(t, torch_zip.NumpyArray):
            assert t.array is not None  # a NumpyArray leaves the unpickler built
            parts = _torch_parts.array_entry(name, t.array, path)
        else:
            parts = _torch_parts.entries(name, t, path)
        for part, tensor in parts.items():
            if part in tensors or (part != name and part in flat):
                raise FormatError(
                    f"tensor {name!r}: its part {part!r} collides with another name", path=path
                )
            tensors[part] = tensor
    return TensorSet(
        tensors, path=path, format="torch", metadata=metadata, scalars=scalars,
        layout={"reader": reader},
    )  # fmt: skip
