"""The state a forward pass leaves behind: its cache, walked after each pass and recorded as
boundaries of kind ``state`` (:data:`~dmlib.localize.capture.format.KINDS`).

A model that returns a cache (``past_key_values``, ``cache_params``...) carries more than
its logits into the next pass: attention keys and values, and for linear attention or
state-space layers a convolution and a recurrent state per sequence. The next decode step
consumes them, so a capture that compares only the outputs can call two runs identical
while the states they hand on differ. The cache is found by its tensors, not by class
names: every tensor reachable through the cache object's attributes, lists, tuples and
dicts (its layers', too) is a state, named by its path (``state.layers.0.recurrent_states.0``).

A layer's ``keys``/``values`` (batch, heads, positions, head_dim) are read per request
along positions, as a KV cache entering a module is (a sliding-window layer whole); every
other state is one row per sequence: per index of its first axis where that axis is the
batch (the request filling that batch row alone), else whole. Bookkeeping scalars (0-d
tensors: lengths, counters) are no state.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dmlib.localize.capture.format import ENTRY_KEYS, OPTIONAL_KEYS
from dmlib.localize.capture.tensors import _filled, is_cache

try:
    import torch
except ImportError:  # pragma: no cover - reading captures needs no torch; writing does
    torch = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from dmlib.localize.capture.recorder import Recorder

#: output attributes (or keys) that hold a model's cache, in the order they are looked for
CACHE_OUTPUTS = ("past_key_values", "cache_params", "cache", "past_key_value", "mems")

_MAX_DEPTH = 6  # attribute levels walked below the cache object


def find_cache(output: Any) -> tuple[str, Any] | None:
    """(name, cache) of the cache a model's output holds (under one of
    :data:`CACHE_OUTPUTS`, or, for a tuple output (``return_dict=False``), the first
    element that is a cache object), or None."""
    if isinstance(output, (tuple, list)):
        for i, obj in enumerate(output):
            if is_cache(obj):
                return f"output{i}", obj
        return None
    for key in CACHE_OUTPUTS:
        try:
            obj = output[key] if isinstance(output, dict) else getattr(output, key, None)
        except (KeyError, IndexError, TypeError):
            obj = None
        if obj is not None and not (torch.is_tensor(obj) and obj.dim() == 0):
            return key, obj
    return None


def state_tensors(cache: Any, prefix: str = "state") -> Iterator[tuple[str, Any, str]]:
    """(slot, tensor, how) for every tensor reachable from ``cache``: ``how`` is
    ``"positions"`` (a layer's keys/values, 4-d), ``"rolled"`` (those of a sliding-window
    static layer) or ``"batch"`` (any other state: one per sequence)."""
    seen: set[int] = set()
    yield from _walk(cache, prefix, None, 0, seen)


def _walk(
    obj: Any, prefix: str, owner: Any, depth: int, seen: set[int]
) -> Iterator[tuple[str, Any, str]]:
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return
    if torch.is_tensor(obj):
        if obj.dim() == 0 or obj.numel() == 0 or id(obj) in seen:
            return
        seen.add(id(obj))
        last = prefix.rsplit(".", 1)[-1]
        if last in ("keys", "values") and obj.dim() == 4 and owner is not None:
            t, rolled = _filled(owner, obj)
            if t.numel():
                yield prefix, t, "rolled" if rolled else "positions"
            return
        yield prefix, obj, "batch"
        return
    if depth >= _MAX_DEPTH or id(obj) in seen or isinstance(obj, (torch.nn.Module, torch.device,
                                                                   torch.dtype)):  # fmt: skip
        return
    seen.add(id(obj))
    if isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            yield from _walk(x, f"{prefix}.{i}", owner, depth + 1, seen)
    elif isinstance(obj, dict):
        for k, x in obj.items():
            if isinstance(k, (str, int)):
                yield from _walk(x, f"{prefix}.{k}", owner, depth + 1, seen)
    elif hasattr(obj, "__dict__"):
        for k, x in vars(obj).items():
            if not k.startswith("_"):
                yield from _walk(x, f"{prefix}.{k}", obj, depth + 1, seen)


def record_states(rec: Recorder, output: Any) -> int:
    """Record the states of the cache in a model's ``output`` (after pass ``rec.step``);
    returns how many. A cache that holds no tensor is listed under the capture's
    ``not_captured``."""
    found = find_cache(output)
    if found is None:
        return 0
    name, cache = found
    n = 0
    for slot, t, how in state_tensors(cache):
        if how == "batch":
            _record_batch_state(rec, slot, t)
        else:
            rec.record_cache(rec.root, rec.step, slot, t, rolled=how == "rolled")
            # the same digests, as what this pass leaves behind (the recorder keeps its own
            # entry to share with a later module that receives this cache); digests still
            # to come (a worker's, or shared) are copied into the state's when they are
            first = rec.boundaries[-1]
            rec.boundaries[-1] = _as_state(first)
            if first["digest"] is None:
                rec._same.append((rec.boundaries[-1], first))
        n += 1
    if not n:
        rec.note_unseen(f"{rec.root} output {name}",
                        f"a cache ({type(cache).__name__}) in which no tensor was found")  # fmt: skip
    return n


def _as_state(entry: dict[str, Any]) -> dict[str, Any]:
    """A copy of a KV-cache entry as a state's: an output, marked ``state``, its keys in
    the writer's order (:data:`ENTRY_KEYS`, then :data:`OPTIONAL_KEYS`)."""
    d = dict(entry, kind="output", state=True)
    order = {k: i for i, k in enumerate((*ENTRY_KEYS, *OPTIONAL_KEYS))}
    return {k: d[k] for k in sorted(d, key=lambda k: order.get(k, len(order)))}


def _record_batch_state(rec: Recorder, slot: str, t: Any) -> None:
    """One state with a row per sequence: whole, and per index of its first axis.

    Hashed as the recorder hashes a module's output read whole (:meth:`Recorder._digest`):
    where it lives (a device checksum), in one compiled call, or on a worker for a large
    tensor; a state tensor recorded before at the same version (unchanged since: a layer
    this pass did not write, or a module's output the cache holds) shares its digests."""
    original, t = t, (t.detach() if t.requires_grad else t)
    entry = rec._entry(rec.root, rec.step, "output", slot, t.dtype, tuple(t.shape),
                       {"state": True})  # fmt: skip
    if rec.row_map is not None and t.dim() >= 1:
        entry["leading"] = []  # one digest per index of axis 0: filled with the others
    rec.boundaries.append(entry)
    wants_dump = rec._wants_dump(entry["name"])
    if rec._share(entry, original, (None, None, entry["leading"] is not None), wants_dump):
        return
    if wants_dump:
        entry["dump"] = rec._dump_plan(len(rec.boundaries) - 1, False)
    rec._digest(entry, t, None, None)


__all__ = ["CACHE_OUTPUTS", "find_cache", "record_states", "state_tensors"]
