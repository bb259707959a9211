"""Reading and aligning op-level captures (no torch needed).

:func:`op_table` lists a capture's recorded ops; :func:`align` pairs the op sequences of
two captures module call by module call (the same module may run other ops in another
layout): only ops with the same overload in a matched run of the sequence are paired,
and where the sequences part is reported. The recording side is :mod:`dmlib.localize.ops`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

from dmlib.localize.capture.reader import Capture

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
        """The name in ``b`` of boundary ``name`` of ``a``: an op boundary's partner (None:
        unpaired); any other name is its own.
        """
        return self.partner.get(name, name)

    def summary(self) -> dict[str, Any] | None:
        """Counts of op boundaries, pairs and partings, the first parting and the first 20 of
        them; None for captures without ops.
        """
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
    """Whether boundary ``name`` of ``cap`` is an op's tensor (its manifest entry has ``op``)."""
    entry = cap.manifest["boundaries"][cap.boundary(name).index]
    return "op" in entry


__all__ = [
    "LAYOUT_BOUND_NOTE", "Alignment", "OpInfo", "align", "is_op_boundary", "layout_bound",
    "op_table",
]  # fmt: skip
