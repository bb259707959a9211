"""Compare two captures boundary by boundary: where does the divergence first enter?

Identity comes from the per-request hashes (so two layouts of the same request are
comparable), element statistics from dumped tensors where both captures have them.
A boundary whose recorded inputs are identical but whose output differs is where the
divergence enters (``role="culprit"``); boundaries that differ because an input already
differs only carry it (``"carrier"``). Two controls qualify the verdict: a repeat control
(two captures of one layout must be byte-identical, else differences between layouts
cannot be told from run-to-run noise) and a negative control (the comparison must detect
a planted one-bit change, and optionally a different input).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from dmlib import hashing
from dmlib.dtypes import is_float
from dmlib.errors import CaptureError
from dmlib.localize.capture.format import (
    LAYOUT_INPUTS,
    TREE,
    XXH_TREE,
    Boundary,
    boundary_name,
    request_key,
    same_scheme,
)
from dmlib.localize.capture.reader import Capture, judge_heads, lift_blake3, open_capture
from dmlib.localize.controls import (
    NO_STATS,
    CaptureLike,
    _negatives,
    _repeats,
    element_stats,
    planted_control,
    repeat_control,
)
from dmlib.localize.culprits import (
    CaptureVerdict,
    _frame,
    _is_layout,
    _op_summary,
    _roles,
    _steps,
    _summary,
    capture_verdict,
    unjudged_line,
)
from dmlib.localize.expertjudge import concerns, expert_summary, judge_expert, within_experts
from dmlib.localize.gradients import backward_roles, backward_summary, split_backward
from dmlib.localize.opalign import LAYOUT_BOUND_NOTE, Alignment, align, layout_bound
from dmlib.localize.positions import across_passes, compare_positions
from dmlib.localize.recorded import recorded_roles
from dmlib.localize.routing import flip_notes, routing_report

LAYOUT_NOTE = "layout input: follows the batch layout, not the request's data (not judged)"


def diff_positions(a: np.ndarray, b: np.ndarray) -> list[int]:
    """The rows (a request's positions) holding a differing bit pattern, in order: the
    per-position view of a difference (a flipped token standing out), finer than blocks."""
    if a.ndim == 0 or a.shape[0] == 0 or a.size == 0:
        return []
    ua = np.ascontiguousarray(a).reshape(a.shape[0], -1).view(np.uint8)
    ub = np.ascontiguousarray(b).reshape(b.shape[0], -1).view(np.uint8)
    return [int(i) for i in np.nonzero((ua != ub).any(axis=1))[0]]


def _requests(a: Capture, b: Capture, request: Any) -> list[str]:
    if request is not None:
        key = request_key(request)
        for c in (a, b):
            if key not in c.requests:
                raise CaptureError(
                    f"request {request!r} is not in this capture (it has {sorted(c.requests)})",
                    path=c.path,
                )
        return [key]
    return sorted(set(a.requests) & set(b.requests))


def _block_index(a: Capture, requests: list[str]) -> list[tuple[str, int, int, int]]:
    out = []
    for r in requests:
        n = a.requests[r]
        for k, start in enumerate(range(0, n, a.block_rows)):
            out.append((r, k, start, min(n, start + a.block_rows)))
    return out


def _attribute(c: Capture, x: Boundary, r: str) -> tuple[str | None, Any]:
    """How boundary ``x`` of capture ``c`` holds request ``r``.

    ``("token", RequestHash)`` (rows per position), ``("sequence", (row, digest))`` (first
    axis = batch: the row the request fills), ``("mixed", reason)`` (first axis = batch,
    but no row belongs to the request alone), ``("unknown", reason)`` (batch size unknown)
    or ``(None, reason)`` (no batch axis).
    """
    if x.row_mapped or (x.cache and r in x.requests):
        return "token", x.requests[r]
    if c.batch is None or c.row_map is None:
        return (
            "unknown",
            "batch size unknown (no [batch, seq, ...] boundary; pass a nested row_map)",
        )
    if not x.shape or x.shape[0] != c.batch:
        return None, f"first axis {list(x.shape[:1])} is not the batch ({c.batch})"
    if x.leading is None:
        return "mixed", "no per-row hashes recorded"
    row, why = c.row_map.sequence_row(r)
    if row is None:
        return "mixed", why
    return "sequence", (row, x.leading[row])


def _judge_request(
    a: Capture, b: Capture, ba: Boundary, bb: Boundary, r: str, offsets: dict[str, int]
) -> tuple[bool | None, list[int], str | None]:
    """(identical or None if it cannot be judged, differing global block ids, note)."""
    ka, va = _attribute(a, ba, r)
    kb, vb = _attribute(b, bb, r)
    if ka == kb == "token":
        if ba.cache or bb.cache:
            return _judge_cache(ba, bb, va, vb, r)
        if ba.dtype != bb.dtype:
            blocks = [offsets[r] + k for k in range(len(va.blocks))]
            return (
                False,
                blocks,
                f"row {ba.dtype}{list(ba.row_shape)} vs {bb.dtype}{list(bb.row_shape)}",
            )
        if ba.row_shape != bb.row_shape:
            heads = judge_heads(ba, bb, r)  # grouped KV heads repeated in one layout only
            if heads is not None:
                return heads[0], [], heads[1]
            return None, [], "not judged: " + _shape_reason(a, b, ba.row_shape, bb.row_shape)
        diff = [
            offsets[r] + k
            for k, (x, y) in enumerate(zip(va.blocks, vb.blocks, strict=True))
            if x != y
        ]
        return va.digest == vb.digest, diff, None
    if ka == kb == "sequence":
        note = f"per sequence (batch row {va[0]} vs {vb[0]})"
        if ba.dtype != bb.dtype:
            return (
                False,
                [],
                f"{note}: row {ba.dtype}{list(ba.shape[1:])} vs {bb.dtype}{list(bb.shape[1:])}",
            )
        if ba.shape[1:] != bb.shape[1:]:
            why = _shape_reason(a, b, ba.shape[1:], bb.shape[1:])
            return None, [], f"not judged: {note}: {why}"
        return va[1] == vb[1], [], note
    # without the batch size, a first axis may be the batch: a whole tensor stands for the
    # request only when both captures place every request on the same rows
    same_rows = (
        a.row_map is not None and b.row_map is not None and a.row_map.entries == b.row_map.entries
    )
    if (ba.rolled or bb.rolled) and not same_rows:
        return None, [], ROLLED_NOTE
    blocked = "mixed" in (ka, kb) or ("unknown" in (ka, kb) and not same_rows)
    if not blocked and ba.shape == bb.shape and ba.dtype == bb.dtype:
        return (
            ba.digest == bb.digest,
            [],
            "compared whole (no batch axis to attribute; shapes agree)",
        )
    why = (
        "; ".join(
            f"in {side}: {v}"
            for side, k, v in (("A", ka, va), ("B", kb, vb))
            if k in (None, "mixed", "unknown")
        )
        or "rows per position in one capture, per sequence in the other"
    )
    shapes = (
        ""
        if (ba.shape, ba.dtype) == (bb.shape, bb.dtype)
        else f"; {ba.dtype}{list(ba.shape)} vs {bb.dtype}{list(bb.shape)}"
    )
    return None, [], f"not judged: rows of request {r!r} not attributable {why}{shapes}"


def _positions(c: Capture) -> int | None:
    """Positions per batch row of a capture's layout (None: batch size unknown)."""
    rm = c.row_map
    return None if rm is None or not rm.batch else len(rm) // rm.batch


def _shape_reason(a: Capture, b: Capture, sa: tuple[int, ...], sb: tuple[int, ...]) -> str:
    """Why two shapes of one request's rows say nothing about its values."""
    la, lb = _positions(a), _positions(b)
    if len(sa) == len(sb):
        odd = [i for i, (x, y) in enumerate(zip(sa, sb, strict=True)) if x != y]
        if la is not None and lb is not None and all((sa[i], sb[i]) == (la, lb) for i in odd):
            return (
                f"the row's shape follows the layout ({list(sa)} vs {list(sb)}: "
                f"{la} vs {lb} positions per batch row)"
            )
        if len(odd) == 1:
            x, y = sa[odd[0]], sb[odd[0]]
            if max(x, y) % min(x, y) == 0 and min(x, y) > 0:
                return (
                    f"head layout differs ({list(sa)} vs {list(sb)}: {x} vs {y} along axis "
                    f"{odd[0]} of the row, e.g. grouped KV heads repeated in one layout only); "
                    "an equivalence, not a difference"
                )
    return f"row shapes differ between layouts ({list(sa)} vs {list(sb)})"


def _judge_cache(
    ba: Boundary, bb: Boundary, va: Any, vb: Any, r: str
) -> tuple[bool | None, list[int], str | None]:
    """A request's KV-cache rows (per position: heads x head_dim) in two captures."""
    ha, hb = (ba.shape[1], ba.shape[3]), (bb.shape[1], bb.shape[3])
    if not (ba.cache and bb.cache) or ha != hb or ba.dtype != bb.dtype:
        return None, [], (f"not judged: KV cache rows {ba.dtype}{list(ha)} vs {bb.dtype}{list(hb)}")
    if va.n_rows != vb.n_rows:
        return (
            None,
            [],
            (
                f"not judged: the KV cache holds {va.n_rows} positions of request {r!r} in A, "
                f"{vb.n_rows} in B"
            ),
        )
    return va.digest == vb.digest, [], f"KV cache: {va.n_rows} positions of request {r!r}"


def scheme_note(a: str, b: str) -> str:
    """Why a boundary hashed under two schemes is not judged, and, where both are host
    schemes of one tree, how to make the captures comparable."""
    note = f"not judged: hashed with {a} in A, {b} in B"
    if {a, b} <= {XXH_TREE, TREE, hashing.BLAKE3}:
        note += (
            " (capture both sides with one hash: dmlib.capture(..., hash='blake3') writes "
            f"{TREE}, the default {XXH_TREE})"
        )
    return note


def _compare_one(
    a: Capture,
    b: Capture,
    ba: Boundary,
    bb: Boundary | None,
    requests: list[str],
    offsets: dict[str, int],
) -> tuple[Any, list[int], str | None]:
    """(identical or None, differing global block ids, note)."""
    if ba.expert is not None:  # one expert's rows: per (request, position) routed to it
        return judge_expert(a, b, ba, bb, requests, offsets)
    if bb is None:
        return None, [], "not judged: absent from the second capture"
    if not same_scheme(ba, bb):
        # digests of two schemes say nothing about the bytes: never "identical"
        return None, [], scheme_note(ba.hash, bb.hash)
    if requests:
        verdicts, diff, notes = [], [], []
        for r in requests:
            same, blocks, note = _judge_request(a, b, ba, bb, r, offsets)
            verdicts.append(same)
            diff += blocks
            if note and note not in notes:
                notes.append(note)
        same = False if False in verdicts else (None if None in verdicts else True)
        return same, diff, "; ".join(notes) or None
    if ba.shape != bb.shape or ba.dtype != bb.dtype:
        return False, [], f"{ba.dtype}{list(ba.shape)} vs {bb.dtype}{list(bb.shape)}"
    return ba.digest == bb.digest, [], None


def _rows_of(c: Capture, x: Boundary, requests: list[str]) -> np.ndarray | None:
    """The requests' rows of a dumped boundary (per position or per sequence), else None."""
    parts = []
    for r in requests:
        kind, v = _attribute(c, x, r)
        if kind == "token" and c.dumped(x, r):
            parts.append(c.tensor(x, r))
        elif kind == "sequence" and c.dumped(x):
            parts.append(c.tensor(x)[v[0] : v[0] + 1])
        else:
            return None
    return np.concatenate(parts)


def _stats(
    a: Capture, b: Capture, ba: Boundary, bb: Boundary, requests: list[str]
) -> dict[str, Any] | None:
    if requests:
        xa, xb = _rows_of(a, ba, requests), _rows_of(b, bb, requests)
        if xa is not None and xb is not None:
            st = element_stats(xa, xb)
            if st["n_diff"] and ba.row_mapped and bb.row_mapped and len(requests) == 1:
                st["diff_positions"] = diff_positions(xa, xb)
            return st
    if a.dumped(ba) and b.dumped(bb) and ba.shape == bb.shape:
        return element_stats(a.tensor(ba), b.tensor(bb))
    return None


def compare_captures(
    path_a: CaptureLike,
    path_b: CaptureLike,
    *,
    request: Any = None,
    repeat: CaptureLike | tuple[CaptureLike, ...] | None = None,
    negative: CaptureLike | None = None,
    layout_inputs: str | list[str] | tuple[str, ...] | None = None,
) -> pd.DataFrame:
    """One row per boundary of ``path_a`` in execution order, compared with ``path_b``.

    Parameters
    ----------
    path_a, path_b
        Capture directories (or opened captures) of the same model, e.g. one request run
        alone and the same request packed with others.
    request
        Request id to compare; default every request present in both captures.
    repeat
        A second capture of ``path_a``'s layout (or a tuple: repeats of A, then of B).
        The comparison is called valid only when every repeat is byte-identical.
    negative
        A capture of a different input: the comparison must find it different.
    layout_inputs
        More input names (glob patterns on a keyword or a boundary name) whose values
        follow the batch layout; with those the captures declared and
        :data:`~dmlib.localize.captures.LAYOUT_INPUTS`, they get role ``layout`` and are
        never judged (``attrs["layout_inputs"]`` lists them).

    Returns
    -------
    pandas.DataFrame
        Columns ``boundary, module, kind, role, identical, n_diff, n_diff_rows, max_abs,
        rel_fro, max_ulp, diff_blocks, new_blocks, inherited_blocks, note`` (the element
        statistics are :func:`dmlib.compare`'s, see :func:`element_stats`). Block ids index
        ``attrs["block_index"]`` (request, block, start, end). ``attrs`` also holds
        ``first_divergent_boundary``, ``culprit``, ``culprits``, ``repeat_control``,
        ``negative_control``, ``valid``, ``stats_missing`` and the answer: ``status``
        ("different": some judged boundary differs; "identical": every boundary was
        judged and matches, or the model's own outputs (hooked with ``modules`` including
        ``""``) were judged and match; "inconclusive": nothing judged differs but some
        boundary could not be judged), ``unjudged`` (``[{boundary, reason}]``) and
        ``outputs_match``; ``experts`` (where A recorded expert rows: the rows that differ
        per (expert, stage, request, position), the first of them and the culprit ones,
        :func:`~dmlib.localize.expertjudge.expert_summary`).

    A boundary is judged per request: rows per position through the row map; rows per
    sequence (first axis = batch) through the batch row the request fills alone;
    otherwise the whole tensor, when both captures have the same dtype and shape.
    """
    # a version-2 capture meets a version-3 one under one scheme (digests rebuilt, not rehashed)
    a, b = lift_blake3(open_capture(path_a), open_capture(path_b))
    if across_passes(a, b, request):  # a full-sequence forward against prefill + decode passes
        return _across_passes(a, b, request, repeat, negative, layout_inputs)
    requests = _check_comparable(a, b, request)
    index = _block_index(a, requests)
    offsets = {r: i for i, (r, k, _, _) in enumerate(index) if k == 0}  # request -> first block id
    alignment = align(a, b)  # op boundaries pair by aligned op sequences, the rest by name
    patterns = _layout_patterns(a, b, layout_inputs)
    aliases = argument_aliases(a, b)
    rows = [
        _boundary_row(a, b, ba, requests, offsets, alignment, patterns, aliases.get(ba.name))
        for ba in a.boundaries
        if concerns(ba, b, requests)  # (an expert hit by other requests only: not theirs)
    ]
    within_experts(a, b, rows)  # an experts module's activation: judged per expert instead
    fwd, bwd = split_backward(a, rows)  # the backward judged in its own order
    _roles(fwd, a.root)
    recorded_roles(a, fwd)
    routing = routing_report(a, b, requests)
    flip_notes(rows, routing)
    backward_roles(bwd, next((r["boundary"] for r in fwd if r["identical"] is False), None))
    df = _frame(rows)
    paired = {v for v in alignment.partner.values() if v is not None} | set(aliases.values())
    df.attrs.update(_summary(a, b, requests, index, fwd, paired, patterns))
    df.attrs["steps"] = _steps(fwd)
    df.attrs["routing"] = routing
    df.attrs["experts"] = expert_summary(a, b, fwd, requests)
    df.attrs["backward"] = backward_summary(bwd, df.attrs, b)
    df.attrs.update(_op_summary(rows, alignment))
    df.attrs["repeat_control"] = _repeats(a, b, repeat)
    df.attrs["negative_control"] = _negatives(a, b, requests, negative)
    rc, nc = df.attrs["repeat_control"], df.attrs["negative_control"]
    df.attrs["valid"] = None if rc is None else bool(rc["held"] and nc["passed"] is not False)
    return df


def _across_passes(
    a: Capture,
    b: Capture,
    request: Any,
    repeat: CaptureLike | tuple[CaptureLike, ...] | None,
    negative: CaptureLike | None,
    layout_inputs: str | list[str] | tuple[str, ...] | None,
) -> pd.DataFrame:
    """:func:`compare_captures` of a full-sequence capture and a prefill + decode one:
    position by position (:mod:`dmlib.localize.positions`), with the same controls."""
    df = compare_positions(a, b, request, _layout_patterns(a, b, layout_inputs))
    requests = df.attrs["requests"]
    df.attrs["repeat_control"] = _repeats(a, b, repeat)
    df.attrs["negative_control"] = _negatives(a, b, requests, negative)
    rc, nc = df.attrs["repeat_control"], df.attrs["negative_control"]
    df.attrs["valid"] = None if rc is None else bool(rc["held"] and nc["passed"] is not False)
    return df


def argument_aliases(a: Capture, b: Capture) -> dict[str, str]:
    """A's input boundaries of the model that B recorded under another slot: an argument
    passed by position in one capture (``input0``) and by keyword in the other
    (``input.input_ids``), paired by the forward's parameter names each capture stored
    (``coverage.arg_names``). Name in A -> name in B."""
    out: dict[str, str] = {}
    for x in a.boundaries:
        if x.kind != "input" or x.name in b or x.cache or x.module not in (a.root, b.root):
            continue
        other = _other_slot(x.slot, a.arg_names.get(x.module), b.arg_names.get(b.root))
        if other is not None:
            name = boundary_name(b.root, x.call, "input", other)
            if name in b and name not in a:
                out[x.name] = name
    return out


def _other_slot(slot: str, names_a: list[str] | None, names_b: list[str] | None) -> str | None:
    """``input<i>`` -> ``input.<name>`` by A's names, ``input.<name>`` -> ``input<i>`` by
    B's (a tensor inside an argument keeps its path: ``input0.1`` <-> ``input.x.1``)."""
    head, dot, rest = slot.partition(".")
    if head.startswith("input") and head[5:].isdigit() and names_a:
        i = int(head[5:])
        return f"input.{names_a[i]}{dot}{rest}" if i < len(names_a) else None
    if head == "input" and rest and names_b:
        key, dot2, tail = rest.partition(".")
        if key in names_b:
            return f"input{names_b.index(key)}{dot2}{tail}"
    return None


def _layout_patterns(
    a: Capture, b: Capture, extra: str | list[str] | tuple[str, ...] | None
) -> tuple[str, ...]:
    """Layout-input patterns: the defaults, both captures' declared ones, and ``extra``."""
    out = list(LAYOUT_INPUTS)
    for c in (a, b):
        out += [str(p) for p in c.manifest.get("layout_inputs") or []]
    out += [] if extra is None else [extra] if isinstance(extra, str) else list(extra)
    return tuple(dict.fromkeys(out))


def _check_comparable(a: Capture, b: Capture, request: Any) -> list[str]:
    """The requests to compare, after checking both captures block and count them alike."""
    if a.block_rows != b.block_rows:
        raise CaptureError(
            f"block_rows {a.block_rows} here but {b.block_rows} in {b.path}; blocks are not comparable",
            path=a.path,
        )
    requests = _requests(a, b, request)
    for r in requests:
        if a.requests[r] != b.requests[r]:
            raise CaptureError(
                f"request {r!r} has {a.requests[r]} positions here but {b.requests[r]} in {b.path}",
                path=a.path,
            )
    return requests


def _boundary_row(
    a: Capture,
    b: Capture,
    ba: Boundary,
    requests: list[str],
    offsets: dict[str, int],
    alignment: Alignment,
    layout_inputs: tuple[str, ...] = LAYOUT_INPUTS,
    alias: str | None = None,
) -> dict[str, Any]:
    """One boundary of ``a`` against its partner in ``b`` (its namesake, for an op
    boundary the aligned op's, for a model input passed by position in one capture and by
    keyword in the other its ``alias``): identity, blocks, statistics."""
    name_b = alias or alignment.name_in_b(ba.name)
    bb = b.boundary(name_b) if name_b is not None and name_b in b else None
    layout = _is_layout(ba, layout_inputs) or (bb is not None and _is_layout(bb, layout_inputs))
    same: Any
    diff: list[int]
    note: str | None
    if layout:
        same, diff, note = None, [], LAYOUT_NOTE
    else:
        same, diff, note = _compare_one(a, b, ba, bb, requests, offsets)
    if layout:
        pass
    elif bb is None:
        note = alignment.notes.get(ba.name, note)
    elif (
        same is not None
        and layout_bound(a, b, ba, bb)
        and not _per_sequence(a, b, ba, bb, requests)
    ):
        same, diff, note = None, [], LAYOUT_BOUND_NOTE
    st = _stats(a, b, ba, bb, requests) if (bb is not None and same is not None) else None
    row = {"boundary": ba.name, "module": ba.module, "call": ba.call, "kind": ba.kind, "identical": same,
           "diff_blocks": sorted(diff), "note": note, "_layout": layout, "_slot": ba.slot,
           "_step": ba.step, "_op": ba.category.marker == "op", "_state": ba.state,
           "_router": ba.router, "_expert": ba.expert is not None}  # fmt: skip
    row.update(st or NO_STATS)
    if st is None and same is True:
        # identical hashes imply zero differences even without dumped tensors
        row.update(
            {
                "n_diff": 0,
                "n_diff_rows": 0,
                "max_abs": 0.0,
                "rel_fro": 0.0 if is_float(ba.np_dtype) else None,
                "max_ulp": 0 if is_float(ba.np_dtype) else None,
            }
        )
    row["_stats"] = st is not None
    return row


def _per_sequence(a: Capture, b: Capture, ba: Boundary, bb: Boundary, requests: list[str]) -> bool:
    """Every request was found per sequence (first axis = batch) in both captures."""
    return bool(requests) and all(
        _attribute(a, ba, r)[0] == _attribute(b, bb, r)[0] == "sequence" for r in requests
    )


ROLLED_NOTE = (
    "not judged: a sliding-window KV cache (its slots roll over, so it is hashed whole), "
    "and the two captures place the requests on different rows"
)


__all__ = [
    "compare_captures", "repeat_control", "planted_control", "element_stats", "capture_verdict",
    "unjudged_line", "CaptureVerdict",
]  # fmt: skip
