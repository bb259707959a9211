"""What every reader checks before it trusts a number from a file.

A shape or an offset pair read from a header decides how many bytes a tensor claims;
these checks run before any byte is mapped, so a hostile or damaged header fails with a
message naming the value instead of a wrong-sized array or a numpy overflow later.
Each returns why the value is unusable, or None.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MAX_NDIM", "offsets_problem", "shape_problem", "short_repr"]

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


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters, for one-line error messages."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."
