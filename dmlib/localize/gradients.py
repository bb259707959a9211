"""The backward pass of two captures judged on its own (``capture(..., backward=True)``).

A capture lists its gradient boundaries in the order their hooks fired: backward order.
They are judged like the forward's (per request through the row map, the same controls),
and given roles of their own, in that order:

- ``grad_output`` (what reaches a module's output from downstream) plays the forward's
  input: ``entry`` where it differs before any backward boundary does, else ``carrier``;
- ``grad_input`` (what the module's backward makes) plays the output: ``culprit`` where it
  differs while the module call's ``grad_output`` all match and the forward matched,
  ``carrier`` where one of them differs (or the forward does: the backward reads the
  forward's saved tensors), ``undetermined`` where none was judged; a module whose
  ``grad_output`` matches and that contains a culprit only encloses it;
- a parameter's ``.grad`` (``param_grad``): ``culprit`` where nothing before it differs
  (forward or backward), else ``carrier``.

The summary is ``attrs["backward"]`` of :func:`~dmlib.localize.boundaries.compare_captures`,
apart from the forward's ``first_divergent_boundary`` and ``culprit``; a difference in the
backward alone makes the comparison's status ``different``. A backward pass that raised
partway in either capture (``metadata.backward.failed``) is listed among the unjudged:
what it recorded is partial and its parameters' ``.grad`` absent, so the backward is
never ``identical`` then (``inconclusive`` where nothing differs).
"""

from __future__ import annotations

from typing import Any

from dmlib.localize.capture.reader import Capture

BACKWARD_KINDS = ("grad_output", "grad_input", "param_grad")
FORWARD_NOTE = "the forward differs ({}): the backward reads its saved tensors"


class _BackwardRows(list[dict[str, Any]]):
    """The backward rows of a comparison, with the first capture's failed passes."""

    failed: list[dict[str, Any]]


def _failed(c: Capture | None) -> list[dict[str, Any]]:
    """The backward passes of capture ``c`` that raised before their end (its manifest)."""
    bw = c.metadata.get("backward") if c is not None else None
    failed = bw.get("failed") if isinstance(bw, dict) else None
    return [f for f in failed if isinstance(f, dict)] if isinstance(failed, list) else []


def split_backward(
    a: Capture, rows: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(forward rows, backward rows) of a comparison; each backward row gets ``_bkind``."""
    kinds = {x.name: x.category.name for x in a.boundaries}
    fwd: list[dict[str, Any]] = []
    bwd = _BackwardRows()
    bwd.failed = _failed(a)
    for r in rows:
        kind = kinds.get(r["boundary"])
        if kind in BACKWARD_KINDS:
            r["_bkind"] = kind
            bwd.append(r)
        else:
            fwd.append(r)
    return fwd, bwd


def backward_roles(rows: list[dict[str, Any]], forward_first: str | None) -> None:
    """Fill role, new_blocks and inherited_blocks of the backward rows (in place, in the
    order the hooks fired); ``forward_first``: the forward's first divergent boundary."""
    outs: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in rows:
        if r["_bkind"] == "grad_output":
            outs.setdefault((r["module"], r["call"], r["_step"]), []).append(r)
    seen_diff: set[int] = set()
    seen_any = forward_first is not None
    candidates = []
    for r in rows:
        diff, base = set(r["diff_blocks"]), seen_diff
        if r["identical"] is None:
            r["role"] = "unjudged"
        elif r["identical"]:
            r["role"] = "clean"
        elif r["_bkind"] == "grad_output":
            r["role"] = "carrier" if seen_any else "entry"
        elif r["_bkind"] == "param_grad":
            r["role"] = "carrier" if seen_any else "culprit"
            base = base if seen_any else set()
        else:
            ins = [i for i in outs.get((r["module"], r["call"], r["_step"]), [])
                   if i["identical"] is not None]  # fmt: skip
            if not ins:
                r["role"] = "undetermined"
            elif not all(i["identical"] for i in ins):
                r["role"] = "carrier"
                base = set().union(*(set(i["diff_blocks"]) for i in ins))
            elif forward_first is not None:
                r["role"] = "carrier"
                note = FORWARD_NOTE.format(forward_first)
                r["note"] = f"{r['note']}; {note}" if r["note"] else note
            else:
                r["role"], base = "culprit", set()
                candidates.append(r)
        r["new_blocks"] = sorted(diff - base)
        r["inherited_blocks"] = sorted(diff & base)
        if r["identical"] is False:
            seen_any = True
            seen_diff = seen_diff | diff
    for r in candidates:  # a module containing a culprit only encloses it
        inner = r["module"] + "."
        if any(o is not r and o["module"].startswith(inner) for o in candidates):
            r["role"] = "encloses-culprit"


def backward_summary(
    rows: list[dict[str, Any]], attrs: dict[str, Any], b: Capture | None = None
) -> dict[str, Any] | None:
    """``attrs["backward"]``: the backward's first divergent boundary, culprit, entry and
    status (None where neither capture recorded a backward); a difference there makes
    ``attrs["status"]`` "different", a backward boundary not judged (or one only the
    second capture ``b`` recorded, or a backward pass that raised in either) an "identical"
    forward "inconclusive"."""
    failed = [("first", f) for f in getattr(rows, "failed", [])]
    failed += [("second", f) for f in _failed(b)]
    if not rows:
        only_b = [x.name for x in (b.boundaries if b is not None else [])
                  if x.category.name in BACKWARD_KINDS]  # fmt: skip
        if not only_b and not failed:
            return None
        rows = [{"boundary": n, "identical": None, "role": "unjudged",
                 "note": "not judged: absent from the first capture"} for n in only_b]  # fmt: skip
    diverged = [r["boundary"] for r in rows if r["identical"] is False]
    culprits = [r["boundary"] for r in rows if r["role"] == "culprit"]
    entries = [r["boundary"] for r in rows if r["role"] == "entry"]
    unjudged = [
        {"boundary": r["boundary"], "reason": (r["note"] or "").removeprefix("not judged: ")}
        for r in rows
        if r["identical"] is None
    ]
    unjudged += [
        {"boundary": f"backward pass {f.get('pass')} ({side} capture)",
         "reason": f"it raised before its end ({f.get('error')}): its gradients are partial, "
                   "its parameters' .grad not recorded"}
        for side, f in failed
    ]  # fmt: skip
    status = "different" if diverged else ("inconclusive" if unjudged else "identical")
    if status == "different":
        attrs["status"] = "different"
    elif status == "inconclusive" and attrs.get("status") == "identical":
        attrs["status"] = "inconclusive"
    return {
        "status": status,
        "first_divergent_boundary": diverged[0] if diverged else None,
        "culprit": culprits[0] if culprits else None,
        "culprits": culprits,
        "entry": entries[0] if entries else None,
        "n_boundaries": len(rows),
        "n_comparable": sum(r["identical"] is not None for r in rows),
        "n_divergent": len(diverged),
        "unjudged": unjudged,
    }


def backward_lines(summary: dict[str, Any] | None) -> list[str]:
    """The backward's lines of the verdict's text (none without a backward)."""
    if summary is None:
        return []
    n = summary["n_boundaries"]
    if summary["status"] == "identical":
        return [f"backward: all {n} gradient boundaries match"]
    if summary["status"] == "inconclusive":
        return [
            f"backward: no difference in {summary['n_comparable']} judged gradient boundaries; "
            f"{len(summary['unjudged'])} not judged"
        ]
    lines = [f"backward: first divergent boundary (backward order): "
             f"{summary['first_divergent_boundary']}"]  # fmt: skip
    if summary["culprit"] is not None:
        lines.append(f"backward culprit (gradients in identical, gradient out differs): "
                     f"{summary['culprit']}")  # fmt: skip
    elif summary["entry"] is not None:
        lines.append(f"backward: the difference enters at {summary['entry']}")
    return lines


__all__ = ["backward_lines", "backward_roles", "backward_summary", "split_backward"]
