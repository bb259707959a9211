"""What a comparison of two captures concludes: each boundary's role (the culprit where
the divergence enters, the entry, carriers, secondary outputs), the summary of the frame's
attrs, and :class:`CaptureVerdict`, the typed answer the command line prints and exits on.

:func:`dmlib.localize.boundaries.compare_captures` fills the rows; this room reads them.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass
from typing import Any

import pandas as pd

from dmlib.kernels.verdict import Verdict
from dmlib.localize.capture.format import (
    LAYOUT_INPUTS,
    Boundary,
    is_layout_slot,
    layer_of,
)
from dmlib.localize.capture.reader import Capture
from dmlib.localize.expertjudge import absent_reason, concerns, expert_lines, expert_role, up_name
from dmlib.localize.gradients import backward_lines
from dmlib.localize.opalign import Alignment
from dmlib.localize.routing import flip_lines
from dmlib.textsafe import escape

SECONDARY_NOTE = (
    "a secondary output of an op whose first output matches (e.g. attention's logsumexp): "
    "never the culprit"
)


COLUMNS = [
    "boundary", "module", "kind", "role", "identical", "n_diff", "n_diff_rows", "max_abs",
    "rel_fro", "max_ulp", "diff_blocks", "new_blocks", "inherited_blocks",
]  # fmt: skip


def _steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Per forward pass (decode step) of a multi-pass capture: its first divergent boundary."""
    steps = sorted({r["_step"] for r in rows})
    if len(steps) < 2:
        return None
    out = []
    for s in steps:
        mine = [r for r in rows if r["_step"] == s]
        first = next((r for r in mine if r["identical"] is False), None)
        culprit = next((r["boundary"] for r in mine if r["role"] == "culprit"), None)
        out.append({"step": s, "n_boundaries": len(mine),
                    "first_divergent_boundary": None if first is None else first["boundary"],
                    "culprit": culprit,
                    # the state of the pass before that brought the difference in, if one did
                    "state_consumed": None if first is None else first.get("_carries")})  # fmt: skip
    return out


def _op_summary(rows: list[dict[str, Any]], alignment: Alignment) -> dict[str, Any]:
    """First divergent op, culprit op, and where the op sequences part (None: no ops)."""
    op_rows = [r for r in rows if r["_op"]]  # op boundaries (KINDS: op-input, op-output)
    return {
        "first_divergent_op": next(
            (r["boundary"] for r in op_rows if r["identical"] is False), None
        ),
        "culprit_op": next((r["boundary"] for r in op_rows if r["role"] == "culprit"), None),
        "op_alignment": alignment.summary(),
    }


def _frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The rows as the documented columns, with nullable dtypes."""
    df = pd.DataFrame(rows).drop(
        columns=[
            "_stats",
            "call",
            "_layout",
            "_slot",
            "_step",
            "_op",
            "_state",
            "_carries",
            "_router",
            "_expert",
        ],
        errors="ignore",
    )
    df["identical"] = df["identical"].astype("boolean")
    for c in ("n_diff", "n_diff_rows", "max_ulp"):
        df[c] = df[c].astype("Int64")
    for c in ("max_abs", "rel_fro"):
        df[c] = df[c].astype("Float64")
    if "diff_positions" not in df:
        df["diff_positions"] = None
    else:
        col = df["diff_positions"].astype(object)
        df["diff_positions"] = col.where(col.notna(), None)
    # positions (of the one request compared) whose rows differ, where both were dumped
    return df[[*COLUMNS, "note", "diff_positions"]]


def _is_layout(x: Boundary, patterns: tuple[str, ...]) -> bool:
    """A layout input: flagged so by the capture, or an input slot or name the patterns match."""
    if x.layout:
        return True
    if x.kind != "input" or x.cache:
        return False
    return is_layout_slot(x.slot, patterns) or any(fnmatch.fnmatchcase(x.name, p) for p in patterns)


def _summary(
    a: Capture,
    b: Capture,
    requests: list[str],
    index: list[tuple[str, int, int, int]],
    rows: list[dict[str, Any]],
    paired: set[str] | frozenset[str] = frozenset(),
    layout_inputs: tuple[str, ...] = LAYOUT_INPUTS,
) -> dict[str, Any]:
    """The attrs that summarise a comparison: first divergence, culprits, counts."""
    stats_missing = [r["boundary"] for r in rows if r["identical"] is False and not r["_stats"]]
    secondary = [r for r in rows if r["identical"] is False and r["role"] == "secondary"]
    diverged = [r for r in rows if r["identical"] is False and r["role"] != "secondary"]
    culprits = [r["boundary"] for r in rows if r["role"] == "culprit"]
    entries = [r["boundary"] for r in rows if r["role"] == "entry"]
    layout = [r["boundary"] for r in rows if r["_layout"]]
    unjudged = [
        {"boundary": r["boundary"], "reason": (r["note"] or "").removeprefix("not judged: ")}
        for r in rows
        if r["identical"] is None and not r["_layout"]
    ]
    absent = [
        x for x in b.boundaries
        if x.name not in a and x.name not in paired  # an aligned op's partner is judged
        and concerns(x, a, requests)  # (an expert hit by other requests only: not theirs)
    ]  # fmt: skip
    layout += [x.name for x in absent if _is_layout(x, layout_inputs)]
    unjudged += [
        {"boundary": x.name, "reason": absent_reason(x, a)}
        for x in absent
        if not _is_layout(x, layout_inputs)
    ]
    outputs = [
        r for r in rows if r["module"] == a.root and r["kind"] == "output" and not r["_state"]
    ]
    outputs_match = bool(outputs) and all(r["identical"] is True for r in outputs)
    # a state the model left is an output too: never "identical" with one not judged
    states_unjudged = [r for r in rows if r["_state"] and r["identical"] is None]
    not_captured = [
        {"capture": side, **u} for side, c in (("A", a), ("B", b)) for u in c.not_captured
    ]
    if diverged or secondary:
        status = "different"
    elif (unjudged and not outputs_match) or states_unjudged or not_captured:
        status = "inconclusive"
    else:
        status = "identical"
    judged = [r["boundary"] for r in rows if r["identical"] is True]
    return {
        "a": str(a.path),
        "b": str(b.path),
        "requests": requests,
        "block_rows": a.block_rows,
        "block_index": [list(t) for t in index],
        "first_divergent_boundary": (diverged or secondary)[0]["boundary"]
        if (diverged or secondary)
        else None,
        "culprit": culprits[0] if culprits else None,
        "culprits": culprits,
        "undetermined": [r["boundary"] for r in rows if r["role"] == "undetermined"],
        "entry": entries[0] if entries else None,
        "layout_inputs": layout,
        "secondary": [r["boundary"] for r in secondary],
        "n_boundaries": len(rows),
        "n_comparable": sum(r["identical"] is not None for r in rows),
        "n_divergent": len(diverged),
        "status": status,
        "unjudged": unjudged,
        "outputs_match": outputs_match,
        "not_captured": not_captured,
        # the last boundary (in execution order) up to which all judged ones match, where
        # the answer is inconclusive only for what was not captured or judged
        "identical_up_to": judged[-1] if status == "inconclusive" and judged else None,
        "stats_missing": stats_missing,
        "stats_note": (
            f"{len(stats_missing)} divergent boundaries were not dumped in both captures: "
            "element statistics are null there (hashes only)"
            if stats_missing
            else "element statistics available wherever a boundary differs"
        ),
    }


ROOT_NOTE = (
    "the model itself: the difference enters in a part of the pass no hooked module shows "
    "(hook its submodules to name where); never the culprit"
)
STATE_NOTE = (
    "nothing recorded in this pass that feeds it differs (its layer's boundaries, where "
    "they were recorded; else everything before it): the difference enters where this "
    "state is written"
)
_layer_of = layer_of  # the layer index in a module or cache path (capture.format)


def _consumed(
    r: dict[str, Any], states: dict[int, list[dict[str, Any]]]
) -> tuple[str, str, str] | None:
    """(role, note, state) of a would-be culprit of a later pass when a state the pass
    before left behind differs: carrier of that state where it is the module's (or the
    state's) layer's, else undetermined (a state: carrier of the pass's states)."""
    prior = states.get(r["_step"] - 1)
    if not prior:
        return None
    layer = _layer_of(r["_slot"] if r["_state"] else r["module"])
    mine = [x["boundary"] for x in prior if layer is not None and _layer_of(x["_slot"]) == layer]
    if mine:
        return "carrier", f"inputs identical, but the state it consumed differs: {mine[0]}", mine[0]
    names = ", ".join(x["boundary"] for x in prior[:3])
    note = f"inputs identical, but a state the pass consumed differs: {names}"
    return ("carrier" if r["_state"] else "undetermined"), note, prior[0]["boundary"]


def _add_note(r: dict[str, Any], extra: str) -> None:
    r["note"] = f"{r['note']}; {extra}" if r["note"] else extra


def _state_role(r: dict[str, Any], states: dict[int, list[dict[str, Any]]], after: bool) -> bool:
    """Set a differing state's role: a carrier where something before it in its pass
    differs (``after``) or where it carries on the state the pass before left; else the
    culprit (returns True then)."""
    got = None if after else _consumed(r, states)
    if after:
        r["role"] = "carrier"
    elif got is not None:  # the state the pass before left differs: carried on
        r["role"], r["_carries"] = "carrier", got[2]
        _add_note(r, got[1])
    else:
        r["role"] = "culprit"
        _add_note(r, STATE_NOTE)
    return r["role"] == "culprit"


def _calls(
    rows: list[dict[str, Any]],
) -> tuple[dict[tuple[str, int], list[dict[str, Any]]], dict[tuple[str, int], dict[str, Any]]]:
    """Per (module, call): its judged-or-not inputs (no layout input), its first output."""
    inputs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    firsts: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        if r["kind"] == "input" and not r["_layout"]:
            inputs.setdefault((r["module"], r["call"]), []).append(r)
        elif r["kind"] == "output" and r["_slot"] == "output0":
            firsts[(r["module"], r["call"])] = r
    return inputs, firsts


def _roles(rows: list[dict[str, Any]], root: str | None = None) -> None:
    """Fill role, new_blocks and inherited_blocks (in place).

    ``culprit``: an output whose inputs were all judged and all match while it differs (a
    module's output, or an op's first output; with an input not judged it is
    ``undetermined``, the input named in its note); ``entry``: an input that differs before anything
    recorded does (its producer was not captured); ``carrier``: differs because an input
    does; ``secondary``: an op's other output differing while its first output matches;
    ``layout``: a layout input, never judged; ``unjudged`` / ``clean`` as they say.
    A state (what a pass leaves in its cache) is a carrier where something recorded before
    it in its pass differs, else the culprit; an output of a later pass whose inputs match
    carries a differing state the pass before left (its layer's), or is undetermined. The
    model itself (``root``) is never the culprit.
    """
    states: dict[int, list[dict[str, Any]]] = {}  # pass -> its differing states
    step_diff: set[int] = set()  # passes where something not a state differs
    layers = _PassLayers()  # per pass, the layers recorded and those differing
    inputs, firsts = _calls(rows)
    names = {r["boundary"]: r for r in rows}
    seen_diff: set[int] = set()
    seen_any = False
    candidates: list[dict[str, Any]] = []
    for r in rows:
        diff = set(r["diff_blocks"])
        base = seen_diff
        if r["_layout"]:
            r["role"] = "layout"
        elif r["identical"] is None:
            r["role"] = "unjudged"
        elif r["identical"]:
            r["role"] = "clean"
        elif r["_router"]:
            # the chosen experts: a discrete event, the expert set of some token changed
            # (the routing report says which); the margins follow the router's scores
            r["role"] = "flip" if r["_slot"] == "router.indices" else "carrier"
        elif r.get("_expert"):
            if _expert_role(r, inputs, names, states):
                base = set()
                candidates.append(r)
        elif r["_state"]:
            states.setdefault(r["_step"], []).append(r)
            if _state_role(r, states, layers.state_after(r, step_diff)):
                base = set()
        elif r["kind"] == "output":
            ins = [
                i for i in inputs.get((r["module"], r["call"]), []) if i["identical"] is not None
            ]
            first = firsts.get((r["module"], r["call"]))
            if (
                r["_op"]
                and r["_slot"] != "output0"
                and first is not None
                and (first["identical"] is True)
            ):
                r["role"] = "secondary"
                r["note"] = r["note"] or SECONDARY_NOTE
            elif not ins:
                r["role"] = "undetermined"
            elif all(i["identical"] for i in ins) and (unknown := _unjudged_inputs(inputs, r)):
                # identical where judged, but an input was not judged (a rolling KV cache,
                # a tensor absent from one capture): it may have brought the difference in
                r["role"] = "undetermined"
                _add_note(r, f"inputs identical where judged; not judged: {', '.join(unknown[:4])}")
            elif all(i["identical"] for i in ins) and (got := _consumed(r, states)):
                r["role"], extra, r["_carries"] = got
                _add_note(r, extra)
            elif all(i["identical"] for i in ins) and r["module"] == root:
                r["role"] = "undetermined"
                _add_note(r, ROOT_NOTE)
            elif all(i["identical"] for i in ins):
                r["role"] = "culprit" if r["_slot"] == "output0" or not r["_op"] else ("secondary")
                base = set()
                if r["role"] == "culprit":
                    candidates.append(r)
            else:
                r["role"] = "carrier"
                base = set().union(*(set(i["diff_blocks"]) for i in ins))
        elif r["_step"] not in step_diff and (got := _consumed(r, states)):
            r["role"], r["_carries"] = "carrier", got[2]  # brought in by the state consumed
            _add_note(r, got[1].replace("inputs identical, but ", ""))
        else:
            r["role"] = "carrier" if seen_any else "entry"
        r["new_blocks"] = sorted(diff - base)
        r["inherited_blocks"] = sorted(diff & base)
        layers.note(r)
        if r["identical"] is False and r["role"] != "secondary":
            seen_any = True
            seen_diff |= diff
            if not r["_state"]:
                step_diff.add(r["_step"])
    _enclosing(candidates)


class _PassLayers:
    """Per pass, the layers (``layers.i`` in a module's name) with a boundary recorded and
    those with one differing: what a state of layer i may have been fed by."""

    def __init__(self) -> None:
        self.seen: dict[int, set[str]] = {}
        self.diff: dict[int, set[str]] = {}

    def note(self, r: dict[str, Any]) -> None:
        layer = None if r["_state"] else _layer_of(r["module"])
        if layer is not None:
            self.seen.setdefault(r["_step"], set()).add(layer)
            if r["identical"] is False and r["role"] != "secondary":
                self.diff.setdefault(r["_step"], set()).add(layer)

    def state_after(self, r: dict[str, Any], step_diff: set[int]) -> bool:
        """Whether a differing state follows a difference recorded before it in its pass.

        A state of layer i (``layers.i`` in its cache path) is written by layer i from what
        entered that layer: where layer i's boundaries were recorded in the pass, only a
        difference among them can have brought it in (a later layer's, recorded before the
        cache is walked at the pass's end, cannot); else anything differing in the pass."""
        layer, step = _layer_of(r["_slot"]), r["_step"]
        if layer is not None and layer in self.seen.get(step, ()):
            return layer in self.diff.get(step, ())
        return step in step_diff


def _enclosing(candidates: list[dict[str, Any]]) -> None:
    """A module whose inputs are clean but that contains a recorded culprit (a submodule's,
    or an expert's rows of its own call) only encloses it (in place)."""
    for r in candidates:
        inner = (r["module"] + ".", r["module"] + "/")
        if any(o is not r and o["module"].startswith(inner) for o in candidates) or any(
            o.get("_expert")
            and not r.get("_expert")
            and (o["module"], o["call"]) == (r["module"], r["call"])
            for o in candidates
        ):
            r["role"] = "encloses-culprit"


def _expert_role(
    r: dict[str, Any],
    inputs: dict[tuple[str, int], list[dict[str, Any]]],
    names: dict[str, dict[str, Any]],
    states: dict[int, list[dict[str, Any]]],
) -> bool:
    """Set a differing expert row's role, judged against the experts module's inputs of
    the call and, for down_proj, the same expert's gate_up_proj rows, and, as any output
    whose inputs match, against a state the pass before left (a decode step); True: the
    culprit."""
    up = names.get(up_name(r["boundary"], names)) if r["_slot"].endswith(".down_proj") else None
    r["role"], note = expert_role(r, inputs.get((r["module"], r["call"]), []), up)
    if r["role"] == "culprit" and (got := _consumed(r, states)):
        r["role"], note, r["_carries"] = got
    if note and (r["role"] != "carrier" or r.get("_carries")):
        _add_note(r, str(note))
    return bool(r["role"] == "culprit")


def _unjudged_inputs(
    inputs: dict[tuple[str, int], list[dict[str, Any]]], r: dict[str, Any]
) -> list[str]:
    """The names of output row ``r``'s module-call inputs that were not judged."""
    return [
        i["boundary"] for i in inputs.get((r["module"], r["call"]), []) if i["identical"] is None
    ]


def unjudged_line(df: pd.DataFrame, limit: int = 6) -> str:
    """``name (reason); ...`` for the boundaries that could not be judged, on one line."""
    return _unjudged_text(df.attrs["unjudged"], limit)


def _unjudged_text(items: list[dict[str, Any]], limit: int = 6) -> str:
    text = "; ".join(f"{u['boundary']} ({u['reason']})" for u in items[:limit])
    return text + (f"; and {len(items) - limit} more" if len(items) > limit else "")


@dataclass(frozen=True, eq=False)
class CaptureVerdict(Verdict):
    """The answer of :func:`compare_captures`, read from its frame's attrs.

    True only when ``status`` is ``"identical"`` and no control failed (an inconclusive
    comparison, a divergence, a repeat that did not hold or a planted change that went
    unseen are False); ``str()`` is the text the command line prints under the table;
    ``to_dict()`` holds the attrs it rests on, with their values.
    """

    status: str
    n_comparable: int
    unjudged: list[dict[str, Any]]
    first_divergent_boundary: str | None
    culprit: str | None
    culprits: list[str]
    undetermined: list[str]
    entry: str | None
    culprit_op: str | None
    op_alignment: dict[str, Any] | None
    layout_inputs: list[str]
    stats_missing: list[str]
    repeat_control: dict[str, Any] | None
    negative_control: dict[str, Any]
    valid: bool | None
    not_captured: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    identical_up_to: str | None = None
    routing: dict[str, Any] | None = None
    # a full-sequence capture against prefill + decode passes: the first divergence's pass
    first_divergent_position: dict[str, Any] | None = None
    backward: dict[str, Any] | None = None  # the backward's own summary (gradients.py)
    experts: dict[str, Any] | None = None  # the expert rows (expertjudge.expert_summary)

    @classmethod
    def of(cls, df: pd.DataFrame) -> CaptureVerdict:
        """The verdict of a :func:`compare_captures` frame."""
        at = df.attrs
        names = [f.name for f in dataclasses.fields(cls)]
        lists = ("layout_inputs", "undetermined", "not_captured")
        return cls(**{n: at.get(n, [] if n in lists else None) for n in names})

    @property
    def failed_control(self) -> bool:
        """A repeat control that did not hold, or a negative control that failed."""
        rc, nc = self.repeat_control, self.negative_control
        return (rc is not None and not rc["held"]) or nc["passed"] is False

    def __bool__(self) -> bool:
        return self.status == "identical" and not self.failed_control

    def __str__(self) -> str:
        return "\n".join([*self._answer_both(), *self._context(), *self._controls()])

    def _answer(self) -> list[str]:
        """The status, first divergence and culprit lines."""
        n_un, un = len(self.unjudged), _unjudged_text(self.unjudged)
        if self.status == "inconclusive":
            head = f"inconclusive: no difference in {self.n_comparable} judged boundaries"
            if self.identical_up_to:
                head += f" (identical up to {self.identical_up_to})"
            if n_un:
                head += (f", but {n_un} could not be judged and the model's outputs were not "
                         f"shown to match: {un}")  # fmt: skip
            lines = [head]
            if self.not_captured:
                nc = self.not_captured
                what = "; ".join(f"{u['what']} in {u['capture']} ({u['reason']})" for u in nc[:4])
                more = f"; and {len(nc) - 4} more" if len(nc) > 4 else ""
                lines.append(f"not captured, so not shown identical: {what}{more}")
            return lines
        if self.status == "identical":
            if n_un:
                return [
                    f"identical: the model's outputs match; {n_un} inner boundaries could not "
                    f"be judged: {un}"
                ]
            return [f"identical: all {self.n_comparable} boundaries match"]
        lines = [f"first divergent boundary: {self.first_divergent_boundary}"]
        if self.first_divergent_position is not None:
            lines.append(f"  at {escape(str(self.first_divergent_position['note']))}")
        if self.culprit is not None or self.entry is None:
            lines.append(f"culprit (inputs identical, output differs): {self.culprit}")
        if self.entry is not None and self.culprit is None:
            lines.append(
                f"the difference enters at an input: {self.entry} (the module making it was "
                "not captured; hook it, or capture with ops=True, to name the culprit)"
            )
        if len(self.culprits) > 1:
            lines.append(f"other entry points: {', '.join(self.culprits[1:6])}")
        if self.undetermined:
            more = f" and {len(self.undetermined) - 6} more" if len(self.undetermined) > 6 else ""
            lines.append(
                "differs, but no culprit claimed there (an input not judged, a state the "
                "pass consumed, or the model's own output: see the note): "
                + ", ".join(self.undetermined[:6])
                + more
            )
        if self.op_alignment is not None:
            lines.append(f"culprit op (inputs identical, output differs): {self.culprit_op}")
        if n_un:
            lines.append(f"not judged ({n_un}): {un}")
        return lines

    def _answer_both(self) -> list[str]:
        """The forward's answer, then the backward's (where the captures recorded one)."""
        fwd = self._answer()
        if self.backward is None:
            return fwd
        if self.first_divergent_boundary is None and self.backward["status"] == "different":
            fwd = ["forward: no divergent boundary"]
        return [*fwd, *backward_lines(self.backward)]

    def _context(self) -> list[str]:
        """Op alignment, layout inputs and missing statistics."""
        lines = []
        oa = self.op_alignment
        if oa is not None:
            fp = oa["first_parting"]
            where = (
                "no parting"
                if fp is None
                else f"first parting at {fp['at']} ({oa['n_partings']} in all)"
            )
            lines.append(
                f"op sequences: {oa['n_paired']} of {oa['n_op_boundaries']} op boundaries "
                f"paired; {where}"
            )
        if self.layout_inputs:
            lay = self.layout_inputs
            lines.append(
                f"layout inputs ({len(lay)}, not judged: they follow the batch layout, not the "
                f"request): {', '.join(lay[:4])}"
                + (f" and {len(lay) - 4} more" if len(lay) > 4 else "")
            )
        lines += flip_lines(self.routing)
        lines += expert_lines(self.experts)
        if self.stats_missing:
            lines.append(
                f"statistics: '-' at {len(self.stats_missing)} differing boundaries: they were "
                "not dumped in both captures (hashes say where, not by how much; capture with "
                "dump= matching them for element statistics)"
            )
        return lines

    def _controls(self) -> list[str]:
        """The repeat and negative controls, and validity."""
        rc = self.repeat_control
        n_inc = 0 if rc is None else sum(c.get("n_incomparable", 0) for c in rc["checks"])
        lines = [
            "repeat control: not run"
            if rc is None
            else f"repeat control: {'held' if rc['held'] else 'FAILED'}"
            + (f" ({n_inc} boundaries hashed with two schemes: not comparable)" if n_inc else "")
        ]
        nc = self.negative_control
        if nc["passed"] is None:
            why = next((c.get("reason") for c in nc["checks"] if c.get("reason")), None)
            lines.append(
                "negative control: not run"
                + (f" ({why}: the planted one-bit check needs a dumped boundary)" if why else "")
            )
        else:
            lines.append(f"negative control: {'passed' if nc['passed'] else 'FAILED'}")
        lines.append(f"valid: {self.valid}")
        return lines


def capture_verdict(df: pd.DataFrame) -> str:
    """A few lines of plain text: the answer, first divergence, culprit, controls, validity
    (``str()`` of :class:`CaptureVerdict`)."""
    return str(CaptureVerdict.of(df))


__all__ = ["CaptureVerdict", "capture_verdict", "unjudged_line"]
