"""The routing report: which tokens' expert sets changed between two captures of an MoE
model, between which experts, and how near the tie was in each run.

Reads the ``router`` boundaries (:mod:`dmlib.localize.capture.routers`): per router call,
the chosen expert ids and, per token, the lowest chosen score and the highest other one.
A flip is a token whose set of chosen experts differs; its margin in a run is the chosen
minus the best other score (absolute, and in ULP of float32, the scores' dtype): a flip
with a margin of a few ULP in both runs is a near-tie decided by rounding. A flip is a
discrete event: what it changes downstream is its doing, not a numerical drift.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dmlib.errors import CaptureError
from dmlib.kernels.ulp import ulp_distance
from dmlib.localize.capture.format import Boundary, layer_of
from dmlib.localize.capture.reader import Capture
from dmlib.textsafe import escape

INDICES, MARGIN = "router.indices", "router.margin"


def values(c: Capture, x: Boundary) -> np.ndarray | None:
    """A router boundary's whole tensor, from the values the capture kept (None: none)."""
    kept = c.coverage.get("routers")
    got = kept.get(x.name) if isinstance(kept, dict) else None
    if got is None:
        return None
    try:
        arr = np.asarray(got, dtype=np.dtype(x.dtype))
    except (TypeError, ValueError, OverflowError):
        arr = None
    if arr is None or arr.shape != x.shape:
        raise CaptureError(
            f"router values of {x.name!r} are not a {x.dtype}{list(x.shape)} tensor", path=c.path
        )
    return arr


def _rows(c: Capture, x: Boundary, r: str) -> tuple[np.ndarray, list[int]] | None:
    """A request's rows of a router boundary and the positions they are at: per token
    through the row map, or (a decode step) the batch row the request fills alone, at the
    position after its prompt."""
    whole = values(c, x)
    if whole is None or c.row_map is None:
        return None
    if x.row_mapped and r in x.requests:
        rows = x.physical_rows(whole)[c.row_map.requests[r]]
        return rows, list(range(len(rows)))
    if c.batch and x.shape[:1] == (c.batch,):
        row, _ = c.row_map.sequence_row(r)
        if row is not None:
            return whole[row : row + 1], [c.requests[r] + x.step - 1]
    return None


def _margin_of(m: np.ndarray) -> tuple[float, int]:
    """(chosen minus best other score, that distance in float32 ULP)."""
    kth, nxt = np.float32(m[0]), np.float32(m[1])
    return float(kth) - float(nxt), int(ulp_distance(np.array([kth]), np.array([nxt]))[0])


def _flips(
    ia: np.ndarray, ib: np.ndarray, ma: np.ndarray | None, mb: np.ndarray | None, pos: list[int]
) -> list[dict[str, Any]]:
    out = []
    for i, p in enumerate(pos):
        sa, sb = sorted(int(e) for e in ia[i]), sorted(int(e) for e in ib[i])
        if sa == sb:
            continue
        flip: dict[str, Any] = {
            "position": p, "experts_a": sa, "experts_b": sb,
            "left": sorted(set(sa) - set(sb)), "joined": sorted(set(sb) - set(sa)),
        }  # fmt: skip
        for side, m in (("a", ma), ("b", mb)):
            if m is not None:
                flip[f"margin_{side}"], flip[f"margin_ulp_{side}"] = _margin_of(m[i])
        out.append(flip)
    return out


def unread(c: Capture) -> list[dict[str, str]]:
    """``[{boundary, reason}]``: the routers capture ``c`` found but could not read
    (``coverage.routers_unread``, :mod:`dmlib.localize.capture.routers`)."""
    items = c.coverage.get("routers_unread")
    if not isinstance(items, list):
        return []
    return [
        {"boundary": str(u.get("module")), "reason": f"router not read: {u.get('reason')}"}
        for u in items
        if isinstance(u, dict)
    ]


def routing_report(a: Capture, b: Capture, requests: list[str]) -> dict[str, Any] | None:
    """The flips between captures ``a`` and ``b`` (None: no router recorded or listed as
    not read in either).

    ``{"n_router_calls", "n_flips", "flips": [{request, router, boundary, step, position,
    experts_a, experts_b, left, joined, margin_a, margin_ulp_a, margin_b, margin_ulp_b,
    scores, effect}],
    "per_router": {router: flips}, "not_judged": [{boundary, reason}]}``, flips in
    execution order; a router either capture could not read is among ``not_judged``.
    """
    calls = [x for x in a.boundaries if x.router and x.slot == INDICES]
    not_judged: list[dict[str, str]] = []
    for u in unread(a) + unread(b):
        if u not in not_judged:
            not_judged.append(u)
    if not calls and not not_judged:
        return None
    flips: list[dict[str, Any]] = []
    kinds = a.coverage.get("router_scores")
    kinds = kinds if isinstance(kinds, dict) else {}
    for x in calls:
        if x.name not in b:
            not_judged.append({"boundary": x.name, "reason": "absent from the second capture"})
            continue
        y = b.boundary(x.name)
        mname = x.name.replace(INDICES, MARGIN, 1)
        for r in requests:
            got_a, got_b = _rows(a, x, r), _rows(b, y, r)
            if got_a is None or got_b is None or len(got_a[1]) != len(got_b[1]):
                not_judged.append({"boundary": x.name, "reason": f"request {r!r}'s rows not "
                                   "attributable in both captures"})  # fmt: skip
                continue
            ma = _rows(a, a.boundary(mname), r) if mname in a else None
            mb = _rows(b, b.boundary(mname), r) if mname in b else None
            for f in _flips(got_a[0], got_b[0], None if ma is None else ma[0],
                            None if mb is None else mb[0], got_a[1]):  # fmt: skip
                flips.append({"request": r, "router": x.module, "boundary": x.name,
                              "step": x.step, **f, "scores": kinds.get(x.module)})  # fmt: skip
    _effects(a, b, flips)
    per: dict[str, int] = {}
    for f in flips:
        per[f["router"]] = per.get(f["router"], 0) + 1
    return {"n_router_calls": len(calls), "n_flips": len(flips), "flips": flips,
            "per_router": per, "not_judged": not_judged}  # fmt: skip


def _block_output(c: Capture, f: dict[str, Any], outs: dict[Any, Boundary]) -> Boundary | None:
    """The output of the module that called the flip's router (its name less the last
    part: the MoE block), in the same pass and call, row-mapped; None where there is none.
    ``outs``: (module, pass, call) -> each module's ``output0`` boundary."""
    x = outs.get((f["router"].rpartition(".")[0], f["step"], c.boundary(f["boundary"]).call))
    return x if x is not None and x.row_mapped else None


def _effects(a: Capture, b: Capture, flips: list[dict[str, Any]]) -> None:
    """Set each flip's ``effect`` (in place): what the flips of one router call did to the
    MoE block's output, per position of their request: the largest absolute difference at
    the flipped position and the largest at any position no flip of that call touched (the
    flipped token standing out), where both captures dumped the block's rows; else None.
    ``{boundary, at_flip, elsewhere, elsewhere_position}`` (bit-identical rows count 0, NaN
    against a number inf; the position None where every other position's rows are
    bit-identical). The block's rows are read once per router call and request."""
    outs = {(x.module, x.step, x.call): x for x in a.boundaries
            if x.kind == "output" and x.slot == "output0"}  # fmt: skip
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for f in flips:
        groups.setdefault((f["boundary"], f["request"]), []).append(f)
    for (_, r), group in groups.items():
        xa = _block_output(a, group[0], outs)
        per = None
        if xa is not None and xa.name in b and r in xa.requests:
            xb = b.boundary(xa.name)
            if a.dumped(xa, r) and b.dumped(xb, r):
                ta, tb = np.asarray(a.tensor(xa, r)), np.asarray(b.tensor(xb, r))
                per = _per_position(ta, tb) if ta.shape == tb.shape and ta.ndim else None
        hit = {f["position"] for f in group}
        for f in group:
            if per is None or xa is None or f["position"] >= per.shape[0]:
                f["effect"] = None
                continue
            rest = [p for p in range(per.shape[0]) if p not in hit]
            top = max(rest, key=lambda p: per[p]) if rest else None
            top = None if top is None or per[top] == 0 else top
            f["effect"] = {"boundary": xa.name, "at_flip": float(per[f["position"]]),
                           "elsewhere": 0.0 if top is None else float(per[top]),
                           "elsewhere_position": top}  # fmt: skip


def _per_position(ta: np.ndarray, tb: np.ndarray) -> np.ndarray | None:
    """Per row, the largest absolute difference (float64) of two arrays of one shape and
    dtype: 0 where the bits are equal, inf where a NaN meets anything else (None: an
    element size with no unsigned integer view)."""
    if ta.dtype != tb.dtype or ta.dtype.itemsize not in (1, 2, 4, 8):
        return None
    ua, ub = ta.reshape(ta.shape[0], -1), tb.reshape(tb.shape[0], -1)
    bits = np.dtype(f"u{ta.dtype.itemsize}")
    same = np.ascontiguousarray(ua).view(bits) == np.ascontiguousarray(ub).view(bits)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(ua.astype(np.float64) - ub.astype(np.float64))
    d = np.where(same, 0.0, np.where(np.isnan(d), np.inf, d))
    return d.max(axis=1) if d.shape[1] else np.zeros(d.shape[0])


def _state_before(r: dict[str, Any], f: dict[str, Any]) -> bool:
    """A state of the flip's layer or one before it (walked at the pass's end, after the
    flip in record order, but written by the layer's mixer before its MoE block's router
    ran): not downstream of it."""
    if not r["_state"]:
        return False
    mine, flip = layer_of(r["_slot"]), layer_of(f["boundary"].split(":", 1)[0])
    return mine is not None and flip is not None and int(mine) <= int(flip)


def flip_notes(rows: list[dict[str, Any]], report: dict[str, Any] | None) -> None:
    """Name the expert flip in the note of every boundary that differs after it in its
    pass (in place): what a flip changes downstream is its doing, a discrete event."""
    if not report or not report["flips"]:
        return
    first: dict[int, dict[str, Any]] = {}
    for f in report["flips"]:
        first.setdefault(f["step"], f)
    seen: set[int] = set()
    for r in rows:
        f = first.get(r["_step"])
        if f is None:
            continue
        if r["boundary"] == f["boundary"]:
            seen.add(r["_step"])
        elif (
            r["_step"] in seen
            and r["identical"] is False
            and not r["_router"]
            and not _state_before(r, f)
        ):
            extra = (f"downstream of the expert flip at {f['boundary']} (request "
                     f"{f['request']!r}, position {f['position']})")  # fmt: skip
            r["note"] = f"{r['note']}; {extra}" if r["note"] else extra


def _margin_text(f: dict[str, Any], side: str) -> str:
    if f"margin_{side}" not in f:
        return "?"
    return f"{f[f'margin_{side}']:.3g} ({f[f'margin_ulp_{side}']} ULP)"


def _effect_text(e: dict[str, Any] | None) -> str:
    if not e:
        return ""
    where = "" if e["elsewhere_position"] is None else f" (position {e['elsewhere_position']})"
    return (f"; at {e['boundary']} max |diff| {e['at_flip']:.3g} here, "
            f"{e['elsewhere']:.3g} at most elsewhere{where}")  # fmt: skip


def flip_lines(report: dict[str, Any] | None, limit: int = 8) -> list[str]:
    """The routing report as a few lines of text (none where no router was recorded)."""
    if report is None:
        return []
    skipped = report["not_judged"]
    if not report["n_flips"]:
        line = f"routing: no expert set changed ({report['n_router_calls']} router calls)"
        lines = [line + (f"; {len(skipped)} not judged" if skipped else "")]
    else:
        per = escape(", ".join(f"{k}: {v}" for k, v in report["per_router"].items()))
        n = report["n_flips"]
        lines = [f"routing: {n} token{'' if n == 1 else 's'} changed experts ({per})"]
    # the routers no choice was read from, by name (a request's rows are counted above)
    blind = [u for u in skipped if u["reason"].startswith("router not read")]
    lines += [escape(f"  not judged: {u['boundary']}: {u['reason']}") for u in blind[:limit]]
    if not report["n_flips"]:
        return lines
    for f in report["flips"][:limit]:
        ma, mb = _margin_text(f, "a"), _margin_text(f, "b")
        lines.append(escape(
            f"  {f['boundary']} request {f['request']!r} position {f['position']}: experts "
            f"{f['experts_a']} -> {f['experts_b']}; margin k-th minus next: A {ma}, B {mb}"
            + (f" on {f['scores']}" if f.get("scores") else "") + _effect_text(f.get("effect"))
        ))  # fmt: skip
    if len(report["flips"]) > limit:
        lines.append(f"  and {len(report['flips']) - limit} more")
    return lines


__all__ = ["flip_lines", "flip_notes", "routing_report", "unread", "values"]
