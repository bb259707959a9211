"""Figures of how two or more runs differ: ULP histograms, first divergent columns, all-pairs heatmaps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from dmlib.plots._base import (
    axes_or_current,
    floats,
    label,
    need,
    palette,
    ulp_bucket_label,
)

__all__ = ["first_column_histogram", "run_matrix_heatmap", "ulp_histogram", "ulp_histogram_by_pair"]


def ulp_histogram(
    df: pd.DataFrame,
    *,
    x: str = "bucket",
    y: str = "count",
    hue: str | None = "pair",
    ax: Any = None,
    title: str | None = None,
    log: bool = True,
) -> Any:
    """Grouped bars of element counts per ULP bucket, one colour per ``hue`` value.

    Parameters
    ----------
    df
        Long form: one row per (hue, bucket) with the bucket label in ``x`` (ordered as
        it first appears) and the count of elements in ``y``.
    log
        Log y axis (counts over many orders of magnitude); zero counts draw no bar.
    """
    need(df, [x, y] + ([hue] if hue else []), "ulp_histogram")
    ax = axes_or_current(ax)
    buckets = list(dict.fromkeys(df[x].tolist()))
    groups = list(dict.fromkeys(df[hue].tolist())) if hue else [None]
    n = len(groups)
    width = 0.8 / n
    pos = {b: i for i, b in enumerate(buckets)}
    for i, (g, color) in enumerate(zip(groups, palette(n), strict=True)):
        sub = df if g is None else df[df[hue] == g]
        xs = np.array([pos[b] for b in sub[x]], dtype=float) + (i - (n - 1) / 2) * width
        ax.bar(xs, floats(sub[y]), width, label=None if g is None else str(g), color=color)
    if log:
        ax.set_yscale("log")
    ax.set_xticks(
        range(len(buckets)), [ulp_bucket_label(b) for b in buckets], rotation=45, ha="right"
    )
    ax.set_xlabel(label("ulp"))
    ax.set_ylabel("elements (count)")
    ax.set_title(title or "ULP distance between runs")
    if hue:
        ax.legend(title=hue, fontsize="small")
    return ax


def ulp_histogram_by_pair(
    df: pd.DataFrame,
    *,
    x: str = "bucket",
    y: str = "count",
    pair: str = "pair",
    group: str | None = "group",
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """One histogram line per pair of runs (element counts per ULP bucket, log y axis),
    coloured by ``group`` (e.g. pairs with and without the control), so that no pair is
    pooled with another: a pair whose counts are all zero (bit-identical) draws no line
    and is named in a box on the axes; zero counts leave gaps.

    ``df``: one row per (pair, bucket), buckets ordered as they first appear, labelled in
    words ("3-4 ULP", "> 65,536 ULP").
    """
    need(df, [x, y, pair] + ([group] if group else []), "ulp_histogram_by_pair")
    ax = axes_or_current(ax)
    buckets = list(dict.fromkeys(df[x].tolist()))
    pos = {b: i for i, b in enumerate(buckets)}
    pairs = list(dict.fromkeys(df[pair].tolist()))
    groups = list(dict.fromkeys(df[group].tolist())) if group else [None]
    colors = dict(zip(groups, palette(len(groups)), strict=True))
    counts = {g: 0 for g in groups}
    identical = []
    for p in pairs:
        sub = df[df[pair] == p]
        g = sub[group].iloc[0] if group else None
        ys = floats(sub[y])
        if not (ys > 0).any():
            identical.append(str(p))
            continue
        counts[g] += 1
        ax.plot(
            [pos[b] for b in sub[x]], np.where(ys > 0, ys, np.nan), marker="o", ms=3, lw=1,
            alpha=0.8, color=colors[g], label=None if g is None else str(g),
        )  # fmt: skip
    handles, names = ax.get_legend_handles_labels()
    seen = dict(zip(names, handles, strict=True))  # one legend entry per group
    if seen:
        ax.legend(
            list(seen.values()),
            [f"{n}: {counts.get(n, 0)} differing, one line each" for n in seen],
            title="lines that coincide overlap",
            title_fontsize="x-small",
            fontsize="small",
        )
    if identical:
        shown = ", ".join(identical[:6]) + (
            f" and {len(identical) - 6} more" if len(identical) > 6 else ""
        )
        ax.text(
            0.99, 0.97, f"bit-identical (no line): {shown}", transform=ax.transAxes,
            ha="right", va="top", fontsize="small",
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "0.6"},
        )  # fmt: skip
    if not (floats(df[y]) > 0).any():
        ax.text(0.5, 0.5, "no element differs in any pair", transform=ax.transAxes, ha="center")
    else:
        ax.set_yscale("log")
    ax.set_xticks(
        range(len(buckets)), [ulp_bucket_label(b) for b in buckets], rotation=45, ha="right"
    )
    ax.set_xlim(-0.5, len(buckets) - 0.5)
    ax.set_xlabel(label("ulp"))
    ax.set_ylabel("elements (count)")
    ax.set_title(title or "ULP distance between runs, pair by pair")
    return ax


def first_column_histogram(
    df: pd.DataFrame,
    *,
    column: str = "first_col",
    n_cols: int | None = None,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Bars: how many tensor pairs first diverge at each column (one bar per column index).

    ``df`` is ``first_divergent_columns(...)``: rows with ``<NA>`` in ``column`` are
    bit-identical pairs; their number (and the total) is put in the title.
    """
    need(df, [column], "first_column_histogram")
    ax = axes_or_current(ax)
    vals = df[column].dropna().astype(np.int64).to_numpy()
    n_identical = int(df[column].isna().sum())
    width = (
        n_cols
        if n_cols is not None
        else (
            int(df["n_cols"].max()) if "n_cols" in df and len(df) else int(vals.max(initial=-1)) + 1
        )
    )
    # the axis ends at the last column any pair first diverges at; the columns after it
    # (none diverges first there) are named in the label instead of drawn as empty space
    shown = int(vals.max()) + 1 if vals.size else max(width, 1)
    counts = np.bincount(vals, minlength=shown) if vals.size else np.zeros(shown, dtype=np.int64)
    bars = ax.bar(
        np.arange(counts.size),
        counts,
        width=0.9,
        color=palette(1)[0],
        label=f"diverging pairs ({vals.size})",
    )
    # each non-zero bar carries its count: a bar of 1 beside one of 90 is otherwise a line
    ax.bar_label(bars, labels=[str(c) if c else "" for c in counts], fontsize="x-small")
    ax.set_xlim(-0.7, counts.size - 0.3)
    tail = (
        f"; of {width} columns, none first diverges after column {counts.size - 1}"
        if width > counts.size
        else ""
    )
    ax.set_xlabel(label(column) + tail)
    ax.set_ylabel("tensor pairs (count)")
    ax.set_title(
        title or f"First divergent column; {n_identical} of {len(df)} tensor pairs bit-identical"
    )
    ax.legend(fontsize="small")
    return ax


def run_matrix_heatmap(
    pairs: pd.DataFrame,
    *,
    value: str = "rel_fro",
    a: str = "a",
    b: str = "b",
    order: Sequence[str] | None = None,
    log: bool = True,
    compared: str | None = None,
    ax: Any = None,
    title: str | None = None,
    fmt: str = "{:.2g}",
) -> Any:
    """Symmetric heatmap of one statistic over all pairs of runs (one row per pair in).

    Exact zeros (bit-identical pairs) are printed "0" and drawn in the colour for "bad"
    values of a log scale (white); the diagonal is blank, marked "—"; a pair absent from
    the frame is blank. A pair in the frame without a value, or whose ``compared`` column
    (e.g. ``numel``) is 0, is blank and marked "nothing compared", and a run with no
    compared pair says so beside its name. The image array is the matrix of ``value`` in
    ``order`` (default: runs as they first appear in ``a`` then ``b``).

    The log colour scale spans whole decades (10^k to 10^m), so that values a hair apart
    get nearly the same colour; when every non-zero value prints the same at ``fmt``'s
    precision, the title says so.
    """
    need(pairs, [a, b, value] + ([compared] if compared else []), "run_matrix_heatmap")
    ax = axes_or_current(ax)
    runs = (
        list(order)
        if order is not None
        else list(dict.fromkeys([*pairs[a].tolist(), *pairs[b].tolist()]))
    )
    mat, empty = _pair_matrix(pairs, runs, value, a, b, compared)
    upper = np.triu(np.ones(mat.shape, dtype=bool), k=1)  # each pair once
    pos = mat[upper & np.isfinite(mat) & (mat > 0)]
    printed = {fmt.format(v) for v in pos}
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    im = ax.imshow(mat, cmap=cmap, norm=_decade_norm(pos) if log else None)
    _cell_texts(ax, im, mat, empty, fmt, log)
    alone = [
        i for i in range(len(runs)) if all(np.isnan(mat[i, j]) for j in range(len(runs)) if j != i)
    ]
    names = [
        f"{r}\n(nothing compared)" if i in alone and len(runs) > 1 else str(r)
        for i, r in enumerate(runs)
    ]
    ax.set_xticks(range(len(runs)), [str(r) for r in runs], rotation=45, ha="right")
    ax.set_yticks(range(len(runs)), names)
    ax.set_xlabel("run b")
    ax.set_ylabel("run a")
    ax.figure.colorbar(im, ax=ax, label=label(value))
    title = title or f"{value} over all pairs of runs"
    if len(pos) > 1 and len(printed) == 1:
        title += f"\nall {len(pos)} non-zero pairs equal at the precision shown ({printed.pop()})"
    ax.set_title(title)
    return ax


def _pair_matrix(
    pairs: pd.DataFrame, runs: list[Any], value: str, a: str, b: str, compared: str | None
) -> tuple[np.ndarray, set[tuple[int, int]]]:
    """The symmetric matrix of ``value`` and the cells of pairs present with nothing compared."""
    idx = {r: i for i, r in enumerate(runs)}
    mat = np.full((len(runs), len(runs)), np.nan)
    empty: set[tuple[int, int]] = set()
    n_cmp = floats(pairs[compared]) if compared else np.full(len(pairs), np.nan)
    for ra, rb, v, n in zip(pairs[a], pairs[b], floats(pairs[value]), n_cmp, strict=True):
        if ra not in idx or rb not in idx:
            continue
        i, j = idx[ra], idx[rb]
        if np.isnan(v) or n == 0:
            empty |= {(i, j), (j, i)}
            continue
        mat[i, j] = mat[j, i] = v
    return mat, empty


def _decade_norm(pos: np.ndarray) -> Any:
    """A log colour scale from the decade below the smallest positive value to the decade
    above the largest (None without positive values)."""
    import matplotlib.colors as mcolors

    if not pos.size:
        return None
    lo = 10.0 ** np.floor(np.log10(float(pos.min())))
    hi = 10.0 ** np.ceil(np.log10(float(pos.max())))
    return mcolors.LogNorm(vmin=lo, vmax=hi if hi > lo else lo * 10)


def _cell_texts(
    ax: Any, im: Any, mat: np.ndarray, empty: set[tuple[int, int]], fmt: str, log: bool
) -> None:
    """Each cell's value written on it, in black or white by the colour under it."""
    for i in range(mat.shape[0]):
        for j in range(mat.shape[1]):
            v = mat[i, j]
            if i == j:  # a run against itself: not compared
                ax.text(j, i, "—", ha="center", va="center", fontsize="x-small", color="0.5")
                continue
            if (i, j) in empty:
                ax.text(j, i, "nothing\ncompared", ha="center", va="center",
                        fontsize="xx-small", color="tab:red")  # fmt: skip
                continue
            if np.isnan(v):
                continue
            text = "0" if v == 0 else fmt.format(v)
            rgba = im.cmap(im.norm(v)) if v > 0 or not log else (1, 1, 1, 1)
            dark = (0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2]) < 0.5
            ax.text(
                j,
                i,
                text,
                ha="center",
                va="center",
                fontsize="x-small",
                color="white" if dark else "black",
            )
