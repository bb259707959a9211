"""``--group-l2``: the global relative L2 over groups of tensors, for ``compare``,
``matrix`` and ``ladder`` (:mod:`dmlib.stats.group_l2`). A group that matches no float
tensor both sides hold is refused (exit 2), never given as a relative L2 of 0."""

from __future__ import annotations

import argparse
from typing import Any

from dmlib.cli._table import table
from dmlib.errors import DmlibError

_COLUMNS = ["group", "n_tensors", "numel", "norm_a", "norm_diff", "rel_l2", "n_not_compared"]


def add_group_l2(p: argparse.ArgumentParser, *, names: str = "the names as stored") -> None:
    """The ``--group-l2`` option (``names``: what its patterns match)."""
    p.add_argument(
        "--group-l2",
        action="append",
        metavar="[LABEL=]PATTERN",
        help="also give ||a - b||_2 / ||a||_2 over the concatenation of a group's float "
        "tensors (in float64): 'all', 'adapter' (names holding lora_), or a pattern (glob, "
        f"substring, re:REGEX) over {names}; repeatable; in --json as group_l2; a group "
        "matching no float tensor both sides hold is refused",
    )


def records(a: str, b: str, groups: list[str]) -> list[dict[str, Any]]:
    """One row per group for one pair of checkpoints; a group of no tensor refused."""
    from dmlib.stats.group_l2 import group_l2_records

    rows = group_l2_records(a, b, groups)
    for r in rows:
        if r["n_tensors"] == 0:
            pattern = "every tensor" if r["pattern"] is None else f"pattern {r['pattern']!r}"
            raise DmlibError(
                f"--group-l2 {r['group']!r} ({pattern}) matches no float tensor held by both "
                f"{a} and {b} ({r['n_not_compared']} of its names one side lacks, or not float "
                "tensors of the same shape): a relative L2 over nothing is no figure"
            )
    return rows


def lines(rows: list[dict[str, Any]], *, pairs: bool = False) -> str:
    """The groups' table (``pairs``: with each row's ``a`` and ``b`` first)."""
    return table(rows, (["a", "b"] if pairs else []) + _COLUMNS)


def matrix_records(runs: dict[str, str], groups: list[str]) -> list[dict[str, Any]]:
    """The groups of every pair of runs, labelled ``a`` / ``b``."""
    labels = list(runs)
    out = []
    for i, la in enumerate(labels):
        for lb in labels[i + 1 :]:
            out += [{"a": la, "b": lb, **r} for r in records(runs[la], runs[lb], groups)]
    return out
