"""A training checkpoint compared component by component, and two training runs step by step.

A Hugging Face training checkpoint folder (:mod:`dmlib.io.hf_trainer`) holds the weights
(unprefixed names), the optimizer (``optimizer.``), the scheduler (``scheduler.``), the RNG
states (``rng.``) and the trainer state (``trainer.``). :func:`components` sorts one
:func:`dmlib.compare` result into those components, each "identical", "differs", "not
compared" (a file left unread, names on one side only) or "absent"; the RNG states also
generator by generator ("same generator state" / "differs"). :func:`compare_runs` does
it at every step two run folders share, and answers "is the resume bit-exact, and if
not, which component parts first, at which step".

The data order is not in the files: when every component is identical at one step and
the weights differ at the next, what the steps between consumed (the batches, or the
arithmetic on them) differed; the loss curve (``trainer.log_history.loss``) says at which
logged step it first shows.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from dmlib.stats.verdicts import RunsVerdict

__all__ = ["COMPONENTS", "compare_runs", "component_of", "components", "printable"]

COMPONENTS = ("weights", "optimizer", "scheduler", "rng", "trainer")
_FILES = {"optimizer": "optimizer", "scheduler": "scheduler", "rng": "rng", "random": "rng"}


def component_of(name: str) -> str:
    """The component a tensor or scalar name belongs to (``"weights"`` when unprefixed)."""
    head = name.split(".", 1)[0]
    if head == "step":
        return "trainer"
    return head if head in COMPONENTS[1:] else "weights"


def printable(text: Any) -> str:
    """Text from a file made safe for a terminal: control characters as escapes."""
    s = str(text)
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)


def _unread(attrs: Mapping[str, Any]) -> dict[str, list[str]]:
    """Component -> notes of its files left unread on either side."""
    out: dict[str, list[str]] = {}
    for side in ("a", "b"):
        for note in (attrs.get(f"not_read_{side}") or "").split("; "):
            if note:
                head = note.split(":", 1)[0].split("_", 1)[0].split(".", 1)[0]
                out.setdefault(_FILES.get(head, "weights"), []).append(f"{side}: {note}")
    return out


def components(rows: list[dict[str, Any]], attrs: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per component of a compared pair of checkpoint folders (module docstring).

    Each row: ``component``, ``status``, ``n_tensors``, ``n_tensors_diff``,
    ``n_scalars_diff``, ``first`` (the first differing name, else None), ``detail`` (why
    a component was not compared, the differing scalars' names), and for ``rng`` a
    ``generators`` list of ``(generator, "same generator state" | "differs")``.
    """
    unread = _unread(attrs)
    scal = attrs.get("scalars_diff") or {}
    only = [*attrs.get("only_in_a", []), *attrs.get("only_in_b", [])]
    only += [m["name"] for m in attrs.get("mismatched", [])]
    out = []
    for comp in COMPONENTS:
        mine = [r for r in rows if component_of(str(r["name"])) == comp]
        diff = [
            r for r in mine if int(r["n_diff"]) > 0 or r.get("data_hash_a") != r.get("data_hash_b")
        ]
        sdiff = [k for k in scal if component_of(k) == comp]
        gaps = [n for n in only if component_of(n) == comp]
        names = [k for k in attrs.get("scalar_names", []) if component_of(k) == comp]
        present = mine or names or sdiff or gaps or comp in unread
        if not present:
            status = "absent"
        elif diff or sdiff:
            status = "differs"
        elif gaps or comp in unread:
            status = "not compared"
        else:
            status = "identical"
        detail = []
        if comp in unread:
            detail.append("not read: " + "; ".join(unread[comp]))
        if gaps:
            detail.append(f"{len(gaps)} names on one side only or of another shape, e.g. {gaps[0]}")
        if sdiff:
            detail.append(
                f"scalars differ: {', '.join(sdiff[:4])}{' ...' if len(sdiff) > 4 else ''}"
            )
        row: dict[str, Any] = {
            "component": comp,
            "status": status,
            "n_tensors": len(mine),
            "n_tensors_diff": len(diff),
            "n_scalars_diff": len(sdiff),
            "first": diff[0]["name"] if diff else (sdiff[0] if sdiff else None),
            "detail": "; ".join(detail) or None,
        }
        if comp == "rng" and present:
            row["generators"] = _generators(mine, names, sdiff, gaps)
        out.append(row)
    return out


def _gen(name: str) -> str:
    """The generator a ``rng.`` name belongs to: ``cpu``, ``numpy``, ``0.python``..."""
    parts = name.split(".")[1:]
    return ".".join(parts[:2]) if parts and parts[0].isdigit() else (parts[0] if parts else "")


def _generators(
    rows: list[dict[str, Any]], names: list[str], sdiff: list[str], gaps: list[str]
) -> list[tuple[str, str]]:
    """(generator, "same generator state" | "differs" | "not compared") per RNG state."""
    worst: dict[str, int] = {_gen(k): 0 for k in names}  # 0 same, 1 not compared, 2 differs
    for r in rows:
        same = int(r["n_diff"]) == 0 and r.get("data_hash_a") == r.get("data_hash_b")
        g = _gen(str(r["name"]))
        worst[g] = max(worst.get(g, 0), 0 if same else 2)
    for k in gaps:
        worst[_gen(k)] = max(worst.get(_gen(k), 0), 1)
    for k in sdiff:
        worst[_gen(k)] = 2
    words = ("same generator state", "not compared", "differs")
    return [(g, words[v]) for g, v in sorted(worst.items())]


def compare_runs(run_a: str | os.PathLike[str], run_b: str | os.PathLike[str]) -> RunsVerdict:
    """Two Trainer output folders (``checkpoint-N/`` inside) compared at every shared step.

    Returns
    -------
    RunsVerdict
        ``bool()`` is ``bit_exact``, ``str()`` the verdict line the command line prints; a
        read-only mapping of ``to_dict()`` (the JSON): ``steps`` (compared), ``only_in_a``
        / ``only_in_b`` (steps of one run only), ``by_step``: ``{step: components(...)}``,
        ``first_diff``: ``{component: the first step at which it differs}`` (components
        never differing are absent), ``first_step`` (the first step at which anything
        differs, else None), ``first_components`` (those differing there),
        ``loss_parts_at`` (the first logged step whose loss differs, from
        ``trainer.log_history.loss``, else None), ``bit_exact`` (every component identical
        at every shared step; a resumed run lacks the steps before its resume, listed in
        ``only_in_a``), ``inconclusive`` (components not compared at some step).
    """
    from dmlib.io import hf_trainer, open_tensors
    from dmlib.stats.compare import compare_records

    ca, cb = hf_trainer.checkpoints_of(run_a), hf_trainer.checkpoints_of(run_b)
    for run, found in ((run_a, ca), (run_b, cb)):
        if not found:
            from dmlib.errors import DmlibError

            raise DmlibError("holds no checkpoint-N/ training checkpoint folder", path=run)
    steps = sorted(set(ca) & set(cb))
    by_step: dict[int, list[dict[str, Any]]] = {}
    first: dict[str, int] = {}
    loss_at = None
    inconclusive: set[str] = set()
    for step in steps:
        rows, attrs = compare_records(ca[step], cb[step], hash="none")
        comps = components(rows, attrs)
        by_step[step] = comps
        for c in comps:
            if c["status"] == "differs":
                first.setdefault(c["component"], step)
            elif c["status"] == "not compared":
                inconclusive.add(c["component"])
        loss = next((r for r in rows if r["name"] == "trainer.log_history.loss"), None)
        if loss_at is None and loss is not None and int(loss["n_diff"]) > 0:
            with open_tensors(ca[step]) as ts:
                logged = ts["trainer.log_history.loss.steps"].load()
                loss_at = int(logged[loss["first_diff"][0]])
    first_step = min(first.values()) if first else None
    return RunsVerdict(
        steps=steps,
        only_in_a=sorted(set(ca) - set(cb)),
        only_in_b=sorted(set(cb) - set(ca)),
        by_step=by_step,
        first_diff=dict(sorted(first.items(), key=lambda kv: kv[1])),
        first_step=first_step,
        first_components=[k for k, v in first.items() if v == first_step],
        loss_parts_at=loss_at,
        bit_exact=bool(steps) and not first and not inconclusive,
        inconclusive=sorted(inconclusive),
    )
