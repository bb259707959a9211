"""A full-sequence capture against a prefill + decode capture, position by position.

A trainer computes a request's ``L`` positions in one forward pass (padded or packed with
others, no cache); a sampler computes the prompt's ``P`` positions in a prefill pass, then
one position per decode pass against its KV cache (``capture_generate``). Their rows are
paired by position: position ``p`` of the request in the full-sequence capture is
compared with the pass that computed it in the other, at the boundary of the same module,
slot and call within the pass:

- the prefill (pass 0): the request's rows through the row map (positions ``0..P-1``); a
  tensor holding one column per batch row there (the logits of the last prompt position
  only) is that row's last position;
- decode pass ``s``: one column per batch row; the request's batch row (the one it fills
  alone) holds position ``P + s - 1``; where the capture's ``pass_rows`` names a pass's
  rows (``capture_generate`` writes it for every pass), that table says which position
  each batch row (or each column of a row, for a pass of several positions) computed.

A position is compared by its digest (captures with ``block_rows=1`` keep one per
position; a one-column tensor's row is digested per batch row, and with ``block_rows=1`` a
later pass's batch row of several columns per column: ``capture/columns.py``) or, where
both sides dumped it, by its values. What only one side has (the sampler's KV cache and states, a
module hooked on one side) is a row that is not judged, with the reason; positions of the
full-sequence capture that no pass computed are listed as not captured, so such a
comparison is never "identical".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from dmlib.errors import CaptureError
from dmlib.localize.capture.format import Boundary, request_key, same_scheme
from dmlib.localize.capture.reader import Capture
from dmlib.localize.culprits import _frame, _is_layout, _roles, _steps, _summary
from dmlib.localize.expertjudge import (
    across_note,
    across_pairs,
    across_summary,
    flip_note,
    inside_across,
    mark,
    recorded_calls,
)

Row = tuple[str | None, np.ndarray | None]  # (digest, values) of one position's row
PER_POSITION = "capture it with block_rows=1 (one digest per position), or dump it in both"
WIDE = (
    "one digest covers a batch row's columns: capture the passes with block_rows=1 (one "
    "digest per column), or dump it in both"
)


def multi_pass(c: Capture) -> bool:
    """Whether the capture is of a prefill + decode loop: more than one forward pass
    (decode steps), or ``generate()`` / ``pass_rows`` metadata (a loop of one pass)."""
    meta = c.manifest.get("metadata") or {}
    return any(x.step for x in c.boundaries) or "generate" in meta or PASS_ROWS in meta


def across_passes(a: Capture, b: Capture, request: Any = None) -> bool:
    """Whether ``a`` and ``b`` pair as a full-sequence capture and a prefill + decode one:
    one of them holds several passes, the other one, and a compared request has more
    positions in the one-pass capture than in the other's prompt."""
    if multi_pass(a) == multi_pass(b):
        return False
    full, passes = (a, b) if multi_pass(b) else (b, a)
    keys = [request_key(request)] if request is not None else list(full.requests)
    mine = pass_requests(passes)
    return any(
        k in full.requests and k in mine and full.requests[k] > passes.requests.get(k, 0)
        for k in keys
    )


def _slots(c: Capture, steps: bool) -> dict[tuple[Any, ...], Boundary]:
    """(module, kind, slot, step, k-th such boundary in its pass) -> boundary."""
    seen: dict[tuple[Any, ...], int] = {}
    out = {}
    for x in c.boundaries:
        base = (x.module, x.kind, x.slot, x.step if steps else 0)
        k = seen[base] = seen.get(base, -1) + 1
        out[(*base, k)] = x
    return out


#: the metadata key of a prefill + decode capture whose passes' batch rows a sampler
#: assigns itself (requests joining the batch at later passes): ``{"<pass>": [[request,
#: position] or None per batch row]}`` for the one-column passes it covers; a pass of
#: several columns (chunked prefill, speculative decoding) gives a batch row a list of
#: ``[request, position]`` or None per column instead
PASS_ROWS = "pass_rows"

Cell = tuple[str, int] | None


def _cells(e: Any) -> list[Cell]:
    """A batch row's entry of ``pass_rows``: one cell per column."""
    if e is None:
        return [None]
    if len(e) and (e[0] is None or isinstance(e[0], (list, tuple))):
        return [None if x is None else (request_key(x[0]), int(x[1])) for x in e]
    return [(request_key(e[0]), int(e[1]))]


def pass_rows(c: Capture) -> dict[int, list[list[Cell]]]:
    """The capture's ``pass_rows`` table (pass -> per batch row, one (request, position) or
    None per column); CaptureError where it is malformed."""
    table = c.metadata.get(PASS_ROWS)
    if table is None:
        return {}
    try:
        return {int(k): [_cells(e) for e in rows] for k, rows in dict(table).items()}
    except (TypeError, ValueError, IndexError, KeyError):
        raise CaptureError(
            f"metadata {PASS_ROWS!r} is malformed; expected {{pass: [[request, position] or "
            "null per batch row]}}",
            path=c.path,
        ) from None


def pass_requests(c: Capture) -> set[str]:
    """Requests of a prefill + decode capture: its row map's and its ``pass_rows``'."""
    table = pass_rows(c).values()
    return set(c.requests) | {e[0] for rows in table for row in rows for e in row if e}


class _Plan:
    """Where each compared request's positions lie in the prefill + decode capture."""

    def __init__(self, full: Capture, passes: Capture, requests: list[str]) -> None:
        self.requests = requests
        self.prompt = {r: passes.requests.get(r, 0) for r in requests}
        self.length = {r: full.requests[r] for r in requests}
        self.n_passes = 1 + max(x.step for x in passes.boundaries)
        self.table = pass_rows(passes)
        self.memo: dict[Any, Any] = {}  # the full capture's rows, read once per boundary
        self.experts: tuple[dict[str, Any], dict[str, Any]] = ({}, {})  # expertjudge.across_pairs
        rm = passes.row_map
        self.row: dict[str, tuple[int | None, str]] = {}
        self.last: dict[str, bool] = {}  # the row's last column holds the prompt's last position
        for r in requests:
            b, why = (
                rm.sequence_row(r)
                if rm is not None and r in rm.requests
                else (None, f"request {r!r} is not in the row map")
            )
            self.row[r] = (b, why)
            seq = len(rm) // rm.batch if rm is not None and rm.batch else 0
            tail = (
                rm.entries[b * seq + seq - 1] if rm is not None and b is not None and seq else None
            )
            self.last[r] = tail is not None and tail[1] == self.prompt[r] - 1

    def cells(self, r: str, step: int) -> tuple[list[tuple[int, int, int, int]], str]:
        """((batch row, column, columns, position) per position of request ``r`` in pass
        ``step``'s column tensors, why not): from ``pass_rows`` where it covers the pass,
        else the row the request fills (one column) and the position after its prompt; no
        cell and "" where it computed nothing there."""
        if step in self.table:
            return [(b, c, len(row), e[1]) for b, row in enumerate(self.table[step])
                    for c, e in enumerate(row) if e and e[0] == r], ""  # fmt: skip
        if self.prompt[r] == 0:
            return [], ""
        b, why = self.row[r]
        if step == 0 and b is not None and not self.last[r]:
            return [], "one column per batch row, not the prompt's last position"
        return ([] if b is None else [(b, 0, 1, self.prompt[r] - 1 + step)]), why

    def computed(self) -> dict[tuple[str, int], int]:
        """(request, position) -> the pass that computed it, for the positions the
        full-sequence capture holds: the prompt's in the prefill, each later one in the
        pass whose cells name it."""
        out: dict[tuple[str, int], int] = {}
        for r in self.requests:
            for p in range(min(self.prompt[r], self.length[r])):
                out[(r, p)] = 0
            for s in range(1, self.n_passes):
                for cell in self.cells(r, s)[0]:
                    if cell[3] < self.length[r]:
                        out.setdefault((r, cell[3]), s)
        return out

    def uncovered(self, r: str) -> list[int]:
        """Positions of ``r`` in the full-sequence capture no pass computed."""
        done = set(range(self.prompt[r]))
        for s in range(1, self.n_passes):
            done.update(cell[3] for cell in self.cells(r, s)[0])
        return [p for p in range(self.length[r]) if p not in done]


def select_requests(full: Capture, passes: Capture, request: Any) -> list[str]:
    """The requests to compare: ``request``, else those of both captures."""
    mine = pass_requests(passes)
    if request is not None:
        key = request_key(request)
        for c, have in ((full, set(full.requests)), (passes, mine)):
            if key not in have:
                raise CaptureError(
                    f"request {request!r} is not in this capture (it has {sorted(have)})",
                    path=c.path,
                )
        return [key]
    return sorted(set(full.requests) & mine)


def _full_rows(
    c: Capture, x: Boundary, r: str, memo: dict[Any, Any] | None = None
) -> tuple[list[Row] | None, str]:
    """Request ``r``'s rows of a row-mapped boundary, one (digest, values) per position
    (kept in ``memo``: a full-sequence boundary is read once, not once per pass)."""
    key = (str(c.path), x.name, r)
    if memo is not None and key in memo:
        return memo[key]
    out = _read_rows(c, x, r)
    if memo is not None:
        memo[key] = out
    return out


def _read_rows(c: Capture, x: Boundary, r: str) -> tuple[list[Row] | None, str]:
    h = x.requests.get(r)
    if h is None:
        return None, f"request {r!r} has no rows at {x.name}"
    digests: list[str | None] = list(h.blocks) if c.block_rows == 1 else [None] * h.n_rows
    vals = c.tensor(x, r) if c.dumped(x, r) else None
    if vals is None and c.block_rows != 1:
        return None, f"one digest per {c.block_rows} positions in {c.path.name}: {PER_POSITION}"
    return [(d, None if vals is None else vals[i]) for i, d in enumerate(digests)], ""


def _column(
    c: Capture, x: Boundary, cell: tuple[int, int, int, int], t: Boundary, axis: int
) -> Row | None:
    """Column ``k`` of batch row ``b`` of a tensor of ``n`` columns (on axis ``axis``), to be
    compared with full-sequence boundary ``t``'s row: its digest where it is the row's only
    column, or where the pass kept one per column (``columns``, block_rows=1) in ``t``'s
    scheme; else only its values, where dumped."""
    b, k, n, _ = cell
    if x.leading is None or len(x.leading) <= b:
        return None
    if (
        n == 1
        and t.row_axes is None
        and len(x.shape) == len(t.shape) >= 2
        and tuple(x.shape[1:]) == tuple(t.row_shape)
    ):
        # one token per batch row, flattened onto the first axis as the full capture's rows
        # are ((tokens, d): an experts module's or a router's input in a decode pass)
        return x.leading[b], (c.tensor(x)[b] if c.dumped(x) else None)
    shape = x.shape[1:axis] + x.shape[axis + 1 :]
    if x.shape[axis] != n or tuple(shape) != tuple(t.row_shape):
        return None
    vals = np.take(c.tensor(x)[b], k, axis=axis - 1).reshape(t.row_shape) if c.dumped(x) else None
    digest = x.leading[b] if n == 1 else None
    cols = x.columns
    if n > 1 and axis == 1 and cols is not None and cols[0] == t.hash and len(cols[1]) > b:
        mine = cols[1][b]
        digest = mine.blocks[k] if mine.n_rows == n and len(mine.blocks) == n else None
    return digest, vals


def _same(p: Row, q: Row) -> bool | None:
    """Whether two rows hold the same bytes (digests where both have one, else values)."""
    if p[0] is not None and q[0] is not None:
        return p[0] == q[0]
    if p[1] is not None and q[1] is not None:
        return p[1].dtype == q[1].dtype and p[1].tobytes() == q[1].tobytes()
    return None


#: what _judge returns for a request that computed nothing in a pass
ABSENT: tuple[Any, list[int], str, list[Any]] = (None, [], "", [])


def _judge(
    full: Capture, passes: Capture, t: Boundary, s: Boundary, r: str, plan: _Plan
) -> tuple[bool | None, list[int], str, list[tuple[np.ndarray, np.ndarray]]]:
    """(identical or None, differing positions, note, value pairs) for request ``r``."""
    if not same_scheme(t, s):
        return None, [], f"not judged: hashed with {t.hash} and {s.hash}", []
    if t.dtype != s.dtype:
        return False, [], f"{t.dtype} vs {s.dtype}", []
    rows, why = _full_rows(full, t, r, plan.memo)
    if rows is None:
        return None, [], f"not judged: {why}", []
    if s.row_mapped:
        if plan.prompt[r] == 0:
            return ABSENT
        if s.step:
            return None, [], "not judged: rows per position in a decode pass", []
        mine, why = _full_rows(passes, s, r)
        if mine is None:
            return None, [], f"not judged: {why}", []
        if t.row_shape != s.row_shape:
            return None, [], f"not judged: rows {list(t.row_shape)} vs {list(s.row_shape)}", []
        pairs = list(enumerate(zip(rows[: len(mine)], mine, strict=True)))
        where = f"positions 0-{len(mine) - 1} (prefill)"
    else:
        cells, why = plan.cells(r, s.step)
        if not cells:
            return (None, [], f"not judged: {why}", []) if why else ABSENT
        axis = t.row_axes[1] if t.row_axes is not None else 1
        pairs = []
        for cell in cells:
            p = cell[3]
            col = _column(passes, s, cell, t, axis) if p < len(rows) else None
            if col is None:
                why = f"{s.name} {list(s.shape)} holds no row of position {p} of request {r!r}"
                return None, [], f"not judged: {why} ({t.name} {list(t.shape)})", []
            pairs.append((p, (rows[p], col)))
        where = f"position{'s' if len(pairs) > 1 else ''} " + ", ".join(str(p) for p, _ in pairs)
        where += f" (decode step {s.step})" if s.step else " (prefill)"
    verdicts = {p: _same(x, y) for p, (x, y) in pairs}
    if None in verdicts.values():
        wide = not s.row_mapped and any(y[0] is None for _, (_, y) in pairs)  # several columns
        how = WIDE if wide else PER_POSITION
        return None, [], f"not judged: {where}: {how}", []
    diff = [p for p, v in verdicts.items() if not v]
    if diff and len(pairs) > 1:  # name the differing positions among those compared
        shown = ", ".join(map(str, diff[:8])) + (", ..." if len(diff) > 8 else "")
        where = f"position{'s' if len(diff) > 1 else ''} {shown} of {where}"
    values = [(x[1], y[1]) for _, (x, y) in pairs if x[1] is not None and y[1] is not None]
    dumped = len(values) == len(pairs)
    return not diff, diff, f"{where} of request {r!r}: {t.name}", values if dumped else []


def _stats(values: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any] | None:
    """Element statistics of the compared rows (None: not every one dumped on both sides)."""
    from dmlib.kernels.pair import compare_arrays

    if not values:
        return None
    a = np.stack([v[0] for v in values])
    b = np.stack([v[1] for v in values])
    row = compare_arrays(a, b)
    ua = a.reshape(len(a), -1).view(np.uint8) if a.size else a.reshape(len(a), 0)
    ub = b.reshape(len(b), -1).view(np.uint8) if b.size else b.reshape(len(b), 0)
    max_abs = row["max_abs"]
    return {
        "n_diff": int(row["n_diff"]),
        "n_diff_rows": int(np.count_nonzero((ua != ub).any(axis=1))),
        "max_abs": None if max_abs is None or max_abs != max_abs else float(max_abs),
        "rel_fro": row.get("rel_fro"),
        "max_ulp": row.get("max_ulp"),
    }


NO_STATS = {"n_diff": None, "n_diff_rows": None, "max_abs": None, "rel_fro": None, "max_ulp": None}
CACHE_NOTE = "not judged: only in {side} (a KV-cache tensor; the full-sequence forward keeps none)"
STATE_NOTE = (
    "not judged: only in {side} (a state the pass left; the full-sequence forward keeps none)"
)


def _row(x: Boundary, same: bool | None, note: str, layout: bool) -> dict[str, Any]:
    """A comparison row for boundary ``x`` (named as in its own capture)."""
    return {"boundary": x.name, "module": x.module, "call": x.call, "kind": x.kind,
            "identical": same, "diff_blocks": [], "note": note, "_layout": layout,
            "_slot": x.slot, "_step": x.step, "_op": x.category.marker == "op",
            "_state": x.state, "_router": x.router, "_expert": x.expert is not None,
            **NO_STATS, "_stats": False}  # fmt: skip


def _paired_row(
    full: Capture, passes: Capture, t: Boundary, s: Boundary, plan: _Plan
) -> dict[str, Any]:
    """Pass boundary ``s`` against the rows of the positions it computed in ``t``."""
    verdicts, diff, notes, values = [], [], [], []
    for r in plan.requests:
        same, d, note, v = _judge(full, passes, t, s, r, plan)
        if same is None and not note:
            continue  # the request computed nothing in this pass
        verdicts.append(same)
        diff += d
        notes.append(note)
        values += v
    if not verdicts:
        return _row(s, None, "not judged: no compared request computed a position here", False)
    same = False if False in verdicts else (None if None in verdicts else True)
    row = _row(s, same, "; ".join(dict.fromkeys(notes)), False)
    st = _stats(values) if same is not None else None
    if st is not None:
        row.update(st, _stats=True)
    elif same is True:
        zero = 0.0 if np.dtype(s.np_dtype).kind == "f" else None
        row.update(n_diff=0, n_diff_rows=0, max_abs=0.0, rel_fro=zero,
                   max_ulp=None if zero is None else 0)  # fmt: skip
    if len(plan.requests) == 1 and diff:
        row["diff_positions"] = sorted(diff)
    return row


def position_rows(
    full: Capture, passes: Capture, requests: list[str], is_layout: Any
) -> tuple[list[dict[str, Any]], _Plan]:
    """One row per boundary of ``passes`` in execution order (each pass's boundaries judged
    at the positions it computed), then the boundaries of ``full`` no pass recorded."""
    plan = _Plan(full, passes, requests)
    mine = _slots(full, steps=False)
    used: set[str] = set()
    side = f"the prefill + decode capture {passes.path.name}"
    rows: list[dict[str, Any]] = []
    plan.experts = across_pairs(full, passes, requests, plan.computed())
    for key, s in _slots(passes, steps=True).items():
        t = mine.get((*key[:3], 0, key[4]))
        if s.expert is not None:  # one expert's rows: by position, as the pass computed them
            _expert_row(s, plan, rows, used)
            continue
        if is_layout(s) or (t is not None and is_layout(t)):
            rows.append(_row(s, None, "layout input: follows the batch layout (not judged)", True))
        elif s.cache and not s.state:
            rows.append(_row(s, None, CACHE_NOTE.format(side=side), False))
        elif s.state:
            rows.append(_row(s, None, STATE_NOTE.format(side=side), False))
        elif t is None:
            rows.append(_row(s, None, f"not judged: absent from {full.path.name}", False))
        else:
            rows.append(_paired_row(full, passes, t, s, plan))
        if t is not None:
            used.add(t.name)
    for t in full.boundaries:
        if t.expert is not None:
            _expert_left(full, passes, t, plan, rows, used)
        elif t.name not in used:
            why = f"not judged: no pass of {passes.path.name} recorded it"
            rows.append(_row(t, None, why, is_layout(t)))
    mark(rows, inside_across(full, passes))  # an experts module's activation: never paired
    return rows, plan


def _expert_row(s: Boundary, plan: _Plan, rows: list[dict[str, Any]], used: set[str]) -> None:
    """The row of sampler expert boundary ``s`` (none where it holds no compared row)."""
    got = plan.experts[0][s.name]
    if got.get("t"):
        used.add(got["t"])
    if "why" not in got and not (got["differ"] or got["same"] or got["only_a"] or got["only_b"]):
        return  # rows of other requests, or of positions the full capture does not hold
    same, diff, note = across_note(s, got)
    row = _row(s, same, note, False)
    if same is True:
        row.update(n_diff=0, n_diff_rows=0, max_abs=0.0, rel_fro=0.0, max_ulp=0)
    if len(plan.requests) == 1 and diff:
        row["diff_positions"] = sorted(diff)
    rows.append(row)


def _expert_left(
    full: Capture, passes: Capture, t: Boundary, plan: _Plan, rows: list[dict[str, Any]],
    used: set[str],
) -> None:  # fmt: skip
    """A trainer expert boundary no sampler boundary was paired with: a routing flip where
    the passes computing its positions routed them elsewhere, not judged where the
    prefill + decode capture recorded no expert rows of its module."""
    left = plan.experts[1].get(t.name)
    if left:
        rows.append(_row(t, None, flip_note(t, left), False))
    elif t.name not in used and t.module not in {m for m, _ in recorded_calls(passes)}:
        if any(t.expert and t.expert["rows"].get(r) for r in plan.requests):
            why = f"not judged: the prefill + decode capture {passes.path.name} recorded no "
            rows.append(_row(t, None, why + f"expert rows of {t.module} (experts=True)", False))


def uncovered(full: Capture, plan: _Plan, side: str) -> list[dict[str, str]]:
    """``not_captured`` entries for positions of ``full`` that no pass computed."""
    out = []
    for r in plan.requests:
        left = plan.uncovered(r)
        if left:
            span = f"{left[0]}" if len(left) == 1 else f"{left[0]}-{left[-1]}"
            out.append({"capture": side, "what": f"position {span} of request {r!r}",
                        "reason": f"computed in {full.path.name} only: no pass computed it"})  # fmt: skip
    return out


def first_position(rows: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The first differing row's pass and positions (None where nothing differs)."""
    for r in rows:
        if r["identical"] is False:
            return {"boundary": r["boundary"], "step": r["_step"],
                    "positions": r.get("diff_positions"), "note": r["note"]}  # fmt: skip
    return None


def compare_positions(a: Capture, b: Capture, request: Any, patterns: tuple[str, ...]) -> Any:
    """The frame of :func:`dmlib.compare_captures` for a full-sequence capture and a prefill
    + decode one (either order); the controls are the caller's to add."""
    full, passes = (a, b) if multi_pass(b) else (b, a)
    requests = select_requests(full, passes, request)
    for r in requests:
        if full.requests[r] < passes.requests.get(r, 0):
            raise CaptureError(
                f"request {r!r} has {full.requests[r]} positions in the full-sequence capture "
                f"but a prompt of {passes.requests.get(r, 0)} in {passes.path}",
                path=full.path,
            )
    rows, plan = position_rows(full, passes, requests, lambda x: _is_layout(x, patterns))
    _roles(rows, passes.root)
    df = _frame(rows)
    names = {x.name for x in a.boundaries} | {x.name for x in b.boundaries}
    df.attrs.update(_summary(full, passes, requests, [], rows, names, patterns))
    at = df.attrs
    at["a"], at["b"] = str(a.path), str(b.path)
    side = "B" if passes is b else "A"
    at["not_captured"] = [*at["not_captured"], *uncovered(full, plan, side)]
    if at["status"] == "identical" and at["not_captured"]:
        judged = [r["boundary"] for r in rows if r["identical"] is True]
        at["status"], at["identical_up_to"] = "inconclusive", (judged[-1] if judged else None)
    at["first_divergent_position"] = first_position(rows)
    at["steps"] = _steps(rows)
    at["routing"] = None
    at["experts"] = across_summary(passes, rows, *plan.experts)
    at.update({"first_divergent_op": None, "culprit_op": None, "op_alignment": None})
    return df
