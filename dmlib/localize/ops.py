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
import difflib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dmlib.localize.captures import Capture

try:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover - reading and aligning need no torch
    torch = None  # type: ignore[assignment]
    TorchDispatchMode = object  # type: ignore[assignment,misc]

# ops whose output is uninitialised memory: hashing it would fail every repeat control
UNINITIALISED = {
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty",
    "aten.new_empty_strided", "aten.empty_permuted",
}  # fmt: skip


_QUIET = threading.local()


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Ops run inside this block (dmlib's own tensor calls) are seen by no tracker."""
    _QUIET.n = getattr(_QUIET, "n", 0) + 1
    try:
        yield
    finally:
        _QUIET.n -= 1


def op_name(func: Any) -> str:
    """``aten.addmm`` for ``aten.addmm.default``; custom ops as ``namespace.name``."""
    packet = getattr(func, "overloadpacket", None)
    return str(packet) if packet is not None else str(func)


def op_id(owner: str, name: str, k: int) -> str:
    return f"{owner}/{name}#{k}"


class ModuleStack:
    """Which selected module runs now: forward hooks push and pop (label, call)."""

    def __init__(self, selected: list[tuple[str, Any]]) -> None:
        self.selected = selected
        self.stack: list[str] = []
        self.calls: dict[str, int] = {}
        self.counts: dict[tuple[str, str], int] = {}

    def install(self) -> list[Any]:
        handles = []
        for name, mod in self.selected:
            label = name or "model"
            # pushed after and popped before other hooks: ops that hooks run are not the module's
            handles.append(mod.register_forward_pre_hook(self._push(label)))
            handles.append(mod.register_forward_hook(self._pop(label), prepend=True))
        return handles

    def _push(self, label: str):
        def hook(mod, args):
            call = self.calls.get(label, 0)
            self.calls[label] = call + 1
            self.stack.append(label if call == 0 else f"{label}#{call}")

        return hook

    def _pop(self, label: str):
        def hook(mod, args, output):
            if self.stack:
                self.stack.pop()

        return hook

    def next_id(self, func: Any) -> str | None:
        """The id of this op call, or None when no selected module runs (or in quiet())."""
        if getattr(_QUIET, "n", 0) or not self.stack:
            return None
        owner, name = self.stack[-1], op_name(func)
        k = self.counts.get((owner, name), 0)
        self.counts[(owner, name)] = k + 1
        return op_id(owner, name, k)

    def on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def __enter__(self) -> ModuleStack:
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


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
            yield from _flat(o, f"{prefix}.{i}")


def _storage(t: Any) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _recordable(t: Any) -> bool:
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and t.device.type != "meta"
        and not t.is_complex()
        and not t.is_quantized
    )


class OpRecorder(ModuleStack):
    """Records each op's tensors into a :class:`dmlib.localize.capture.Recorder`."""

    def __init__(self, rec: Any, model: Any, selected: list[tuple[str, Any]]) -> None:
        super().__init__(selected)
        self.rec = rec
        rec.ops = []
        self.params: dict[int, str] = {}
        for kind in (model.named_parameters(), model.named_buffers()):
            for n, p in kind:
                ptr = _storage(p)
                if ptr:
                    self.params.setdefault(ptr, n)

    def on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        oid = self.next_id(func)
        if oid is None:
            return func(*args, **kwargs)
        info: dict[str, Any] = {
            "id": oid,
            "op": str(func),
            "owner": oid.rpartition("/")[0],
            "inputs": [],
            "outputs": [],
            "skipped": [],
        }
        names: dict[int, str | None] = {}
        slots = [(f"input{i}", a) for i, a in enumerate(args)] + [
            (f"input.{k}", v) for k, v in kwargs.items()
        ]
        for top, value in slots:
            for slot, t in _flat(value, top):
                names[id(t)] = self._record(info, oid, "input", slot, t)
        info["args"] = [_encode(a, names) for a in args]
        info["kwargs"] = {k: _encode(v, names) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if op_name(func) in UNINITIALISED:
            info["skipped"].append("output: uninitialised memory, not hashed")
        else:
            results = out if isinstance(out, (tuple, list)) else (out,)
            for i, r in enumerate(results):
                for slot, t in _flat(r, f"output{i}"):
                    self._record(info, oid, "output", slot, t)
        self.rec.ops.append(info)
        return out

    def _record(self, info: dict[str, Any], oid: str, kind: str, slot: str, t: Any) -> str | None:
        if not _recordable(t):
            info["skipped"].append(f"{slot}: {type(t).__name__} {t.layout} {t.dtype} not hashed")
            return None
        ptr = _storage(t)
        param = self.params.get(ptr) if kind == "input" and ptr is not None else None
        extra = {"op": oid} if param is None else {"op": oid, "param": param}
        with quiet():
            name = self.rec.record(oid, 0, kind, slot, t, row_mapped=param is None, extra=extra)
        info["inputs" if kind == "input" else "outputs"].append(name)
        return name


def _encode(v: Any, names: dict[int, str | None]) -> Any:
    """JSON form of an op argument; tensors become ``{"tensor": boundary name}``."""
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


# ----------------------------------------------------------------- reading and aligning


@dataclass(frozen=True)
class OpInfo:
    """One recorded op call, as the manifest lists it."""

    id: str
    op: str
    owner: str
    inputs: list[str | None]
    outputs: list[str]
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)


def op_table(cap: Capture) -> list[OpInfo]:
    """The ops of a capture in execution order (empty for a capture made without ops)."""
    return [
        OpInfo(
            id=d["id"],
            op=d["op"],
            owner=d["owner"],
            inputs=list(d.get("inputs", [])),
            outputs=list(d.get("outputs", [])),
            args=list(d.get("args", [])),
            kwargs=dict(d.get("kwargs", {})),
            skipped=list(d.get("skipped", [])),
        )  # fmt: skip
        for d in cap.manifest.get("ops") or []
    ]


@dataclass
class Alignment:
    """How the op boundaries of capture ``a`` pair with those of ``b``.

    ``partner`` maps an op boundary name of ``a`` to its partner in ``b`` (None: unpaired);
    ``partings`` lists, per module call, where the two op sequences part.
    """

    has_ops: bool
    partner: dict[str, str | None] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    partings: list[dict[str, Any]] = field(default_factory=list)

    def name_in_b(self, name: str) -> str | None:
        return self.partner.get(name, name)

    def summary(self) -> dict[str, Any] | None:
        if not self.has_ops:
            return None
        n_paired = sum(v is not None for v in self.partner.values())
        return {
            "n_op_boundaries": len(self.partner),
            "n_paired": n_paired,
            "n_partings": len(self.partings),
            "first_parting": self.partings[0] if self.partings else None,
            "partings": self.partings[:20],
        }


def align(a: Capture, b: Capture) -> Alignment:
    """Pair the op calls of two captures module call by module call.

    Within one module call, :class:`difflib.SequenceMatcher` (no junk heuristic) finds
    the longest matching runs of op overloads; ops are paired only inside those runs
    (same overload, same position in the run), inputs and outputs by slot. Every stretch
    outside a matching run is a parting, recorded with both sides' ops.
    """
    ta, tb = op_table(a), op_table(b)
    al = Alignment(has_ops=bool(ta or tb))
    if not ta:
        return al
    by_owner_b: dict[str, list[OpInfo]] = {}
    for o in tb:
        by_owner_b.setdefault(o.owner, []).append(o)
    by_owner_a: dict[str, list[OpInfo]] = {}
    for o in ta:
        by_owner_a.setdefault(o.owner, []).append(o)
    for o in ta:
        for n in [*o.inputs, *o.outputs]:
            if n is not None:
                al.partner[n] = None
    for owner, seq_a in by_owner_a.items():
        seq_b = by_owner_b.get(owner, [])
        sm = difflib.SequenceMatcher(
            None, [o.op for o in seq_a], [o.op for o in seq_b], autojunk=False
        )
        for tag, i1, i2, j1, j2 in sm.get_opcodes():
            if tag == "equal":
                for x, y in zip(seq_a[i1:i2], seq_b[j1:j2], strict=True):
                    _pair(al, x, y)
                continue
            parting = {
                "owner": owner,
                "at": seq_a[i1].id if i1 < len(seq_a) else f"{owner} (end)",
                "a_ops": [o.id for o in seq_a[i1:i2]][:8],
                "b_ops": [o.id for o in seq_b[j1:j2]][:8],
            }
            al.partings.append(parting)
            why = (
                f"not judged: op sequences of {owner} part here: a runs {len(seq_a[i1:i2])} op(s) "
                f"({', '.join(o.op for o in seq_a[i1:i2][:3])}) where b runs "
                f"{len(seq_b[j1:j2])} ({', '.join(o.op for o in seq_b[j1:j2][:3]) or 'none'})"
            )
            for o in seq_a[i1:i2]:
                for n in [*o.inputs, *o.outputs]:
                    if n is not None:
                        al.notes[n] = why
    order = {o.id: i for i, o in enumerate(ta)}
    al.partings.sort(key=lambda p: order.get(p["at"], len(order)))
    return al


def _slot(name: str, oid: str) -> str:
    return "output0" if name == oid else name[len(oid) + 1 :]


def _pair(al: Alignment, x: OpInfo, y: OpInfo) -> None:
    slots_b = {_slot(n, y.id): n for n in [*y.inputs, *y.outputs] if n is not None}
    for n in [*x.inputs, *x.outputs]:
        if n is None:
            continue
        partner = slots_b.get(_slot(n, x.id))
        al.partner[n] = partner
        if partner is None:
            al.notes[n] = f"not judged: paired op {y.id} has no tensor in this slot"


LAYOUT_BOUND_NOTE = (
    "not judged: op tensor hashed whole (no batch x sequence rows): it may hold other requests' data, "
    "so it is not comparable across layouts"
)


def layout_bound(a: Capture, b: Capture, ba: Any, bb: Any) -> bool:
    """True for an op tensor hashed whole (not a parameter) in two different layouts.

    A reduction over the batch, or attention scores, can have one shape in both layouts
    and still mix in other requests: comparing its whole hash would report a difference
    that says nothing about the request.
    """
    if ba.row_mapped or bb.row_mapped:
        return False
    ea = a.manifest["boundaries"][ba.index]
    eb = b.manifest["boundaries"][bb.index]
    if "op" not in ea or "param" in ea or "param" in eb:
        return False
    rows_a = None if a.row_map is None else a.row_map.entries
    rows_b = None if b.row_map is None else b.row_map.entries
    return rows_a != rows_b


def is_op_boundary(cap: Capture, name: str) -> bool:
    entry = cap.manifest["boundaries"][cap.boundary(name).index]
    return "op" in entry


__all__ = [
    "LAYOUT_BOUND_NOTE", "Alignment", "ModuleStack", "layout_bound", "OpInfo", "OpRecorder", "align", "is_op_boundary", "op_name",
    "op_table", "quiet",
]  # fmt: skip
