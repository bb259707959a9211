"""Figures localising a divergence inside a forward pass: per-boundary profile, differing blocks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from dmlib.plots._base import axes_or_current, floats, label, need, palette, sparse_ticks

__all__ = ["BLOCK_STATES", "block_heatmap", "boundary_profile"]


def boundary_profile(
    df: pd.DataFrame,
    *,
    x: str = "boundary",
    y: str = "rel_fro",
    hue: str | None = "comparison",
    identical: str | None = "identical",
    first_divergent: Mapping[Any, Any] | None = None,
    max_labels: int = 30,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """``y`` at each capture boundary, in capture order, one line per ``hue`` value.

    Parameters
    ----------
    df
        Long form, e.g. ``compare_captures(...)`` frames concatenated with a column naming
        the comparison. Missing values (boundaries without element statistics) leave
        gaps; markers show every known value.
    identical
        The column saying whether a boundary's hashes match (used when the frame has
        it): a boundary that differs while its ``y`` is missing (hash only, rows not
        dumped) has a difference of unknown size; it is drawn as a marker in a band at
        the top of the axes, one row per comparison, labelled so, never at 0.
    first_divergent
        Maps a hue value to its first divergent boundary (an ``x`` value), marked with a
        vertical dashed line and named in the legend; None in the mapping draws nothing.

    Symmetric-log y axis so that exact zeros (bit-identical boundaries) sit on the axis.
    With many boundaries only about ``max_labels`` tick labels are written, always
    including the marked ones.
    """
    need(df, [x, y] + ([hue] if hue else []), "boundary_profile")
    ax = axes_or_current(ax)
    order = list(dict.fromkeys(df[x].tolist()))
    pos = {b: i for i, b in enumerate(order)}
    groups = list(dict.fromkeys(df[hue].tolist())) if hue else [None]
    colors = dict(zip(groups, palette(len(groups)), strict=True))
    markers = "osD^vP*X"
    for i, g in enumerate(groups):
        sub = df if g is None else df[df[hue] == g]
        # lines often coincide (exact zeros): later ones get larger hollow markers and sit
        # underneath, so every comparison stays visible
        ax.plot(
            [pos[b] for b in sub[x]],
            floats(sub[y]),
            marker=markers[i % len(markers)],
            ms=3 + 2 * i,
            mfc=colors[g] if i == 0 else "none",
            lw=1.2,
            color=colors[g],
            zorder=10 - i,
            label=None if g is None else str(g),
        )
    if identical and identical in df.columns:
        _unknown_band(ax, df, x, y, hue, identical, groups, colors, pos)
    marked = []
    for g, boundary in (first_divergent or {}).items():
        if boundary is None or boundary not in pos:
            continue
        marked.append(pos[boundary])
        ax.axvline(
            pos[boundary],
            ls="--",
            color=colors.get(g, "black"),
            lw=1.2,
            label=f"first divergent boundary ({g}): {boundary}",
        )
    values = floats(df[y])
    positive = values[np.isfinite(values) & (values > 0)]
    if positive.size:
        lo, hi = float(positive.min()), float(positive.max())
        ax.set_yscale("symlog", linthresh=lo)
        # headroom above the largest value for the band of unknown sizes
        ax.set_ylim(-0.2 * lo, hi * 10 ** (0.35 * (np.log10(hi / lo) + 1)))
    else:
        ax.set_yscale("symlog", linthresh=1e-12)
    ticks = sparse_ticks(len(order), marked, max_labels)
    ax.set_xticks(ticks, [str(order[i]) for i in ticks], rotation=90, fontsize="xx-small")
    ax.set_xlim(-1, len(order))
    ax.set_xlabel(label(x))
    ax.set_ylabel(label(y))
    ax.set_title(title or f"{y} per boundary")
    ax.legend(fontsize="x-small", loc="best", framealpha=0.9)
    return ax


def _unknown_band(
    ax: Any,
    df: pd.DataFrame,
    x: str,
    y: str,
    hue: str | None,
    identical: str,
    groups: list[Any],
    colors: Mapping[Any, Any],
    pos: Mapping[Any, int],
) -> None:
    """Boundaries that differ by hash with no element statistics: markers in a band at the
    top of the axes (x in data, y in axes coordinates), one row per comparison."""
    import matplotlib.transforms as mtransforms

    band = mtransforms.blended_transform_factory(ax.transData, ax.transAxes)
    row = 0
    for g in groups:
        sub = df if g is None else df[df[hue] == g]
        differs = sub[identical].eq(False).fillna(False).to_numpy(dtype=bool)
        unknown = differs & np.isnan(floats(sub[y]))
        if not unknown.any():
            continue
        xs = [pos[b] for b in sub[x][unknown]]
        ax.plot(
            xs, np.full(len(xs), 0.96 - 0.04 * row), transform=band, ls="none", marker="|",
            ms=9, mew=1.5, color=colors[g], clip_on=False,
            label=f"{'' if g is None else f'{g}: '}differs, size unknown (hash only, not dumped): {len(xs)}",
        )  # fmt: skip
        row += 1


BLOCK_STATES = ("same", "differs, inherited", "differs, new here")


def block_heatmap(
    df: pd.DataFrame,
    *,
    n_blocks: int,
    row: str = "boundary",
    blocks: str = "diff_blocks",
    new: str | None = "new_blocks",
    comparable: str | None = "identical",
    block_labels: Sequence[str] | None = None,
    max_labels: int = 40,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Which row blocks differ at each boundary: boundaries down, blocks across.

    Parameters
    ----------
    df
        ``compare_captures(...)``: per boundary the list of differing block ids
        (``blocks``) and, of those, the ones that first differ at this boundary (``new``).
    n_blocks
        Number of blocks (``len(df.attrs["block_index"])``).
    comparable
        Rows where this column is missing (boundaries not judged) are blank.

    The image holds 0 (same), 1 (differs, inherited from an earlier boundary) and 2
    (differs, new at this boundary), NaN for rows not judged.
    """
    need(df, [row, blocks] + [c for c in (new, comparable) if c], "block_heatmap")
    import matplotlib.colors as mcolors
    from matplotlib.patches import Patch

    ax = axes_or_current(ax)
    mat = np.zeros((len(df), n_blocks))
    for i, diff in enumerate(df[blocks]):
        mat[i, list(diff)] = 1
    if new:
        for i, fresh in enumerate(df[new]):
            mat[i, list(fresh)] = 2
    if comparable:
        mat[df[comparable].isna().to_numpy(), :] = np.nan
    palette = ["white", "#f4a582", "#b2182b"]
    cmap = mcolors.ListedColormap(palette).with_extremes(bad="0.85")
    ax.imshow(
        mat,
        aspect="auto",
        interpolation="nearest",
        cmap=cmap,
        norm=mcolors.BoundaryNorm([-0.5, 0.5, 1.5, 2.5], 3),
    )
    names = [str(b) for b in df[row]]
    ticks = sparse_ticks(len(names), np.flatnonzero((mat == 2).any(axis=1)), max_labels)
    ax.set_yticks(ticks, [names[i] for i in ticks], fontsize="xx-small")
    xt = sparse_ticks(n_blocks, (), 16)
    ax.set_xticks(
        xt,
        [block_labels[j] if block_labels else str(j) for j in xt],
        rotation=45 if block_labels else 0,
        fontsize="x-small",
    )
    ax.set_xlabel(label("block"))
    ax.set_ylabel(label(row))
    handles = [
        Patch(facecolor=c, edgecolor="0.5", label=s)
        for c, s in zip(palette, BLOCK_STATES, strict=True)
    ]
    if comparable:
        handles.append(Patch(facecolor="0.85", edgecolor="0.5", label="not comparable"))
    ax.legend(handles=handles, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(title or "Differing row blocks per boundary")
    return ax
