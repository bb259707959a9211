"""Figure of the log-prob mismatch between two sides (sampler and trainer) along training."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from dmlib.plots._base import axes_or_current, floats, label, need, palette

__all__ = ["logprob_drift"]


def logprob_drift(
    df: pd.DataFrame,
    *,
    y: str = "k3",
    x: str = "step",
    run: str = "run",
    control: str = "is_control",
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """The mismatch ``y`` of each run at each step (a :func:`dmlib.logprob_ladder` frame),
    the control run's (lr=0: weights that never move) drawn as a grey band from 0 up to
    its value at each step: what the numerics alone give.

    A step with no value (not comparable, nothing counted) leaves a gap in its line.
    Linear y axis: a mismatch of 0 (identical log-probs) is a point on the axis.
    """
    need(df, [x, y, run, control], "logprob_drift")
    ax = axes_or_current(ax)
    is_control = df[control].astype(bool)
    runs = list(dict.fromkeys(df.loc[~is_control, run].tolist()))
    colors = dict(zip(runs, palette(len(runs)), strict=True))
    for name in dict.fromkeys(df.loc[is_control, run].tolist()):
        sub = df[(df[run] == name) & is_control].sort_values(x)
        ys = floats(sub[y])
        ax.fill_between(
            sub[x].to_numpy(dtype=float),
            0.0,
            ys,
            color="0.8",
            alpha=0.8,
            label=f"control {name}",
            zorder=1,
        )
        ax.plot(sub[x], ys, ls="--", lw=1, color="0.45", zorder=2)
    for name in runs:
        sub = df[(df[run] == name) & ~is_control].sort_values(x)
        ax.plot(sub[x], floats(sub[y]), marker="o", lw=2, color=colors[name], label=name, zorder=3)
    values = floats(df[y])
    if len(df) and np.isnan(values).all():
        ax.text(0.5, 0.5, f"no {y} at any {x}", transform=ax.transAxes, ha="center", va="center")
    ax.set_xlabel(label(x))
    ax.set_ylabel(label(y))
    if title:
        ax.set_title(title)
    if runs or is_control.any():
        ax.legend(loc="best", fontsize="small")
    return ax
