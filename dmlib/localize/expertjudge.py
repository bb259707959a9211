"""Expert boundaries (kind ``expert``: :mod:`dmlib.localize.capture.expertrows`) of two
captures judged per (expert, request, position), and what a comparison says of them.

Expert ``e``'s rows of a call in run A are paired with the same (module, e, stage, call)
of run B per request, over the positions routed to ``e`` in both runs: a row is one
token's output of that expert stage, compared by its SHA-256 digest. A position routed to
``e`` in one run only is a routing flip (the routing report names it): not judged here and
never counted identical or different. An expert boundary that holds no row of the
compared requests in either run says nothing about them and is left out of the
comparison (a packed run's experts hit only by the other requests).
"""

from __future__ import annotations

import weakref
from typing import Any

from dmlib.errors import CaptureError
from dmlib.localize.capture.format import Boundary
from dmlib.localize.capture.reader import Capture
from dmlib.localize.controls import NO_STATS
from dmlib.textsafe import escape

UP = "gate_up_proj"

_CALLS: weakref.WeakKeyDictionary[Capture, set[tuple[str, int]]] = weakref.WeakKeyDictionary()


def recorded_calls(c: Capture) -> set[tuple[str, int]]:
    """(module, call) of every experts module call whose expert rows ``c`` recorded."""
    got = _CALLS.get(c)
    if got is None:
        got = _CALLS[c] = {(x.module, x.call) for x in c.boundaries if x.expert is not None}
    return got


def _unrecorded(x: Boundary, other: Capture, side: str) -> str | None:
    """Why ``x``'s rows cannot meet ``other``'s: it recorded no expert rows of that call."""
    if (x.module, x.call) in recorded_calls(other):
        return None
    return (
        f"not judged: the capture {side} recorded no expert rows of {x.module} call {x.call} "
        "(capture it with experts=True; a module not judged is listed under not_captured)"
    )


def concerns(x: Boundary, other: Capture, requests: list[str]) -> bool:
    """Whether boundary ``x`` is judged for ``requests``: any boundary but an expert one
    holding no row of them in its capture nor under its name in ``other``."""
    if x.expert is None or not requests:
        return True
    if any(r in x.expert["rows"] for r in requests):
        return True
    y = other.boundary(x.name) if x.name in other else None
    return y is not None and y.expert is not None and any(r in y.expert["rows"] for r in requests)


def describe(x: Boundary, request: str, position: int) -> str:
    """``expert 5 of layers.1.mlp.experts, token 6 of request 'probe', gate_up_proj``."""
    assert x.expert is not None
    call = f" (call {x.call})" if x.call else ""
    return (
        f"expert {x.expert['index']} of {x.module}{call}, token {position} of request "
        f"{request!r}, {x.expert['stage']}"
    )


def _rows(c: Capture, x: Boundary | None, r: str) -> dict[int, str]:
    """Request ``r``'s rows of an expert boundary, each position checked against the
    request's length in the capture's row map (pass ``s`` of a multi-pass capture: its
    prompt and the ``s`` tokens after it)."""
    if x is None or x.expert is None:
        return {}
    rows = x.expert["rows"].get(r, {})
    n = c.requests.get(r, 0) + x.step
    bad = [p for p in rows if p >= n]
    if bad:
        raise CaptureError(
            f"boundary {x.name!r} holds a row of request {r!r} at position {bad[0]}; the "
            f"request has {n} positions up to pass {x.step}",
            path=c.path,
        )
    return rows


def pair_rows(
    a: Capture, b: Capture, ba: Boundary, bb: Boundary | None, requests: list[str]
) -> dict[str, Any]:
    """``{"differ": [(request, position)], "same": n, "only_a": [...], "only_b": [...]}``
    for an expert boundary of A and its namesake in B (None: absent there)."""
    out: dict[str, Any] = {"differ": [], "same": 0, "only_a": [], "only_b": []}
    for r in requests:
        ra, rb = _rows(a, ba, r), _rows(b, bb, r)
        for p in sorted(ra.keys() & rb.keys()):
            if ra[p] == rb[p]:
                out["same"] += 1
            else:
                out["differ"].append((r, p))
        out["only_a"] += [(r, p) for p in sorted(ra.keys() - rb.keys())]
        out["only_b"] += [(r, p) for p in sorted(rb.keys() - ra.keys())]
    return out


def _where(pairs: list[tuple[str, int]], limit: int = 4) -> str:
    text = ", ".join(f"{r!r}:{p}" for r, p in pairs[:limit])
    return text + (f" and {len(pairs) - limit} more" if len(pairs) > limit else "")


def judge_expert(
    a: Capture,
    b: Capture,
    ba: Boundary,
    bb: Boundary | None,
    requests: list[str],
    offsets: dict[str, int],
) -> tuple[bool | None, list[int], str | None]:
    """(identical or None, differing global block ids, note) of expert boundary ``ba``."""
    if bb is not None and (bb.expert is None or bb.hash != ba.hash):
        return None, [], f"not judged: {bb.name!r} in B is not an expert boundary of {ba.hash}"
    why = _unrecorded(ba, b, "B") if bb is None else None
    if why is not None:
        return None, [], why
    if not requests:
        if bb is not None and bb.shape == ba.shape and bb.digest == ba.digest:
            return True, [], "compared whole (no row map; the same rows in the same order)"
        return None, [], "not judged: without a row map an expert's rows are not paired by token"
    got = pair_rows(a, b, ba, bb, requests)
    flips = ""
    if got["only_a"] or got["only_b"]:
        flips = (
            f"routing flip, not a numerical difference: routed to expert "
            f"{ba.expert['index'] if ba.expert else '?'} in one run only: "
            + "; ".join(
                f"in {side} only {_where(got[key])}"
                for side, key in (("A", "only_a"), ("B", "only_b"))
                if got[key]
            )
        )
    if got["differ"]:
        r, p = got["differ"][0]
        blocks = sorted({offsets[r] + q // a.block_rows for r, q in got["differ"]})
        n = len(got["differ"])
        note = f"{n} of {n + got['same']} rows differ, the first: {describe(ba, r, p)}"
        return False, blocks, note + (f"; {flips}" if flips else "")
    if flips:
        same = (
            f"; the {got['same']} rows routed to it in both runs identical" if got["same"] else ""
        )
        return None, [], f"not judged: {flips}{same}"
    return True, [], None


INSIDE = (
    "not judged: inside an experts module whose rows are judged per expert: its n-th call "
    "runs on the n-th expert hit's gathered tokens, which the two runs do not share (other "
    "experts hit, other tokens routed, another layout); judged by that module's "
    "expert<e>.gate_up_proj / down_proj rows instead"
)


def _hits(c: Capture) -> dict[str, list[tuple[Any, ...]]]:
    """Per experts module, each expert boundary: (name, shape, request -> positions), in
    order."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for x in c.boundaries:
        if x.expert is not None:
            rows = {r: sorted(v) for r, v in x.expert["rows"].items()}
            out.setdefault(x.module, []).append((x.name, x.shape, rows))
    return out


def within_experts(a: Capture, b: Capture, rows: list[dict[str, Any]]) -> None:
    """Mark not judged (in place) the boundaries of modules inside an experts module whose
    expert rows A recorded (the eager implementation's activation, called once per expert
    hit), unless both captures place the requests on the same rows and hit the same
    experts with the same tokens in the same order: only then does its n-th call hold the
    same expert's rows of the same tokens in both."""
    same_rows = (
        a.row_map is not None and b.row_map is not None and a.row_map.entries == b.row_map.entries
    )
    ha = _hits(a)
    hb = _hits(b) if same_rows and ha else {}
    inner = tuple(f"{m}." for m, h in ha.items() if not (same_rows and h == hb.get(m)))
    if not inner:
        return
    for r in rows:
        if r["module"].startswith(inner) and not r["_layout"]:
            r.update(NO_STATS, identical=None, diff_blocks=[], note=INSIDE, _stats=False)
            r.pop("diff_positions", None)


def absent_reason(x: Boundary, a: Capture) -> str:
    """Why a boundary of B absent from A is not judged (an expert's: a routing flip, where
    A recorded that call's expert rows)."""
    if x.expert is not None:
        why = _unrecorded(x, a, "A")
        if why is not None:
            return why.removeprefix("not judged: ")
        return (
            f"routing flip: expert {x.expert['index']} of {x.module} holds rows of the "
            "compared requests in B only"
        )
    return "absent from the first capture"


def expert_role(
    r: dict[str, Any], inputs: list[dict[str, Any]], up: dict[str, Any] | None
) -> tuple[str, str | None]:
    """(role, note) of a differing expert row: its inputs are the experts module's inputs
    of that call (the hidden rows and the routing) and, for ``down_proj``, the same
    expert's ``gate_up_proj`` rows (``up``)."""
    judged = [i for i in inputs if i["identical"] is not None]
    if any(i["identical"] is False for i in judged) or (
        up is not None and up["identical"] is False
    ):
        return "carrier", None
    if not judged:
        return "undetermined", "the experts module's inputs were not judged (not captured)"
    if up is not None and up["identical"] is None:
        return "undetermined", f"its {UP} rows were not judged: {up['boundary']}"
    return "culprit", "the experts module's inputs match: the difference enters in this expert"


def up_name(name: str) -> str:
    """The boundary name of the same expert's ``gate_up_proj`` rows (of ``down_proj``'s)."""
    module, _, slot = name.rpartition(":")
    return f"{module}:{slot.replace('.down_proj', '.' + UP, 1)}"


def expert_summary(
    a: Capture, b: Capture, rows: list[dict[str, Any]], requests: list[str]
) -> dict[str, Any] | None:
    """``attrs["experts"]``: the expert rows that differ, in execution order, the first of
    them and the culprit ones (None: A recorded no expert boundary)."""
    mine = [r for r in rows if r.get("_expert")]
    if not mine:
        return None
    differ: list[dict[str, Any]] = []
    culprits: list[dict[str, Any]] = []
    n_same = n_flip = 0
    for row in mine:
        x = a.boundary(row["boundary"])
        y = b.boundary(x.name) if x.name in b else None
        if y is None and _unrecorded(x, b, "B") is not None:
            continue  # B recorded no expert rows of that call: nothing paired, no flip
        got = pair_rows(a, b, x, y, requests) if requests else None
        if got is None:
            continue
        n_same += got["same"]
        n_flip += len(got["only_a"]) + len(got["only_b"])
        found = [_row(x, req, p, row["role"]) for req, p in got["differ"]]
        differ += found
        if row["role"] == "culprit":
            culprits += found
    for y in b.boundaries:  # experts the requests' tokens were routed to in B only
        if y.expert is not None and y.name not in a and _unrecorded(y, a, "A") is None:
            n_flip += sum(len(y.expert["rows"].get(r, {})) for r in requests)
    return {
        "n_boundaries": len(mine),
        "n_rows_identical": n_same,
        "n_rows_differ": len(differ),
        "n_rows_one_run": n_flip,
        "first_divergent": differ[0] if differ else None,
        "culprits": culprits,
        "differ": differ,
    }


def _row(x: Boundary, request: str, position: int, role: str) -> dict[str, Any]:
    assert x.expert is not None
    return {"boundary": x.name, "module": x.module, "call": x.call, "step": x.step,
            "expert": x.expert["index"], "stage": x.expert["stage"], "request": request,
            "position": position, "role": role,
            "text": describe(x, request, position)}  # fmt: skip


def expert_lines(summary: dict[str, Any] | None, limit: int = 4) -> list[str]:
    """The expert rows' part of the verdict's text (none where none was recorded)."""
    if summary is None:
        return []
    head = (
        f"expert rows: {summary['n_rows_differ']} differ, {summary['n_rows_identical']} "
        f"identical, {summary['n_rows_one_run']} routed to the expert in one run only "
        f"(routing flips, not judged) in {summary['n_boundaries']} expert boundaries"
    )
    lines = [head]
    if summary["first_divergent"] is not None:
        lines.append(escape(f"  first divergent expert row: {summary['first_divergent']['text']}"))
    for c in summary["culprits"][:limit]:
        lines.append(escape(f"  culprit expert row: {c['text']}"))
    if len(summary["culprits"]) > limit:
        lines.append(f"  and {len(summary['culprits']) - limit} more culprit rows")
    return lines


__all__ = [
    "absent_reason", "concerns", "describe", "expert_lines", "expert_role", "expert_summary",
    "judge_expert", "pair_rows", "up_name", "within_experts",
]  # fmt: skip
