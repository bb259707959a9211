"""``--group-l2``: the global relative L2 over groups of tensors, for ``compare`` and
``matrix`` (:mod:`dmlib.stats.group_l2`)."""

from __future__ import annotations

import argparse
from typing import Any

from dmlib.cli._table import table

_COLUMNS = ["group", "n_tensors", "numel", "norm_a", "norm_diff", "rel_l2", "n_not_compared"]


def add_group_l2(p: argparse.ArgumentParser) -> None:
    """The ``--group-l2`` option."""
    p.add_argument(
        "--group-l2",
        action="append",
        metavar="[LABEL=]PATTERN",
        help="also give ||a - b||_2 / ||a||_2 over the concatenation of a group's float "
        "tensors (in float64): 'all', 'adapter' (names holding lora_), or a pattern (glob, "
        "substring, re:REGEX) over the names as stored; repeatable; in --json as group_l2",
    )


def records(a: str, b: str, groups: list[str]) -> list[dict[str, Any]]:
    """One row per group for one pair of checkpoints."""
    from dmlib.stats.group_l2 import group_l2_records

    return group_l2_records(a, b, groups)


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
