"""What the commands print and parse alike: name selection, LABEL=PATH arguments, plain-text
tables (numbers in them written by :mod:`dmlib.numfmt`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pandas is imported by the commands that need it, not by the parser
    import pandas as pd

from dmlib.errors import DmlibError
from dmlib.numfmt import MISSING, missing, short
from dmlib.textsafe import LIMIT, cut, shown


def add_selection(p: argparse.ArgumentParser) -> None:
    """``--include`` / ``--exclude`` (glob or ``re:REGEX``, repeatable), as dmlib.compare takes them."""
    for opt in ("--include", "--exclude"):
        p.add_argument(
            opt,
            action="append",
            metavar="PAT",
            help="with * ? [ a glob on the whole name, else a substring of the name; or "
            "re:REGEX; repeatable",
        )


def fmt(v: Any) -> str:
    """One table cell: '-' for missing, numbers as :func:`dmlib.numfmt.short` writes them;
    text from data escaped and cut (:func:`dmlib.textsafe.shown`)."""
    if missing(v):
        return MISSING
    if isinstance(v, float):
        return short(v)
    if isinstance(v, tuple):
        return shown("(" + ",".join(map(str, v)) + ")")
    return shown(v)


def table(
    rows: pd.DataFrame | list[dict[str, Any]], cols: list[str], cell: Callable[[Any], str] = fmt
) -> str:
    """Left-aligned columns separated by two spaces, with a header line.

    Every cell is escaped, and cut past twice :data:`dmlib.textsafe.LIMIT` characters,
    whatever ``cell`` made of it (:func:`fmt` cuts at the limit itself).
    """
    recs = rows.to_dict("records") if hasattr(rows, "to_dict") else rows
    cells = [[cut(cell(r.get(c)), 2 * LIMIT) for c in cols] for r in recs]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(x.ljust(w) for x, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def labelled_paths(items: list[str], *, optional: bool = False) -> dict[str, str]:
    """``{label: path}`` from ``LABEL=PATH`` items (``optional``: a bare PATH labels itself)."""
    runs: dict[str, str] = {}
    for item in items:
        label, sep, path = item.partition("=")
        if not sep:
            if not optional:
                raise DmlibError(f"expected LABEL=PATH, got {item!r}")
            label, path = item, item  # unlabelled: the path names the run
        if not label or not path:
            raise DmlibError(f"expected LABEL=PATH, got {item!r}")
        if label in runs:
            raise DmlibError(f"label {label!r} given twice")
        runs[label] = path
    return runs
