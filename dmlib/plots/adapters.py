"""Figures of LoRA runs: the weight each target adds, per step, and the global gradient L2
per step against the control."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from dmlib.plots._base import axes_or_current, floats, label, need, palette

__all__ = ["adapter_delta_growth", "gradient_l2_steps"]


def adapter_delta_growth(
    df: pd.DataFrame,
    *,
    x: str = "step",
    y: str = "delta_norm",
    hue: str = "target",
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """One line per target module of ``y`` (the Frobenius norm of the weight it adds)
    against the step, log y axis. A zero (an adapter whose B is still zero) leaves a gap;
    when every value is zero the axes say so in words."""
    need(df, [x, y, hue], "adapter_delta_growth")
    ax = axes_or_current(ax)
    names = list(dict.fromkeys(df[hue].tolist()))
    colors = palette(len(names))
    for name, color in zip(names, colors, strict=True):
        sub = df[df[hue] == name].sort_values(x)
        ys = floats(sub[y])
        ax.plot(sub[x], np.where(ys > 0, ys, np.nan), marker="o", lw=1.4, color=color,
                label=str(name))  # fmt: skip
    _log_steps(ax, df, x, y, title, f"every {y} is 0")
    if names:
        ax.legend(fontsize="small", ncol=2 if len(names) > 8 else 1)
    return ax


def gradient_l2_steps(
    df: pd.DataFrame,
    *,
    x: str = "step",
    y: str = "rel_l2",
    hue: str = "pair",
    control: str = "control",
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """One line per pair of runs of ``y`` (the global relative L2 of a gradient group)
    against the step, log y axis; pairs with the control (``control`` column True) dashed
    in grey, the yardstick the other pairs are read against. A bit-identical step (0)
    leaves a gap; when every value is zero the axes say so."""
    need(df, [x, y, hue, control], "gradient_l2_steps")
    ax = axes_or_current(ax)
    pairs = list(dict.fromkeys(df[hue].tolist()))
    same = [p for p in pairs if not bool(df.loc[df[hue] == p, control].any())]
    colors = dict(zip(same, palette(len(same)), strict=True))
    for p in pairs:
        sub = df[df[hue] == p].sort_values(x)
        ys = floats(sub[y])
        ys = np.where(ys > 0, ys, np.nan)
        zero = (
            " (0 at every step: bit-identical)" if len(ys) and np.all(floats(sub[y]) == 0) else ""
        )
        if p in colors:
            ax.plot(sub[x], ys, marker="o", lw=2, color=colors[p], label=f"{p}{zero}")
        else:
            ax.plot(sub[x], ys, marker="s", lw=1.5, ls="--", color="0.45",
                    label=f"{p} (control){zero}")  # fmt: skip
    _log_steps(ax, df, x, y, title, f"every {y} is 0 (bit-identical)")
    if pairs:
        ax.legend(fontsize="small")
    return ax


def _log_steps(ax: Any, df: pd.DataFrame, x: str, y: str, title: str | None, none: str) -> None:
    """The axes both figures share: log y (``none`` written instead when no value is above
    0), ticks only at whole steps, the columns' labels and the title."""
    from matplotlib.ticker import MaxNLocator

    if len(df) and not (floats(df[y]) > 0).any():
        ax.text(0.5, 0.5, none, transform=ax.transAxes, ha="center")
    else:
        ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(label(x))
    ax.set_ylabel(label(y))
    if title:
        ax.set_title(title)
