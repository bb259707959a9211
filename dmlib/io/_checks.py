"""What every reader checks before it trusts a number from a file.

A shape or an offset pair read from a header decides how many bytes a tensor claims;
these checks run before any byte is mapped, so a hostile or damaged header fails with a
message naming the value instead of a wrong-sized array or a numpy overflow later.
Each returns why the value is unusable, or None.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

__all__ = [
    "MAX_NDIM", "TilingProblem", "offsets_problem", "shape_problem", "short_repr", "tiling_problem",
]  # fmt: skip

MAX_NDIM = 64  # numpy's limit


def shape_problem(shape: Any, itemsize: int) -> str | None:
    """Why ``shape`` cannot describe a numpy array of ``itemsize``-byte elements (None if it can).

    Readers check this before trusting a shape from a file: a zero-length tensor whose
    other dimensions claim 2**63 elements would pass every byte-length check and only
    fail later, in ``load()``.
    """
    if not isinstance(shape, (list, tuple)):
        return f"shape {short_repr(shape)} is not a list"
    if len(shape) > MAX_NDIM:
        return f"shape has {len(shape)} dimensions (at most {MAX_NDIM})"
    size = max(int(itemsize), 1)
    for s in shape:
        if not isinstance(s, int) or isinstance(s, bool) or s < 0:
            return f"shape {short_repr(shape)} is not a list of non-negative integers"
        if s:
            size *= s
        if size >= 1 << 63:
            return f"shape {short_repr(shape)} claims more than 2**63 bytes"
    return None


def offsets_problem(offsets: Any) -> str | None:
    """Why ``offsets`` is not a ``[start, end]`` pair of integers with ``0 <= start <= end``."""
    if (
        isinstance(offsets, list)
        and len(offsets) == 2
        and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        and 0 <= offsets[0] <= offsets[1]
    ):
        return None
    return f"data_offsets {short_repr(offsets)} is not [start, end] with 0 <= start <= end"


class TilingProblem(NamedTuple):
    """Why tensors do not tile their data region: ``kind`` is ``"bounds"`` (a tensor ends past
    the region), ``"overlap"``, ``"align"`` (a start off the alignment), ``"gap"`` (bytes
    between tensors that belong to none) or ``"trailing"`` (bytes after the last tensor)."""

    kind: str
    message: str


def tiling_problem(
    spans: Iterable[tuple[int, int, str]],
    size: int,
    *,
    base: int = 0,
    align: int = 1,
    exact_end: bool = True,
    empty_may_overlap: bool = False,
) -> TilingProblem | None:
    """Why the tensors ``spans`` do not tile a data region of ``size`` bytes (None if they do).

    ``spans`` are ``(start, end, name)`` in data offsets (from the region's start, which is
    byte ``base`` of the file; the region ends where the file does). Tiling: every tensor
    in bounds, none overlapping another, each starting at the first multiple of ``align``
    after the previous one's end (the writers' layout: bytes that belong to no tensor are
    where a shifted offset or a dropped tensor would hide) and, with ``exact_end``, the
    last one ending the region (up to its alignment padding). Empty tensors hold no bytes
    and move no end; with ``empty_may_overlap`` they may also sit inside another tensor.
    """
    ordered = sorted(spans)
    for _s, e, name in ordered:
        if e > size:
            return TilingProblem(
                "bounds",
                f"tensor {name!r} ends at byte {base + e}, past the end of the file "
                f"({base + size} bytes)",
            )
    end, prev = 0, None
    for s, e, name in ordered:
        if s < end and not (empty_may_overlap and e == s):
            return TilingProblem(
                "overlap", f"tensors {prev!r} and {name!r} overlap at data offset {s}"
            )
        if s % align:
            return TilingProblem(
                "align",
                f"tensor {name!r}: data offset {s} is not a multiple of the alignment {align}",
            )
        expected = _align_up(end, align)
        if s > expected:
            return TilingProblem("gap", _gap_message(s, expected, prev))
        if e > s or prev is None:
            end, prev = max(end, e), name
    if exact_end and _align_up(end, align) < size:
        return TilingProblem(
            "trailing",
            f"{size - end} bytes after the last tensor (data ends at byte {base + end}, "
            f"the file has {base + size})",
        )
    return None


def _align_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _gap_message(start: int, expected: int, prev: str | None) -> str:
    where = f"after tensor {prev!r}" if prev is not None else "at the start of the data"
    return (
        f"data offset {start} leaves a gap of {start - expected} bytes {where}: data offsets "
        f"{expected}..{start} belong to no tensor"
    )


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for one-line error messages."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."
