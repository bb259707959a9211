"""Helpers every subcommand shares: name selection, LABEL=PATH arguments, plain-text tables."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pandas is imported by the commands that need it, not by the parser
    import pandas as pd

from dmlib.errors import DmlibError
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


def add_format(p: argparse.ArgumentParser) -> None:
    """``--format``: read every input checkpoint as this format instead of detecting it."""
    from dmlib.io import FORMATS

    p.add_argument(
        "--format", choices=list(FORMATS), help="read every input as this format (skip detection)"
    )


def missing(v: Any) -> bool:
    """True for None and pandas' NA (checked only when pandas is loaded: it made the NA)."""
    pd = sys.modules.get("pandas")
    return v is None or (pd is not None and v is pd.NA)


def fmt(v: Any) -> str:
    """One table cell: '-' for missing, 4 significant digits, scientific for tiny or huge;
    text from data escaped and cut (:func:`dmlib.textsafe.shown`)."""
    if missing(v):
        return "-"
    if isinstance(v, float):
        if v != v:
            return "-"
        return f"{v:.3e}" if v and (abs(v) < 1e-3 or abs(v) >= 1e4) else f"{v:.4g}"
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
