"""Column structure of matrices that two runs should have produced identically.

A Householder QR finishes column ``j`` of ``Q`` at iteration ``j``, so the first column
whose bits differ between two runs reads out the iteration at which the two processes
first disagreed. Column cosines then tell a flipped reflector (a whole column negated,
cosine near -1) from a sign-preserving scatter of rounding differences (cosine near 1).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import pandas as pd

from dmlib.errors import DmlibError
from dmlib.sources import Patterns, Source, name_filter, open_source
from dmlib.tensor import TensorSet

__all__ = [
    "column_cosines",
    "first_column_summary",
    "first_divergent_column",
    "first_divergent_columns",
    "sign_flip_table",
    "sign_flips",
]


def _where(x: Any) -> str | None:
    return getattr(x, "path", None) if isinstance(x, TensorSet) else None


def _pair_arrays(a: Any, b: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    a_arr, b_arr = np.asarray(a), np.asarray(b)
    if a_arr.shape != b_arr.shape:
        raise DmlibError(
            f"{what}: shapes differ, {list(a_arr.shape)} vs {list(b_arr.shape)}; "
            "both arrays must have the same shape"
        )
    return a_arr, b_arr


def _column_axis(arr: np.ndarray, axis: int, what: str) -> int:
    if arr.ndim == 0:
        raise DmlibError(f"{what}: a scalar has no columns; pass arrays of at least 1 dimension")
    if not -arr.ndim <= axis < arr.ndim:
        raise DmlibError(
            f"{what}: axis {axis} is out of range for an array of {arr.ndim} dimensions"
        )
    return axis % arr.ndim


def _bits(arr: np.ndarray) -> np.ndarray:
    """The bit patterns of ``arr`` as unsigned integers, one trailing axis of words."""
    c = np.ascontiguousarray(arr)
    size = c.dtype.itemsize
    if size in (1, 2, 4, 8):
        return c.view(f"<u{size}")[..., None]
    # complex128, longdouble...: compare the raw bytes
    return c.view(np.uint8).reshape(*c.shape, size)


# ---------------------------------------------------------------------------
# one pair of arrays


def first_divergent_column(a: Any, b: Any, *, axis: int = 1) -> int | None:
    """Index of the first column whose bits differ between ``a`` and ``b``.

    Parameters
    ----------
    a, b
        Arrays (or Tensors) of the same shape and dtype.
    axis
        The axis that indexes columns (1 for the columns of a matrix).

    Returns
    -------
    int or None
        None when the arrays are bit-identical. Bit patterns are compared, so two NaNs
        with the same bits are equal and ``-0.0`` differs from ``+0.0``.
    """
    a_arr, b_arr = _pair_arrays(a, b, "first_divergent_column")
    if a_arr.dtype != b_arr.dtype:
        raise DmlibError(
            f"first_divergent_column: dtypes differ, {a_arr.dtype} vs {b_arr.dtype}; "
            "bit patterns are only comparable within one dtype"
        )
    ax = _column_axis(a_arr, axis, "first_divergent_column")
    diff = (_bits(a_arr) != _bits(b_arr)).any(axis=-1)
    per_col = np.moveaxis(diff, ax, 0).reshape(diff.shape[ax], -1).any(axis=1)
    hits = np.flatnonzero(per_col)
    return int(hits[0]) if hits.size else None


def column_cosines(a: Any, b: Any, *, axis: int = 1) -> np.ndarray:
    """Cosine similarity of each column of ``a`` with the same column of ``b``, in float64.

    A column that is zero in both arrays has cosine 1.0 (nothing differs); a column that
    is zero in only one has cosine NaN (no direction to compare). A column holding a
    non-finite value has cosine NaN. Results are clipped to [-1, 1].
    """
    a_arr, b_arr = _pair_arrays(a, b, "column_cosines")
    ax = _column_axis(a_arr, axis, "column_cosines")
    n = a_arr.shape[ax]
    x = np.moveaxis(a_arr.astype(np.float64), ax, 0).reshape(n, -1)
    y = np.moveaxis(b_arr.astype(np.float64), ax, 0).reshape(n, -1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        dot = np.einsum("ij,ij->i", x, y)
        nx = np.sqrt(np.einsum("ij,ij->i", x, x))
        ny = np.sqrt(np.einsum("ij,ij->i", y, y))
        cos = dot / (nx * ny)
    cos = np.clip(cos, -1.0, 1.0)
    cos[(nx == 0) & (ny == 0)] = 1.0
    cos[(nx == 0) ^ (ny == 0)] = np.nan
    return cos


def sign_flips(a: Any, b: Any, *, axis: int = 1, threshold: float = -0.9) -> dict[str, Any]:
    """Count flipped columns (cosine below ``threshold``) against sign-preserving scatter.

    Returns
    -------
    dict
        ``n_cols``; ``n_changed`` (columns whose bits differ); ``n_flipped`` (cosine <
        ``threshold``: a negated Householder reflector); ``n_scatter`` (changed but not
        flipped); ``flipped_cols`` (their indices); ``min_cosine`` and ``median_cosine``
        over the changed columns (NaN when none changed).
    """
    a_arr, b_arr = _pair_arrays(a, b, "sign_flips")
    cos = column_cosines(a_arr, b_arr, axis=axis)
    ax = _column_axis(a_arr, axis, "sign_flips")
    n = a_arr.shape[ax]
    if a_arr.dtype == b_arr.dtype:
        diff = (_bits(a_arr) != _bits(b_arr)).any(axis=-1)
    else:  # no common bit pattern: compare values
        diff = a_arr.astype(np.float64) != b_arr.astype(np.float64)
    changed = np.moveaxis(diff, ax, 0).reshape(n, -1).any(axis=1)
    flipped = np.flatnonzero(cos < threshold)
    ch = cos[changed]
    ch = ch[~np.isnan(ch)]
    return {
        "n_cols": int(n),
        "n_changed": int(changed.sum()),
        "n_flipped": int(flipped.size),
        "n_scatter": int(changed.sum() - np.count_nonzero(changed[flipped])),
        "flipped_cols": [int(i) for i in flipped],
        "min_cosine": float(ch.min()) if ch.size else float("nan"),
        "median_cosine": float(np.median(ch)) if ch.size else float("nan"),
    }


# ---------------------------------------------------------------------------
# every tensor of every pair of runs


def _tensor_pairs(
    runs: Mapping[str, Source], include: Patterns, exclude: Patterns, axis: int
) -> Iterator[tuple[str, str, str, np.ndarray, np.ndarray]]:
    """Yield (label_a, label_b, name, array_a, array_b) over all run pairs and shared names."""
    if len(runs) < 2:
        raise DmlibError(f"need at least two runs to compare, got {len(runs)}: {list(runs)}")
    with contextlib.ExitStack() as stack:
        sets = {label: open_source(src, stack) for label, src in runs.items()}
        yield from _shared_tensors(sets, name_filter(include, exclude), axis)


def _shared_tensors(
    sets: dict[str, TensorSet], keep: Callable[[str], bool], axis: int
) -> Iterator[tuple[str, str, str, np.ndarray, np.ndarray]]:
    for la, lb in itertools.combinations(sets, 2):
        sa, sb = sets[la], sets[lb]
        for name in sa:
            if name not in sb or not keep(name):
                continue
            ta, tb = sa[name], sb[name]
            if ta.quantized or not _columns_ok(ta.shape, axis):
                continue
            if ta.shape != tb.shape or ta.dtype != tb.dtype:
                raise DmlibError(
                    f"tensor {name!r}: {la} has {ta.dtype_label}{list(ta.shape)}, {lb} has "
                    f"{tb.dtype_label}{list(tb.shape)}; runs of one model must agree",
                    path=_where(sb),
                )
            yield la, lb, name, ta.load(), tb.load()


def _columns_ok(shape: tuple[int, ...], axis: int) -> bool:
    return len(shape) > 0 and -len(shape) <= axis < len(shape)


def first_divergent_columns(
    runs: Mapping[str, Source], *, include: Patterns = None, exclude: Patterns = None, axis: int = 1
) -> pd.DataFrame:
    """First divergent column of every shared tensor over every pair of runs.

    Parameters
    ----------
    runs
        Run label -> path, TensorSet or mapping of arrays (at least two runs).
    include, exclude
        Name patterns (globs, or ``"re:<regex>"``), e.g. the factor tensors of a QR.
    axis
        The column axis; tensors with too few dimensions for it are skipped.

    Returns
    -------
    DataFrame
        One row per (pair, tensor): ``pair`` ("a/b"), ``a``, ``b``, ``name``,
        ``first_col`` (nullable int; <NA> when bit-identical), ``n_cols``, ``identical``.
        ``attrs["summary"]`` holds :func:`first_column_summary`.
    """
    rows = []
    for la, lb, name, x, y in _tensor_pairs(runs, include, exclude, axis):
        first = first_divergent_column(x, y, axis=axis)
        rows.append(
            {
                "pair": f"{la}/{lb}",
                "a": la,
                "b": lb,
                "name": name,
                "first_col": first,
                "n_cols": int(x.shape[axis]),
                "identical": first is None,
            }
        )
    df = pd.DataFrame(rows, columns=["pair", "a", "b", "name", "first_col", "n_cols", "identical"])
    df["first_col"] = df["first_col"].astype("Int64")
    df.attrs["summary"] = first_column_summary(df)
    return df


def first_column_summary(df: pd.DataFrame) -> dict[str, Any]:
    """Distribution of the first divergent column, and how many tensor pairs are identical.

    Returns a dict with ``n_pairs`` (tensor pairs), ``n_identical``, and ``first_col_min``,
    ``first_col_median``, ``first_col_max`` over the pairs that differ (None if none do).
    """
    cols = df["first_col"].dropna().astype(np.int64).to_numpy()
    return {
        "n_pairs": int(len(df)),
        "n_identical": int(df["identical"].sum()),
        "first_col_min": int(cols.min()) if cols.size else None,
        "first_col_median": float(np.median(cols)) if cols.size else None,
        "first_col_max": int(cols.max()) if cols.size else None,
    }


def sign_flip_table(
    runs: Mapping[str, Source],
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    axis: int = 1,
    threshold: float = -0.9,
) -> pd.DataFrame:
    """:func:`sign_flips` for every shared tensor over every pair of runs.

    Returns one row per (pair, tensor): ``pair``, ``a``, ``b``, ``name`` and the keys of
    :func:`sign_flips` except ``flipped_cols``.
    """
    keys = ["n_cols", "n_changed", "n_flipped", "n_scatter", "min_cosine", "median_cosine"]
    rows = []
    for la, lb, name, x, y in _tensor_pairs(runs, include, exclude, axis):
        r = sign_flips(x, y, axis=axis, threshold=threshold)
        rows.append(
            {"pair": f"{la}/{lb}", "a": la, "b": lb, "name": name, **{k: r[k] for k in keys}}
        )
    return pd.DataFrame(rows, columns=["pair", "a", "b", "name", *keys])
