"""Op-level capture: every ATen (or custom) operation run inside chosen modules.

``dmlib.capture(model, path, ops=True, op_modules=PATTERN)`` installs a
``TorchDispatchMode`` next to the module hooks. Each operation dispatched while a
selected module runs becomes an *op boundary* named after its innermost selected module
and its own name, counted per module call and op name::

    encoder.layer.0.attention.self/aten.addmm#0          output
    encoder.layer.0.attention.self/aten.addmm#0:input1   an input

Custom operators (``torch.library``) appear under their own names (``mylib.quirk#0``);
the ops their implementation runs are not seen. Inputs and outputs are hashed, row-mapped
and dumped exactly like module boundaries, with two differences: a model parameter or
buffer (or a view of one) is always hashed whole, and outputs of ops that return
uninitialised memory (``aten.empty`` and kin) are not hashed at all. The manifest gains
an ``ops`` list (op id, overload, owner module, input and output boundary names, and the
non-tensor arguments, so that :mod:`dmlib.localize.arbitrate` can replay the op).

:func:`align` pairs the op sequences of two captures module call by module call (the
same module may run other ops in another layout): only ops with the same overload in a
matched run of the sequence are paired, and where the sequences part is reported.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Any

from dmlib.localize.capture.format import ROOT
from dmlib.localize.opalign import (
    LAYOUT_BOUND_NOTE,
    Alignment,
    OpInfo,
    align,
    is_op_boundary,
    layout_bound,
    op_table,
)

try:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - reading and aligning need no torch
    torch = None  # type: ignore[assignment]
    TorchDispatchMode = object  # type: ignore[assignment,misc]

# the guard quiet() takes while a tracker's mode is on (None: this torch has none)
_NO_DISPATCH = getattr(getattr(torch, "_C", None), "_DisableTorchDispatch", None)

# ops whose output is uninitialised memory: hashing it would fail every repeat control
UNINITIALISED = {
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
    "aten.new_empty_strided", "aten.empty_permuted",
}  # fmt: skip


class _QuietState(threading.local):
    """Per thread: quiet() blocks open (``n``) and trackers' modes on (``modes``)."""

    n = 0
    modes = 0


_QUIET = _QuietState()
_NAMES: dict[Any, str] = {}  # op -> op_name(op), looked up once
_OVERLOADS: dict[Any, str] = {}  # op -> str(op) (``aten.addmm.default``), once


class _Quiet:
    """:func:`quiet`'s block (a class: a generator-based context manager costs ~2 us a use,
    and a capture enters one per hook and per op tensor)."""

    __slots__ = ("guard",)

    def __enter__(self) -> None:
        _QUIET.n += 1
        self.guard = None
        if _QUIET.modes and _NO_DISPATCH is not None:
            guard = _NO_DISPATCH()
            guard.__enter__()
            self.guard = guard

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.guard is not None:
                self.guard.__exit__(*exc)
        finally:
            _QUIET.n -= 1


_NOTHING = contextlib.nullcontext()


def quiet() -> contextlib.AbstractContextManager[None]:
    """Ops run inside this block (dmlib's own tensor calls) are seen by no tracker.

    While a tracker's mode is on, they do not even reach it: Python dispatch is off in
    the block (``torch._C._DisableTorchDispatch``), so the recorder's ``detach``,
    ``contiguous`` and ``numpy`` calls cost what they cost without a mode (measured: a
    ``detach`` through the mode 3.7 us, with the guard 1.1 us, ~3 per recorded tensor).
    With no tracker's mode on in this thread, no tracker can see an op, and the block is
    a shared no-op (a capture without ops enters one per hook).
    """
    if not _QUIET.modes:
        return _NOTHING
    return _Quiet()


def _silent() -> Any:
    """:func:`quiet` inside the dispatch mode's own call, where this tracker's mode is off
    already: only the other modes are to be kept from seeing the recorder's tensor calls,
    which torch's C guard does alone (one C call; ``quiet()``'s Python block cost ~2 us,
    twice per op)."""
    return _NO_DISPATCH() if _NO_DISPATCH is not None else quiet()


def op_name(func: Any) -> str:
    """``aten.addmm`` for ``aten.addmm.default``; custom ops as ``namespace.name``."""
    packet = getattr(func, "overloadpacket", None)
    return str(packet) if packet is not None else str(func)


def op_id(owner: str, name: str, k: int) -> str:
    """The id of an op call: ``owner/name#k``, call ``k`` (from 0) of ``name`` in ``owner``."""
    return f"{owner}/{name}#{k}"


class ModuleStack:
    """Which selected module runs now: forward hooks push and pop (label, call)."""

    def __init__(self, selected: list[tuple[str, Any]], root: str = ROOT) -> None:
        self.selected = selected
        self.root = root  # the label of the model itself
        self.stack: list[str] = []
        self.calls: dict[str, int] = {}
        self.counts: dict[tuple[str, str], int] = {}
        self._open = False  # inside the ``with`` block
        self._mode: _Mode | None = None  # entered while a selected module runs

    def install(self) -> list[Any]:
        """Register the push and pop hooks on every selected module; returns their handles."""
        handles = []
        for name, mod in self.selected:
            label = name or self.root
            # pushed after and popped before other hooks: ops that hooks run are not the module's
            handles.append(mod.register_forward_pre_hook(self._push(label)))
            handles.append(mod.register_forward_hook(self._pop(label), prepend=True))
        return handles

    def _push(self, label: str):
        def hook(mod, args):
            call = self.calls.get(label, 0)
            self.calls[label] = call + 1
            self.stack.append(label if call == 0 else f"{label}#{call}")
            if len(self.stack) == 1:
                self._mode_on()

        return hook

    def _pop(self, label: str):
        def hook(mod, args, output):
            if self.stack:
                self.stack.pop()
            if not self.stack:
                self._mode_off()

        return hook

    # The dispatch mode is on only while a selected module runs: the ops outside them
    # (most of a model, when op_modules is one layer) never pay for a Python call.
    def _mode_on(self) -> None:
        if self._open and self._mode is None:
            self._mode = _Mode(self)
            self._mode.__enter__()
            _QUIET.modes += 1

    def _mode_off(self, *exc: Any) -> None:
        if self._mode is not None:
            mode, self._mode = self._mode, None
            _QUIET.modes -= 1
            mode.__exit__(*(exc or (None, None, None)))

    def next_id(self, func: Any) -> str | None:
        """The id of this op call, or None when no selected module runs (or in quiet())."""
        if _QUIET.n or not self.stack:
            return None
        owner = self.stack[-1]
        name = _NAMES.get(func) or _NAMES.setdefault(func, op_name(func))
        k = self.counts.get((owner, name), 0)
        self.counts[(owner, name)] = k + 1
        return op_id(owner, name, k)

    def on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run one op seen by the dispatch mode, return its result (each subclass defines how)."""
        raise NotImplementedError

    def __enter__(self) -> ModuleStack:
        self._open, self._mode = True, None
        return self

    def __exit__(self, *exc: Any) -> None:
        self._open = False
        self._mode_off(*exc)  # a forward pass that raised inside a selected module


class _Mode(TorchDispatchMode):
    def __init__(self, tracker: ModuleStack) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # the mode is off while this runs: the tracker's own tensor calls are not seen
        return self.tracker.on_op(func, tuple(args), dict(kwargs or {}))


def _flat(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(slot, tensor) for each tensor in an op's arguments or results, in schema order."""
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, (tuple, list)):
        for i, o in enumerate(obj):
            if torch.is_tensor(o):
                yield f"{prefix}.{i}", o
            elif isinstance(o, (tuple, list)):  # (a size list's ints need no walk)
                yield from _flat(o, f"{prefix}.{i}")


def _storage(t: Any) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


# dtypes whose tensors are not hashed: complex, and quantized (their values are not their bytes)
_UNHASHED = (
    set()
    if torch is None
    else {getattr(torch, n) for n in ("complex32", "complex64", "complex128", "quint8", "qint8",
                                      "qint32", "quint4x2", "quint2x4") if hasattr(torch, n)}
)  # fmt: skip
_HASHED_TYPES = () if torch is None else (torch.Tensor, torch.nn.Parameter)


def _recordable(t: Any) -> bool:
    # (a quantized tensor has a quantized dtype: in _UNHASHED)
    return (
        type(t) in _HASHED_TYPES
        and t.dtype not in _UNHASHED
        and t.layout is torch.strided
        and not t.is_meta
    )


class OpRecorder(ModuleStack):
    """Records each op's tensors into a :class:`dmlib.localize.capture.Recorder`."""

    def __init__(self, rec: Any, model: Any, selected: list[tuple[str, Any]]) -> None:
        super().__init__(selected, rec.root)
        self.rec = rec
        rec.ops = []
        self.params: dict[int, str] = {}
        for kind in (model.named_parameters(), model.named_buffers()):
            for n, p in kind:
                ptr = _storage(p)
                if ptr:
                    self.params.setdefault(ptr, n)

    def on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run the op; when a selected module runs it, record its tensors and arguments too."""
        oid = self.next_id(func)
        if oid is None:
            return func(*args, **kwargs)
        info: dict[str, Any] = {
            "id": oid,
            "op": _OVERLOADS.get(func) or _OVERLOADS.setdefault(func, str(func)),
            "owner": oid.rpartition("/")[0],
            "inputs": [],
            "outputs": [],
            "skipped": [],
        }
        names: dict[int, str | None] = {}
        walk = (torch.Tensor, tuple, list)  # the arguments that may hold tensors
        slots = [(f"input{i}", a) for i, a in enumerate(args) if isinstance(a, walk)] + [
            (f"input.{k}", v) for k, v in kwargs.items() if isinstance(v, walk)
        ]
        inputs: dict[int, tuple[Any, dict[str, Any]]] = {}  # address -> (tensor, entry)
        with _silent():  # the recorder's own tensor calls are not the model's ops
            for top, value in slots:
                for slot, t in _flat(value, top):
                    names[id(t)] = self._record(info, oid, "input", slot, t, inputs=inputs)
        info["args"] = [_encode(a, names) for a in args]
        info["kwargs"] = {k: _encode(v, names) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        writes, uninitialised = _traits(func)
        if writes:
            inputs.clear()  # the op may have written its inputs: their digests are the old bytes'
        if uninitialised:
            info["skipped"].append("output: uninitialised memory, not hashed")
        else:
            results = out if isinstance(out, (tuple, list)) else (out,)
            with _silent():
                for i, r in enumerate(results):
                    for slot, t in _flat(r, f"output{i}"):
                        self._record(info, oid, "output", slot, t, inputs=inputs, fresh=writes)
        self.rec.ops.append(info)
        return out

    def _record(
        self,
        info: dict[str, Any],
        oid: str,
        kind: str,
        slot: str,
        t: Any,
        *,
        inputs: dict[int, tuple[Any, dict[str, Any]]],
        fresh: bool = False,
    ) -> str | None:
        """Record one input or output of op ``oid``.

        An output over the memory of an input of the same call (a view, ``_unsafe_view``)
        of an op that writes nothing takes that input's digests (``alias``): the same
        bytes, not hashed twice. The outputs of an op that may write (``fresh``: an
        in-place ``add_`` returns its input, whose version counter torch bumps only after
        the dispatch returns) are always hashed: an identity match would give them the
        bytes from before the write.
        """
        if not _recordable(t):
            info["skipped"].append(f"{slot}: {type(t).__name__} {t.layout} {t.dtype} not hashed")
            return None
        ptr = _storage(t) if kind == "input" else None
        param = self.params.get(ptr) if ptr is not None else None
        extra = {"op": oid} if param is None else {"op": oid, "param": param}
        address = t.data_ptr()
        alias = inputs.get(address) if kind == "output" else None
        # (the caller holds quiet(): the recorder's tensor calls reach no tracker)
        name = self.rec.record(oid, 0, kind, slot, t, row_mapped=param is None, extra=extra,
                               alias=alias, fresh=fresh)  # fmt: skip
        if kind == "input":
            inputs.setdefault(address, (t, self.rec.boundaries[-1]))
        info["inputs" if kind == "input" else "outputs"].append(name)
        return name


_TRAITS: dict[Any, tuple[bool, bool]] = {}


def _traits(func: Any) -> tuple[bool, bool]:
    """(may write its inputs, returns uninitialised memory) of an op, looked up once."""
    got = _TRAITS.get(func)
    if got is None:
        got = _TRAITS[func] = (not _writes_nothing(func), op_name(func) in UNINITIALISED)
    return got


def _writes_nothing(func: Any) -> bool:
    """Whether ``func`` is an ATen op whose schema writes no argument (``Tensor(a!)``).

    ATen declares every write in its schema; a custom op's schema is its author's word,
    so only ATen's is taken.
    """
    schema = getattr(func, "_schema", None)
    return (
        getattr(func, "namespace", None) == "aten" and schema is not None and not schema.is_mutable
    )


_AS_IS = {type(None), bool, int, str}


def _encode(v: Any, names: dict[int, str | None]) -> Any:
    """JSON form of an op argument; tensors become ``{"tensor": boundary name}``."""
    kind = type(v)
    if kind in _AS_IS:  # (exact types: a subclass of int, say, takes the checks below)
        return v
    if kind is list or kind is tuple:
        if all(type(x) is int for x in v):  # a size or a dim list
            return list(v)
        return [_encode(x, names) for x in v]
    if torch.is_tensor(v):
        return {"tensor": names.get(id(v))}
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else {"float": repr(v)}
    if isinstance(v, (tuple, list)):
        return [_encode(x, names) for x in v]
    if isinstance(v, torch.dtype):
        return {"dtype": str(v).removeprefix("torch.")}
    if isinstance(v, torch.device):
        return {"device": str(v)}
    if isinstance(v, torch.layout):
        return {"layout": str(v).removeprefix("torch.")}
    if isinstance(v, torch.memory_format):
        return {"memory_format": str(v).removeprefix("torch.")}
    return {"unencodable": f"{type(v).__name__}: {v!r}"[:200]}


__all__ = [
    "LAYOUT_BOUND_NOTE", "Alignment", "ModuleStack", "layout_bound", "OpInfo", "OpRecorder", "align", "is_op_boundary", "op_name",
    "op_table", "quiet",
]  # fmt: skip
