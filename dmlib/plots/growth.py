"""Figures of divergence over training steps: per-parameter growth and growth rates per group."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from dmlib.plots._base import axes_or_current, floats, label, name_matcher, need, palette

__all__ = ["growth_rate_bars", "step_growth", "step_growth_grid"]


def step_growth(
    df: pd.DataFrame,
    *,
    x: str = "step",
    y: str = "rel_fro",
    hue: str = "name",
    highlight: Any = None,
    highlight_label: str = "highlighted",
    legend: bool = True,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """One line per ``hue`` value (a parameter) of ``y`` against ``x``, log y axis.

    ``highlight`` (a regex, a list of names or a predicate on names) picks the lines to
    draw in colour with a legend entry each; the others are thin grey lines. Zeros
    (bit-identical) are not drawable on a log axis and leave a gap in their line; when
    every value is zero the axes say so in words.

    The y range is the data's own: a few points far below all others (more than
    ``OUTLIER_GAP`` decades, at most 1% of the points) do not stretch the axis; each is
    marked by a red triangle on the bottom edge with its value and step.
    """
    need(df, [x, y, hue], "step_growth")
    ax = axes_or_current(ax)
    hit = name_matcher(highlight)
    names = list(dict.fromkeys(df[hue].tolist()))
    marked = [n for n in names if hit(n)]
    colors = dict(zip(marked, palette(len(marked)), strict=True))
    others = False
    for name in names:
        sub = df[df[hue] == name].sort_values(x)
        ys = floats(sub[y])
        ys = np.where(ys > 0, ys, np.nan)
        if name in colors:
            ax.plot(
                sub[x],
                ys,
                marker="o",
                lw=2.2,
                color=colors[name],
                label=f"{name} ({highlight_label})",
                zorder=3,
            )
        else:
            ax.plot(
                sub[x],
                ys,
                lw=0.8,
                color="0.65",
                alpha=0.7,
                label=None if others else "other parameters",
                zorder=2,
            )
            others = True
    values = floats(df[y])
    ax.set_yscale("log")
    if len(df) and not (values > 0).any():
        ax.text(
            0.5,
            0.5,
            f"{y} = 0 at every {x}:\nbit-identical",
            transform=ax.transAxes,
            ha="center",
            va="center",
        )
        ax.set_yticks([], minor=True)
        ax.set_yticks([])
    else:
        _fit_y(ax, df, x, y, values)
    if len(df):
        xs = floats(df[x])
        pad = max((np.nanmax(xs) - np.nanmin(xs)) * 0.03, 0.5)
        ax.set_xlim(np.nanmin(xs) - pad, np.nanmax(xs) + pad)
    ax.set_xlabel(label(x))
    ax.set_ylabel(label(y))
    ax.set_title(title or "Divergence per parameter by step")
    if legend:
        ax.legend(fontsize="x-small")
    return ax


OUTLIER_GAP = 4.0  # decades between the lowest points and the rest that make them outliers


def low_outliers(values: np.ndarray, gap: float = OUTLIER_GAP) -> np.ndarray:
    """A mask of the positive ``values`` that lie below the widest gap of more than
    ``gap`` decades among the lowest 1% of the positive values (at least one value)."""
    pos = np.isfinite(values) & (values > 0)
    logs = np.sort(np.log10(values[pos]))
    cut = None
    best = gap
    for k in range(1, min(max(1, logs.size // 100), logs.size - 1) + 1):
        if logs[k] - logs[k - 1] > best:
            best, cut = logs[k] - logs[k - 1], logs[k]
    mask = np.zeros(values.shape, dtype=bool)
    if cut is not None:
        mask[pos] = np.log10(values[pos]) < cut
    return mask


def _fit_y(ax: Any, df: pd.DataFrame, x: str, y: str, values: np.ndarray) -> None:
    """The y range of the positive values without the low outliers, which are marked."""
    out = low_outliers(values)
    kept = values[(values > 0) & ~out]
    lo, hi = np.log10(kept.min()), np.log10(kept.max())
    pad = max((hi - lo) * 0.08, 0.3)
    bottom = 10 ** (lo - pad)
    ax.set_ylim(bottom, 10 ** (hi + pad))
    if not out.any():
        return
    xs = floats(df[x])[out]
    ax.plot(
        xs, np.full(xs.size, bottom), ls="none", marker="v", ms=8, color="tab:red",
        clip_on=False, zorder=5, label=f"below the axis ({int(out.sum())})",
    )  # fmt: skip
    for xv, v in list(zip(xs, values[out], strict=True))[:3]:  # more would overlap
        ax.annotate(
            f"{v:.1e} at {x} {xv:g}, below the axis", (xv, bottom), xytext=(6, 4),
            textcoords="offset points", fontsize="x-small", color="tab:red",
        )  # fmt: skip


def growth_rate_bars(
    rates: pd.DataFrame,
    *,
    key: str = "group",
    value: str = "slope",
    hue: str | None = "pair",
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Horizontal bars of ``growth_rates(...)``: decades of rel_fro gained per step, per group.

    A ``hue`` value (a pair) without any slope (NaN: rel_fro > 0 at fewer than two steps,
    e.g. a bit-identical repeat) draws no bar and is named under the legend, so that its
    absence is not read as a pair left out.
    """
    need(rates, [key, value] + ([hue] if hue else []), "growth_rate_bars")
    ax = axes_or_current(ax)
    unfitted = []
    if hue:
        has = rates.assign(_v=floats(rates[value])).groupby(hue, sort=False)["_v"].count()
        unfitted = [str(g) for g, n in has.items() if n == 0]
        rates = rates[~rates[hue].astype(str).isin(unfitted)]
    keys = list(dict.fromkeys(rates[key].tolist()))
    groups = list(dict.fromkeys(rates[hue].tolist())) if hue else [None]
    n = len(groups)
    height = 0.8 / n
    pos = {k: i for i, k in enumerate(keys)}
    for i, (g, color) in enumerate(zip(groups, palette(n), strict=True)):
        sub = rates if g is None else rates[rates[hue] == g]
        ys = np.array([pos[k] for k in sub[key]], dtype=float) + (i - (n - 1) / 2) * height
        ax.barh(ys, floats(sub[value]), height, color=color, label=None if g is None else str(g))
    ax.set_yticks(range(len(keys)), [str(k) for k in keys])
    ax.axvline(0, color="black", lw=0.8)
    ax.set_xlabel(label(value))
    ax.set_ylabel(key)
    ax.set_title(title or "Growth rate of divergence per group")
    if hue:
        ax.legend(title=hue, fontsize="small")
    if unfitted:
        ax.text(
            0.99, 0.01, f"no rate (rel_fro > 0 at fewer than two steps): {', '.join(unfitted)}",
            transform=ax.transAxes, ha="right", va="bottom", fontsize="x-small",
        )  # fmt: skip
    return ax


def step_growth_grid(
    df: pd.DataFrame,
    reference: str,
    *,
    highlight: Any = None,
    highlight_label: str = "highlighted",
    ncols: int = 2,
) -> Any:
    """One :func:`step_growth` panel per ``pair`` of a step ladder, in a grid of ``ncols``
    columns, each titled with its largest ``rel_fro`` and its step and with its own y
    range (a few far-off low points marked, not stretching it); the legend is drawn once,
    below the panels. Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    need(df, ["pair", "step", "rel_fro"], "step_growth_grid")
    pairs = list(dict.fromkeys(df["pair"]))
    ncols = max(min(ncols, len(pairs)), 1)
    nrows = max(-(-len(pairs) // ncols), 1)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7 * ncols, 4.6 * nrows), squeeze=False)
    for ax, pair in zip(axes.flat, pairs):
        sub = df[df["pair"].eq(pair)]
        step_growth(sub, highlight=highlight, highlight_label=highlight_label, legend=False,
                    ax=ax, title=f"{pair}: {_worst_note(sub)}")  # fmt: skip
    for ax in axes.flat[len(pairs) :]:
        ax.set_visible(False)
    handles, names = [], []
    for ax in axes.flat[: len(pairs)]:  # every line kind once, whichever panel draws it
        for h, n in zip(*ax.get_legend_handles_labels(), strict=True):
            if n not in names and not n.startswith("below the axis"):
                handles.append(h)
                names.append(n)
    if handles:
        fig.legend(handles, names, loc="lower center", ncol=3, fontsize="small", frameon=False)
    fig.suptitle(
        f"rel_fro of each saved parameter against {reference}, by step (each panel its own y range)"
    )
    fig.tight_layout(rect=(0, 0.1 if handles else 0, 1, 1))
    return fig


def _worst_note(sub: pd.DataFrame) -> str:
    """A panel's note: where its largest rel_fro is, or that it is bit-identical throughout."""
    if len(sub) and sub["rel_fro"].max() > 0:
        worst = sub.loc[sub["rel_fro"].idxmax()]
        return f"max {worst['rel_fro']:.2g} at step {int(worst['step'])}"
    return "bit-identical at every step"
