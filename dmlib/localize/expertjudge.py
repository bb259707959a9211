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

import re
import weakref
from collections.abc import Container
from typing import Any

from dmlib.errors import CaptureError
from dmlib.localize.capture.format import Boundary
from dmlib.localize.capture.reader import Capture
from dmlib.localize.controls import NO_STATS
from dmlib.textsafe import escape

_HEX = re.compile("[0-9a-f]{64}")  # a SHA-256 hex digest
UP = "gate_up_proj"
UP_ONLY = "up_proj"  # the first stage of an experts module without a gate

_CALLS: weakref.WeakKeyDictionary[Capture, set[tuple[str, int]]] = weakref.WeakKeyDictionary()


#: how an expert boundary's reason begins where a position is routed to the expert in one
#: run only (a routing flip: a discrete event, never a numerical difference)
FLIP_REASON = "routing flip, not a numerical difference"


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
            f"{FLIP_REASON}: routed to expert "
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


NEED_ROWS = (
    "not judged: call {call} of {module} is the {nth} expert hit of {experts}'s calls, which "
    "the two runs need not share ({why}): capture with experts=True"
)


def _ordinal(n: int) -> str:
    tail = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{tail}"


def experts_modules(c: Capture) -> dict[str, dict[str, Any]] | None:
    """``coverage.experts_modules`` of ``c``: experts module -> ``{"calls", "routing"}``
    (None: a capture written before the key was kept); CaptureError where malformed."""
    got = c.coverage.get("experts_modules")
    if got is None:
        return None
    ok = isinstance(got, dict) and all(
        isinstance(v, dict)
        and type(v.get("calls")) is int
        and v["calls"] >= 0
        and (v.get("routing") is None or _HEX.fullmatch(str(v["routing"])) is not None)
        for v in got.values()
    )
    if not ok:
        raise CaptureError(
            "coverage 'experts_modules' is malformed; expected {module: {calls: int, "
            "routing: sha256 hex or null}}",
            path=c.path,
        )
    return {str(k): dict(v) for k, v in got.items()}


def _hits(c: Capture) -> dict[str, list[tuple[Any, ...]]]:
    """Per experts module, each expert boundary: (name, shape, request -> positions), in
    order."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for x in c.boundaries:
        if x.expert is not None:
            rows = {r: sorted(v) for r, v in x.expert["rows"].items()}
            out.setdefault(x.module, []).append((x.name, x.shape, rows))
    return out


def _same_layout(a: Capture, b: Capture) -> bool:
    """Both captures place the requests on the same rows, in every pass they name (two
    captures without a row map: each tensor is compared whole, index by index, so their
    calls pair as the rest does)."""
    if a.row_map is None and b.row_map is None:
        return a.metadata.get("pass_rows") == b.metadata.get("pass_rows")
    return (
        a.row_map is not None
        and b.row_map is not None
        and a.row_map.entries == b.row_map.entries
        and a.metadata.get("pass_rows") == b.metadata.get("pass_rows")
    )


def inside_reasons(a: Capture, b: Capture) -> dict[str, str | None]:
    """Per experts module (either capture's ``coverage.experts_modules`` or expert rows):
    None where the boundaries inside it pair call for call (one layout, and the same
    expert rows' tokens per call, or without expert rows on both sides the same routing
    digest), else why not (a template of :data:`NEED_ROWS` or :data:`INSIDE`)."""
    ca, cb = experts_modules(a), experts_modules(b)
    ha, hb = _hits(a), _hits(b)
    names = set(ca or {}) | set(cb or {}) | set(ha) | set(hb)
    same = _same_layout(a, b)
    out: dict[str, str | None] = {}
    for m in names:
        if m in ha and m in hb:  # both recorded expert rows: they say which tokens each call ran
            out[m] = None if same and ha[m] == hb[m] else INSIDE
            continue
        ra, rb = (ca or {}).get(m), (cb or {}).get(m)
        if ra is None or rb is None:
            why = "the other capture does not say which modules are experts modules"
        elif not same:
            why = "the requests sit on other rows"
        elif ra["routing"] is None or rb["routing"] is None:
            why = "a call's routing was not read"
        elif (ra["calls"], ra["routing"]) != (rb["calls"], rb["routing"]):
            why = "its routing differs between the runs"
        else:
            out[m] = None
            continue
        out[m] = NEED_ROWS.replace("{why}", why)
    return out


def within_experts(a: Capture, b: Capture, rows: list[dict[str, Any]]) -> None:
    """Mark not judged (in place) the boundaries of modules called inside an experts module
    (the eager implementation's activation: its n-th call is the n-th expert hit) unless
    both captures' calls provably line up (:func:`inside_reasons`); never identical, never
    a difference. Where neither capture says which modules are experts modules (captures
    written before ``coverage.experts_modules``) and neither recorded expert rows, they
    are judged as before: by name and call."""
    mark(rows, {m: why for m, why in inside_reasons(a, b).items() if why is not None})


def inside_across(full: Capture, passes: Capture) -> dict[str, str]:
    """Why the boundaries inside each experts module are not judged between a
    full-sequence capture and a prefill + decode one: their calls never line up (the
    forward runs every position in one call, the passes a few each)."""
    ha, hb = _hits(full), _hits(passes)
    names = (
        set(experts_modules(full) or {}) | set(experts_modules(passes) or {}) | set(ha) | set(hb)
    )
    why = "the full-sequence forward and the prefill + decode passes run other tokens per call"
    return {m: INSIDE if m in ha and m in hb else NEED_ROWS.replace("{why}", why) for m in names}


def mark(rows: list[dict[str, Any]], reasons: dict[str, str]) -> None:
    """Rows of modules inside the experts modules of ``reasons`` marked not judged (in
    place), each with its module's reason (``{call}``, ``{module}``, ``{nth}``,
    ``{experts}`` filled from the row)."""
    if not reasons:
        return
    inner = sorted(reasons, key=len, reverse=True)  # (the innermost experts module first)
    for r in rows:
        m = next((m for m in inner if r["module"].startswith(f"{m}.")), None)
        if m is None or r["_layout"] or r.get("_expert"):
            continue
        call = int(r.get("call") or 0)
        note = reasons[m].format(call=call, module=r["module"], nth=_ordinal(call + 1), experts=m)
        r.update(NO_STATS, identical=None, diff_blocks=[], note=note, _stats=False)
        r.pop("diff_positions", None)


def _pass_index(c: Capture) -> dict[tuple[str, int], tuple[int, int]]:
    """(module, call) of each experts module call with expert rows -> (pass, its index
    among that module's calls in the pass)."""
    steps = {(x.module, x.call): x.step for x in c.boundaries if x.expert is not None}
    out: dict[tuple[str, int], tuple[int, int]] = {}
    seen: dict[tuple[str, int], int] = {}
    for (m, call), st in sorted(steps.items(), key=lambda kv: kv[0][1]):
        i = seen[(m, st)] = seen.get((m, st), -1) + 1
        out[(m, call)] = (st, i)
    return out


Key = tuple[str, int, int, str]  # (experts module, call index in its pass, expert, stage)


def _keyed(c: Capture) -> dict[tuple[Key, int], Boundary]:
    """(key, pass) -> the expert boundary of ``c``."""
    index = _pass_index(c)
    out = {}
    for x in c.boundaries:
        if x.expert is not None:
            st, i = index[(x.module, x.call)]
            out[((x.module, i, x.expert["index"], x.expert["stage"]), st)] = x
    return out


def across_pairs(
    full: Capture, passes: Capture, requests: list[str], where: dict[tuple[str, int], int]
) -> tuple[dict[str, dict[str, Any]], dict[str, list[tuple[str, int]]]]:
    """Expert rows of a full-sequence capture against a prefill + decode one, by position:
    the sampler's row of expert ``e`` at position ``p`` (in the pass that computed ``p``,
    ``where[(request, p)]``) against the trainer's expert ``e`` row at ``p`` of the same
    experts module call (the k-th of that module in its pass on both sides). Returns, per
    sampler expert boundary, ``pair_rows``' dict (``only_a``: the full-sequence capture's)
    with ``t`` (the trainer's boundary or None) or ``why`` (not judged); and, per trainer
    boundary, positions routed to its expert there only in passes that hold no such
    boundary (routing flips)."""
    fk, pk = _keyed(full), _keyed(passes)
    full_mods = {m for m, _ in recorded_calls(full)}
    out: dict[str, dict[str, Any]] = {}
    for (key, st), s in pk.items():
        if key[0] not in full_mods:
            out[s.name] = {"why": _unrecorded(s, full, "of full sequences") or ""}
            continue
        t = fk.get((key, 0))
        got: dict[str, Any] = {"differ": [], "same": 0, "only_a": [], "only_b": [],
                               "t": None if t is None else t.name}  # fmt: skip
        for r in requests:
            rs = {p: d for p, d in _rows(passes, s, r).items() if where.get((r, p)) == st}
            rt = {p: d for p, d in _rows(full, t, r).items() if where.get((r, p)) == st}
            for p in sorted(rs.keys() & rt.keys()):
                if rs[p] == rt[p]:
                    got["same"] += 1
                else:
                    got["differ"].append((r, p))
            got["only_a"] += [(r, p) for p in sorted(rt.keys() - rs.keys())]
            got["only_b"] += [(r, p) for p in sorted(rs.keys() - rt.keys())]
        out[s.name] = got
    calls = {(k[0], st, k[1]) for k, st in pk}
    left: dict[str, list[tuple[str, int]]] = {}
    for (key, _), t in fk.items():
        for r in requests:
            for p in _rows(full, t, r):
                at = where.get((r, p))
                if at is not None and (key[0], at, key[1]) in calls and (key, at) not in pk:
                    left.setdefault(t.name, []).append((r, p))
    return out, left


def across_note(s: Boundary, got: dict[str, Any]) -> tuple[bool | None, list[int], str]:
    """(identical or None, differing positions, note) of sampler expert boundary ``s``."""
    if "why" in got:
        return None, [], got["why"]
    e = s.expert["index"] if s.expert else "?"
    sides = (("the full-sequence capture", "only_a"), ("the prefill + decode capture", "only_b"))
    flips = "; ".join(f"in {side} only {_where(got[k])}" for side, k in sides if got[k])
    if flips:
        flips = f"{FLIP_REASON}: routed to expert {e} {flips}"
    if got["differ"]:
        r, p = got["differ"][0]
        n = len(got["differ"])
        note = f"{n} of {n + got['same']} rows differ, the first: {describe(s, r, p)}"
        return False, [q for _, q in got["differ"]], note + (f"; {flips}" if flips else "")
    if flips:
        return None, [], f"not judged: {flips}"
    return True, [], f"{got['same']} rows by position"


def flip_note(t: Boundary, pairs: list[tuple[str, int]]) -> str:
    """The note of a trainer expert boundary whose rows no pass routed to its expert."""
    e = t.expert["index"] if t.expert else "?"
    return (
        f"not judged: {FLIP_REASON}: routed to expert {e} in the "
        f"full-sequence capture only {_where(pairs)}"
    )


def across_summary(
    passes: Capture, rows: list[dict[str, Any]], got: dict[str, dict[str, Any]],
    left: dict[str, list[tuple[str, int]]],
) -> dict[str, Any] | None:  # fmt: skip
    """``attrs["experts"]`` of a full-sequence against prefill + decode comparison (as
    :func:`expert_summary`'s; None: no expert boundary)."""
    mine = [r for r in rows if r.get("_expert") and r["boundary"] in got]
    if not mine and not left:
        return None
    differ: list[dict[str, Any]] = []
    culprits: list[dict[str, Any]] = []
    n_same = n_flip = 0
    for row in mine:
        g = got[row["boundary"]]
        if "why" in g:
            continue
        x = passes.boundary(row["boundary"])
        n_same += g["same"]
        n_flip += len(g["only_a"]) + len(g["only_b"])
        found = [_row(x, req, p, row["role"]) for req, p in g["differ"]]
        differ += found
        if row["role"] == "culprit":
            culprits += found
    n_flip += sum(len(v) for v in left.values())
    return {"n_boundaries": len(mine), "n_rows_identical": n_same, "n_rows_differ": len(differ),
            "n_rows_one_run": n_flip, "first_divergent": differ[0] if differ else None,
            "culprits": culprits, "differ": differ}  # fmt: skip


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
    expert's ``gate_up_proj`` (or ``up_proj``) rows (``up``)."""
    judged = [i for i in inputs if i["identical"] is not None]
    if any(i["identical"] is False for i in judged) or (
        up is not None and up["identical"] is False
    ):
        return "carrier", None
    if not judged:
        return "undetermined", "the experts module's inputs were not judged (not captured)"
    if up is not None and up["identical"] is None:
        stage = up["boundary"].rpartition(".")[2].partition("#")[0]
        return "undetermined", f"its {stage} rows were not judged: {up['boundary']}"
    return "culprit", "the experts module's inputs match: the difference enters in this expert"


def up_name(name: str, names: Container[str] = ()) -> str:
    """The boundary name of the same expert's ``gate_up_proj`` rows (of ``down_proj``'s),
    or of its ``up_proj`` rows where ``names`` holds that and not the former (an experts
    module without a gate: ``localize/experts.py``'s ``UNGATED_STAGES``)."""
    module, _, slot = name.rpartition(":")
    gated = f"{module}:{slot.replace('.down_proj', '.' + UP, 1)}"
    ungated = f"{module}:{slot.replace('.down_proj', '.' + UP_ONLY, 1)}"
    return ungated if gated not in names and ungated in names else gated


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
    "FLIP_REASON", "absent_reason", "across_note", "across_pairs", "across_summary", "concerns", "describe",
    "expert_lines", "expert_role", "expert_summary", "experts_modules", "flip_note",
    "inside_across", "inside_reasons", "judge_expert", "mark", "pair_rows", "up_name",
    "within_experts",
]  # fmt: skip
