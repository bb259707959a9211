"""Figures of a checkpoint file's anatomy: byte layout, and slot counts per record."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from dmlib.errors import DmlibError
from dmlib.padding import SLOT_COUNT_COLUMNS
from dmlib.plots._base import axes_or_current, floats, label, need, palette

__all__ = ["layout_map", "slot_counts"]


def layout_map(
    table: pd.DataFrame,
    gaps: pd.DataFrame | None = None,
    *,
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Byte layout of a file: one bar per tensor, one per padding gap.

    Parameters
    ----------
    table
        ``TensorSet.table()``: ``name``, ``offset``, ``nbytes``, ``record``.
    gaps
        ``padding_census(...).gaps``: ``start``, ``nbytes``, ``nonzero_bytes`` (and
        ``kind``). Gaps holding a non-zero byte are drawn in red, clean ones in grey.

    Rows: "tensors" (coloured by record) and "padding". The x axis is the byte offset.
    """
    need(table, ["offset", "nbytes", "record"], "layout_map")
    ax = axes_or_current(ax)
    records = list(dict.fromkeys(table["record"].tolist()))
    colors = palette(len(records))
    for rec, color in zip(records, colors, strict=True):
        sub = table[table["record"] == rec]
        ax.broken_barh(
            list(zip(sub["offset"].astype(float), sub["nbytes"].astype(float), strict=True)),
            (1.6, 0.8),
            facecolors=color,
            edgecolors="white",
            linewidth=0.3,
            label=f"tensors, record {rec}",
        )
    yticks, ylabels = [2.0], ["tensors"]
    if gaps is not None:
        need(gaps, ["start", "nbytes", "nonzero_bytes"], "layout_map")
        dirty = gaps["nonzero_bytes"] > 0
        for mask, color, name in (
            (~dirty, "0.6", "padding, all zero"),
            (dirty, "tab:red", "padding, non-zero bytes"),
        ):
            sub = gaps[mask]
            if len(sub):
                ax.broken_barh(
                    list(zip(sub["start"].astype(float), sub["nbytes"].astype(float), strict=True)),
                    (0.6, 0.8),
                    facecolors=color,
                    # an edge keeps gaps of a few bytes visible beside megabyte tensors
                    edgecolors=color,
                    linewidth=0.8,
                    label=f"{name} ({len(sub)} gap{'' if len(sub) == 1 else 's'})",
                )
        yticks.insert(0, 1.0)
        ylabels.insert(0, "padding")
    ax.set_yticks(yticks, ylabels)
    ax.set_ylim(0.3, 2.7)
    from matplotlib.ticker import EngFormatter

    # offsets written with their unit ("1.5 MB"), not as 1.5 under a "1e6" in the corner
    ax.xaxis.set_major_formatter(EngFormatter(unit="B"))
    ax.set_xlabel(label("offset"))
    ax.set_title(title or "Byte layout: tensors and the padding between them")
    ax.legend(
        loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=3, fontsize="small", frameon=False
    )
    return ax


def slot_counts(
    slots: pd.DataFrame,
    *,
    columns: Sequence[str] = SLOT_COUNT_COLUMNS,
    record: str = "record",
    ax: Any = None,
    title: str | None = None,
) -> Any:
    """Grouped bars of 4-byte slot counts per record (``padding_census(...).slots``).

    A flat read counts ``flat_slots``; only ``named_slots`` are parameters; the rest is
    padding. Log y axis; every bar is labelled with its count (zeros included).
    """
    cols = [c for c in columns if c in slots.columns]
    need(slots, [record, *cols], "slot_counts")
    if not cols:
        raise DmlibError(
            f"slot_counts: none of the columns {list(columns)} is in the frame ({list(slots.columns)})"
        )
    ax = axes_or_current(ax)
    n = len(cols)
    width = 0.8 / n
    x = np.arange(len(slots))
    for i, (col, color) in enumerate(zip(cols, palette(n), strict=True)):
        vals = floats(slots[col])
        bars = ax.bar(x + (i - (n - 1) / 2) * width, vals, width, label=col, color=color)
        ax.bar_label(
            bars, labels=[f"{int(v):,}" for v in vals], fontsize="x-small", rotation=90, padding=2
        )
    ax.set_yscale("symlog", linthresh=1)
    ax.set_xticks(x, [f"record {r}" for r in slots[record]])
    ax.set_ylabel("4-byte slots (count)")
    ax.set_ylim(0, float(np.nanmax(np.stack([floats(slots[c]) for c in cols]))) * 50 + 10)
    ax.set_title(title or "Flat read vs named tensors vs padding (4-byte slots)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax
