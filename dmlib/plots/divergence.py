"""Figures of how two or more runs differ: ULP histograms, first divergent columns, all-pairs heatmaps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from dmlib.plots._base import axes_or_current, floats, label, need, palette

__all__ = ["first_column_histogram", "run_matrix_heatmap", "ulp_histogram"]


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
    ax.set_xticks(range(len(buckets)), [str(b) for b in buckets], rotation=45, ha="right")
    ax.set_xlabel(label("ulp"))
    ax.set_ylabel("elements (count)")
    ax.set_title(title or "ULP distance between runs")
    if hue:
        ax.legend(title=hue, fontsize="small")
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
    counts = (
        np.bincount(vals, minlength=max(width, 1))
        if vals.size
        else np.zeros(max(width, 1), dtype=np.int64)
    )
    ax.bar(
        np.arange(counts.size),
        counts,
        width=0.9,
        color=palette(1)[0],
        label=f"diverging pairs ({vals.size})",
    )
    ax.set_xlabel(label(column))
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
    ax: Any = None,
    title: str | None = None,
    fmt: str = "{:.2g}",
) -> Any:
    """Symmetric heatmap of one statistic over all pairs of runs (one row per pair in).

    Exact zeros (bit-identical pairs) are printed "0" and drawn in the colour for "bad"
    values of a log scale (white); the diagonal is blank, marked "—"; a pair absent from
    the frame is blank. The image array is the matrix
    of ``value`` in ``order`` (default: runs as they first appear in ``a`` then ``b``).
    """
    need(pairs, [a, b, value], "run_matrix_heatmap")
    import matplotlib.colors as mcolors

    ax = axes_or_current(ax)
    runs = (
        list(order)
        if order is not None
        else list(dict.fromkeys([*pairs[a].tolist(), *pairs[b].tolist()]))
    )
    idx = {r: i for i, r in enumerate(runs)}
    mat = np.full((len(runs), len(runs)), np.nan)
    for ra, rb, v in zip(pairs[a], pairs[b], floats(pairs[value]), strict=True):
        if ra not in idx or rb not in idx:
            continue
        mat[idx[ra], idx[rb]] = mat[idx[rb], idx[ra]] = v
    pos = mat[np.isfinite(mat) & (mat > 0)]
    # one distinct value (two runs: one pair) would give a degenerate log scale
    norm = None
    if log and pos.size:
        lo, hi = float(pos.min()), float(pos.max())
        if hi <= lo:
            lo, hi = lo / 10, hi * 10
        norm = mcolors.LogNorm(vmin=lo, vmax=hi)
    import matplotlib

    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    im = ax.imshow(mat, cmap=cmap, norm=norm)
    for i in range(len(runs)):
        for j in range(len(runs)):
            v = mat[i, j]
            if i == j:  # a run against itself: not compared
                ax.text(j, i, "—", ha="center", va="center", fontsize="x-small", color="0.5")
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
    ax.set_xticks(range(len(runs)), runs, rotation=45, ha="right")
    ax.set_yticks(range(len(runs)), runs)
    ax.set_xlabel("run b")
    ax.set_ylabel("run a")
    ax.figure.colorbar(im, ax=ax, label=label(value))
    ax.set_title(title or f"{value} over all pairs of runs")
    return ax
