"""The op level of a study's captures: first divergent op, culprit op, fp64 arbitration,
and the patch test recorded where the live model ran.

:func:`op_level` computes from the study's ``[captures.ops]`` folders (no torch: the
comparison reads hashes, the float64 replay runs in numpy where torch is absent) and
quotes the patch test from the findings file, which names the machine that ran it (a
patch test re-runs the model, so a report over committed files can only quote it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from dmlib.errors import DmlibError
from dmlib.report.htmlsafe import md_code as _c
from dmlib.report.htmlsafe import md_text as _t
from dmlib.report.prose import fmt

__all__ = ["OpLevel", "op_level"]


@dataclass
class OpLevel:
    """What the op-level captures show: numbers to record, sentences, the arbitration table."""

    numbers: dict[str, Any]
    lines: list[str]
    table: pd.DataFrame = field(default_factory=pd.DataFrame)


def _patch_sentence(p: dict[str, Any] | None, what: str) -> str | None:
    if not p:
        return None
    verdict = {True: "confirmed", False: "not confirmed", None: "not run"}[p.get("confirmed")]
    where = p["boundary"].split(", ")
    at = _c(where[0]) + (f" and {len(where) - 1} more" if len(where) > 1 else "")
    text = f"{what} at {at}: {verdict}"
    if p.get("first_still_differing"):
        text += f" (first boundary still differing: {_c(p['first_still_differing'])})"
    return text + (f"; {_t(p['reason'])}" if p.get("reason") else "")


def _threads(n: Any) -> str:
    return f"{fmt(n)} thread" + ("" if n == 1 else "s")


def op_level(captures: Any, *, backend: str = "auto") -> OpLevel:
    """Compare ``captures.ops`` (reference first) and arbitrate the culprit op.

    Parameters
    ----------
    captures
        A study's :class:`~dmlib.report.study.StudyCaptures` with ``ops`` (two folders) and
        optionally ``op_findings`` (the JSON written by ``python -m dmlib.lab packed_ops``
        or any file with the same ``machine`` and ``findings`` keys).
    backend
        Where :func:`dmlib.arbitrate` replays the op in float64.
    """
    from dmlib.localize.arbitrate import arbitrate
    from dmlib.localize.boundaries import compare_captures

    (ref, a), (other, b) = list(captures.ops.items())
    request = captures.request
    recorded: dict[str, Any] = {}
    if captures.op_findings is not None:
        try:
            recorded = json.loads(Path(captures.op_findings).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise DmlibError(f"op findings unreadable: {err}", path=captures.op_findings) from None
    machine = recorded.get("machine")
    on = f"on {_t(machine)}" if machine else "on a machine the study does not record"
    at = compare_captures(a, b, request=request).attrs
    first, culprit = at["first_divergent_op"], at["culprit_op"]
    numbers: dict[str, Any] = {
        "op_first_divergent": first,
        "op_culprit": culprit,
        "op_machine": machine,
    }
    lines = []
    ref_t, other_t = _t(ref), _t(other)
    if first is None:
        lines.append(f"Op level ({ref_t} vs {other_t}, captured {on}): no recorded op differs.")
    else:
        lines.append(
            f"Op level ({ref_t} vs {other_t}, captured {on}): the first divergent op is {_c(first)}; "
            + (f"the culprit op (inputs identical, output differs) is {_c(culprit)}."
               if culprit else "no op has identical inputs and a differing output (no culprit op).")
        )  # fmt: skip
    table = pd.DataFrame()
    if culprit is not None:
        arb = arbitrate(a, b, culprit, request=request, backend=backend)
        table = arb.table
        numbers["op_arbitration_verdict"] = arb.verdict
        for row in arb.table.to_dict(orient="records"):
            numbers[f"op_arbitration_{row['run']}_max_ulp"] = row["max_ulp"]
            numbers[f"op_arbitration_{row['run']}_rel_err"] = row["rel_err"]
        lines.append(
            f"fp64 arbitration of {_c(culprit)} (replayed in float64 from the dumped inputs; "
            f"a = {ref_t}, b = {other_t}): {_t(arb.verdict)}: {_t(arb.reason)}."
        )
    found = recorded.get("findings") or {}
    patch = found.get("patch")
    numbers["op_patch_confirmed"] = None if not patch else patch.get("confirmed")
    if not recorded:
        lines.append("No patch test is recorded (it re-runs the model: `dmlib.patch_test`).")
    elif not patch:
        lines.append(f"No patch test was recorded {on}: its capture named no culprit op.")
    else:
        parts = [
            _patch_sentence(patch, "patching the reference's rows"),
            _patch_sentence(found.get("patch_every_layer"), "the same op in every layer"),
            _patch_sentence(found.get("patch_control"), "control, an earlier matching op"),
        ]
        lines.append(
            f"Patch test, recorded {on} (torch {_t(found.get('torch', '?'))}, "
            f"{_threads(found.get('threads'))}): " + "; ".join(p for p in parts if p) + "."
        )
        if found.get("culprit_op") != culprit:
            lines.append(
                f"The recorded patch test concerns {_c(found.get('culprit_op'))}, while these "
                + (f"captures name {_c(culprit)}" if culprit else "captures name no culprit op")
                + ": they were not made on the same machine or settings."
            )
    return OpLevel(numbers, lines, table)
