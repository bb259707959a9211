"""What the commands print and parse alike: name selection, LABEL=PATH arguments, plain-text
tables (numbers in them written by :mod:`dmlib.numfmt`)."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
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
    rows: pd.DataFrame | list[dict[str, Any]],
    cols: list[str],
    cell: Callable[[Any], str] = fmt,
    *,
    key: int = 1,
) -> str:
    """Left-aligned columns separated by two spaces, with a header line; wider than
    :func:`width`, the columns in blocks one under the other, each led by the first ``key``
    columns (what names a row).

    Every cell is escaped, and cut past twice :data:`dmlib.textsafe.LIMIT` characters,
    whatever ``cell`` made of it (:func:`fmt` cuts at the limit itself).
    """
    recs = rows.to_dict("records") if hasattr(rows, "to_dict") else rows
    cells = [[cut(cell(r.get(c)), 2 * LIMIT) for c in cols] for r in recs]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(cols)]
    blocks = column_blocks(widths, width(), key=key)
    return "\n\n".join(_block(cols, cells, widths, b) for b in blocks)


def width() -> int | None:
    """The width tables fit: ``COLUMNS`` when set, else the terminal's when stdout is one;
    None (no limit) for output into a pipe or a file, which keeps one line per row."""
    text = os.environ.get("COLUMNS", "")
    if text.strip().isdigit() and int(text) > 0:
        return int(text)
    try:
        if sys.stdout.isatty():
            return shutil.get_terminal_size().columns
    except (AttributeError, ValueError, OSError):
        pass
    return None


def column_blocks(widths: list[int], limit: int | None, *, key: int = 1) -> list[list[int]]:
    """The columns of each block of a table ``limit`` characters wide: all in one when
    they fit (or no limit), else the first ``key`` columns (the row's name) repeated in
    each block with as many of the others as fit beside them (at least one)."""
    key = max(1, min(key, len(widths) - 1))
    if limit is None or sum(widths) + 2 * (len(widths) - 1) <= limit or len(widths) <= key:
        return [list(range(len(widths)))]
    head = list(range(key))
    base = sum(widths[:key]) + 2 * (key - 1)
    blocks, current, used = [], list(head), base
    for i in range(key, len(widths)):
        if len(current) > key and used + 2 + widths[i] > limit:
            blocks.append(current)
            current, used = list(head), base
        current.append(i)
        used += 2 + widths[i]
    blocks.append(current)
    return blocks


def _block(cols: list[str], cells: list[list[str]], widths: list[int], keep: list[int]) -> str:
    """The lines of the table's columns ``keep``: the header, then one line per row."""
    lines = ["  ".join(cols[i].ljust(widths[i]) for i in keep).rstrip()]
    lines += ["  ".join(row[i].ljust(widths[i]) for i in keep).rstrip() for row in cells]
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
