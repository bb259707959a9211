"""The roles of values recorded by name (``dmlib.record``): no module's inputs stand
before them, so a recorded value that differs while every boundary recorded before it
matches is where the difference enters (the computation between the last boundary and
it: a ``log_softmax`` outside every module, say): the culprit; after a difference, a
carrier."""

from __future__ import annotations

from typing import Any

from dmlib.localize.capture.reader import Capture

RECORDED_NOTE = (
    "a value recorded by name (dmlib.record): everything recorded before it matches, so "
    "the difference enters in what computed it"
)


def recorded_roles(a: Capture, rows: list[dict[str, Any]]) -> None:
    """Set the roles of the differing ``recorded`` rows among the forward's ``rows`` (after
    :func:`~dmlib.localize.culprits._roles`, in place)."""
    names = {x.name for x in a.boundaries if x.recorded}
    before = False  # something recorded earlier differs
    for r in rows:
        if r["boundary"] in names and r["identical"] is False:
            if before:
                r["role"] = "carrier"
            else:
                r["role"] = "culprit"
                r["note"] = f"{r['note']}; {RECORDED_NOTE}" if r["note"] else RECORDED_NOTE
        if r["identical"] is False and r["role"] != "secondary":
            before = True


__all__ = ["recorded_roles"]
