"""A module call's tensors, found and read: inputs and outputs walked, KV caches recognised,
each tensor's bytes as numpy, the modules a capture hooks chosen.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from dmlib.errors import CaptureError, MissingDependencyError

try:
    import torch
except ImportError:  # pragma: no cover - reading captures needs no torch; writing does
    torch = None  # type: ignore[assignment]


def _require_torch() -> None:
    if torch is None:
        raise MissingDependencyError("dmlib.capture needs torch: pip install 'dmlib[torch]'")


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU numpy array with the tensor's exact bytes (bf16/f8 through ml_dtypes).

    ml_dtypes (over a second to import) is imported only for a tensor that needs it.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj() or t.is_neg():  # a lazy view (x.conj(), its .imag): its values, made
        t = t.resolve_conj().resolve_neg()
    t = t.contiguous()
    if t.dtype in _SPECIAL:
        from dmlib import dtypes

        view, name = _SPECIAL[t.dtype]
        return t.view(view).numpy().view(getattr(dtypes, name))
    return t.numpy()


def _host_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as numpy: a view with its strides for a host tensor of a numpy
    dtype (no copy), else :func:`_to_numpy`'s contiguous copy."""
    if t.is_cpu and t.dtype not in _SPECIAL and not t.requires_grad:
        try:
            return t.numpy()
        except (RuntimeError, TypeError):  # (a tensor with its negative bit set, say)
            pass
    return _to_numpy(t)


_SPECIAL: dict[Any, tuple[Any, str]] = (
    {}
    if torch is None
    else {
        torch.bfloat16: (torch.int16, "BFLOAT16"),
        torch.float8_e4m3fn: (torch.int8, "FLOAT8_E4M3FN"),
        torch.float8_e5m2: (torch.int8, "FLOAT8_E5M2"),
    }
)


_NP_DTYPES: dict[Any, np.dtype] = {}


_NP_NAMES: dict[Any, str] = {}  # numpy's dtype.name is computed in Python on every call


def _np_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype :func:`_to_numpy` gives a tensor of this torch dtype."""
    if dtype not in _NP_DTYPES:
        _NP_DTYPES[dtype] = _to_numpy(torch.empty(0, dtype=dtype)).dtype
    return _NP_DTYPES[dtype]


def _tensors(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(slot, tensor) for every tensor in a nested output/argument structure."""
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, (tuple, list)):
        for i, o in enumerate(obj):
            yield from _tensors(
                o, f"{prefix}{i}" if prefix.endswith(("input", "output")) else f"{prefix}.{i}"
            )
    elif isinstance(obj, dict):
        for k, o in obj.items():
            yield from _tensors(o, f"{prefix}.{k}")


#: keyword names under which a tuple of past (key, value) tensors is a KV cache
CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "past", "cache")


def is_cache(obj: Any) -> bool:
    """A transformers ``Cache`` (``DynamicCache``, ``StaticCache``...), by its shape only."""
    return (
        not isinstance(obj, (dict, tuple, list))
        and not torch.is_tensor(obj)
        and (
            isinstance(getattr(obj, "layers", None), list)
            or hasattr(obj, "self_attention_cache")
            or isinstance(getattr(obj, "key_cache", None), list)
        )
    )


def _cache_tensors(obj: Any, prefix: str) -> Iterator[tuple[str, Any, bool]]:
    """(slot, tensor, rolled) of each layer's keys and values in a KV cache (empty left out).

    A ``Cache`` object as ``prefix.layers.{i}.keys`` / ``.values``; a tuple of past
    (key, value) pairs as ``prefix.{i}.0`` / ``.1``. A static layer (preallocated
    ``max_cache_len`` positions, filled in place) gives its filled positions only, as a
    dynamic one holds them; a sliding-window static layer, whose positions roll over,
    is ``rolled``: hashed whole, not per request.
    """
    if torch.is_tensor(obj):
        if obj.numel():
            yield prefix, obj, False
    elif isinstance(obj, (tuple, list)):
        for i, o in enumerate(obj):
            yield from _cache_tensors(o, f"{prefix}.{i}")
    elif hasattr(obj, "self_attention_cache"):  # an EncoderDecoderCache
        for part in ("self_attention_cache", "cross_attention_cache"):
            yield from _cache_tensors(getattr(obj, part, None), f"{prefix}.{part}")
    elif isinstance(getattr(obj, "layers", None), list):
        for i, layer in enumerate(obj.layers):
            for part in ("keys", "values"):
                t = getattr(layer, part, None)
                if torch.is_tensor(t) and t.numel():
                    t, rolled = _filled(layer, t)
                    if t.numel():
                        yield f"{prefix}.layers.{i}.{part}", t, rolled
    elif isinstance(getattr(obj, "key_cache", None), list):  # older transformers
        for part in ("key_cache", "value_cache"):
            for i, t in enumerate(getattr(obj, part, None) or []):
                if torch.is_tensor(t) and t.numel():
                    yield f"{prefix}.{part}.{i}", t, False


def _filled(layer: Any, t: Any) -> tuple[Any, bool]:
    """A cache layer's keys or values cut to the positions it holds; (tensor, rolled)."""
    if getattr(layer, "max_cache_len", None) is None or t.dim() != 4:
        return t, False  # a dynamic layer: every position it holds is filled
    if getattr(layer, "is_sliding", False):
        return t, True
    n = int(layer.get_seq_length()) if hasattr(layer, "get_seq_length") else int(t.shape[2])
    return t[:, :, : min(n, int(t.shape[2]))], False


#: argument types that hold no tensor: skipped before any slot name is made
_SCALARS = (type(None), bool, int, float, str)


def _inputs(args: Any, kwargs: dict[str, Any]) -> Iterator[tuple[str, Any, bool | str]]:
    """(slot, tensor, kind) for a module call's inputs: False, a KV-cache tensor (True),
    or one of a rolling cache (``"rolled"``)."""
    tensor = torch.Tensor
    for i, a in enumerate(args):
        if type(a) is tensor:  # the common case, without the walk
            yield f"input{i}", a, False
        elif isinstance(a, _SCALARS):
            continue
        elif is_cache(a):
            for slot, t, rolled in _cache_tensors(a, f"input{i}"):
                yield slot, t, "rolled" if rolled else True
        else:
            for slot, t in _tensors(a, f"input{i}"):
                yield slot, t, False
    for k, v in kwargs.items():
        if type(v) is tensor:
            yield f"input.{k}", v, False
        elif isinstance(v, _SCALARS):
            continue
        elif is_cache(v) or (k in CACHE_KWARGS and isinstance(v, (tuple, list))):
            for slot, t, rolled in _cache_tensors(v, f"input.{k}"):
                yield slot, t, "rolled" if rolled else True
        else:
            for slot, t in _tensors(v, f"input.{k}"):
                yield slot, t, False


def default_modules(model: torch.nn.Module, named: dict[str, Any] | None = None) -> list[str]:
    """Leaf modules plus top-level blocks: the root's children and ModuleList/Sequential items,
    and every module wrapping a ``base_layer`` (an adapter layer: PEFT's LoRA ``Linear`` adds
    ``scaling * B(A(x))`` to its base layer's output in its own forward, outside every leaf,
    so without it a difference entering at that sum is first seen a block later).

    ``named``: ``dict(model.named_modules())``, where the caller has it already.
    """
    named = dict(model.named_modules()) if named is None else named
    lists = (torch.nn.ModuleList, torch.nn.Sequential)
    containers = {n for n, m in named.items() if isinstance(m, lists)}
    names = []
    for name, m in named.items():
        if name == "" or isinstance(m, lists):
            continue
        parent = name.rpartition(".")[0]
        leaf = next(m.children(), None) is None
        adapter = isinstance(getattr(m, "_modules", {}).get("base_layer"), torch.nn.Module)
        if leaf or adapter or "." not in name or parent in containers:
            names.append(name)
    return names


def _select(
    model: torch.nn.Module,
    modules: str | Iterable[str] | None,
    named: dict[str, Any] | None = None,
) -> list[tuple[str, Any]]:
    named = dict(model.named_modules()) if named is None else named
    odd = [n for n in named if any(c in n for c in ":#/")]
    if odd:
        # boundary names are module:slot#call and op ids module/op#k: these would be ambiguous
        raise CaptureError(
            f"module name {odd[0]!r} holds ':', '#' or '/', which boundary names use as "
            "separators; rename the submodule"
        )
    if modules is None:
        chosen = default_modules(model, named)
    else:
        patterns = [modules] if isinstance(modules, str) else list(modules)
        chosen = [n for n in named if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if "" in patterns:
            chosen.insert(0, "")
        if not chosen:
            raise CaptureError(f"no module matches {patterns}; modules are e.g. {list(named)[1:6]}")
    return [(n, named[n]) for n in chosen]
