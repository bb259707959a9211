"""Padding census of burnpack files: every byte range that belongs to no tensor.

Burn's writer zeroes its padding; other writers leave stale allocator memory there
(NaNs, |v| >= 1e30), and a flat read of a record counts those bytes as parameters. The
census lists each gap, whether it is zero, and what it holds read as float32, and does
the slot accounting (flat = named + padding) a reader needs to quote honest
denominators.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd

from dmlib.errors import UnsupportedError
from dmlib.tensor import TensorSet

HUGE = 1e30  # |v| >= 1e30 (inf included) counts as "huge": no trained parameter is that large

GAP_COLUMNS = ["record", "kind", "start", "end", "nbytes", "zero", "nonzero_bytes", "f32_slots", "nan", "huge"]
SLOT_COLUMNS = [
    "record",
    "layout",
    "data_base",
    "start",
    "end",
    "n_tensors",
    "flat_slots",
    "named_slots",
    "padding_slots",
    "padding_nonzero_slots",
    "nan",
    "huge",
]


@dataclass
class Census:
    """``gaps``: one row per byte range outside every tensor; ``slots``: one row per record."""

    gaps: pd.DataFrame
    slots: pd.DataFrame

    @property
    def clean(self) -> bool:
        """True when every padding byte is zero."""
        return bool((self.gaps["nonzero_bytes"] == 0).all())


def _gap_row(ts: TensorSet, record: int, kind: str, start: int, end: int) -> dict:
    raw = np.asarray(ts.read_range(start, end))
    nonzero = int(np.count_nonzero(raw))
    # float32 slots are the 4-byte-aligned words wholly inside the gap (absolute alignment:
    # every data base is 256-aligned in the current layout)
    a = -(-start // 4) * 4
    b = (end // 4) * 4
    if b > a:
        words = np.asarray(ts.read_range(a, b)).view("<f4")
        nan = int(np.isnan(words).sum())
        with np.errstate(invalid="ignore"):
            huge = int((np.abs(words) >= HUGE).sum())
        wnz = int(np.count_nonzero(words.view("<u4")))
    else:
        nan = huge = wnz = 0
    return {
        "record": record,
        "kind": kind,
        "start": start,
        "end": end,
        "nbytes": end - start,
        "zero": nonzero == 0,
        "nonzero_bytes": nonzero,
        "f32_slots": max(b - a, 0) // 4,
        "nan": nan,
        "huge": huge,
        "_nonzero_slots": wnz,
    }


def padding_census(ts_or_path: TensorSet | str | os.PathLike[str]) -> Census:
    """List every gap of a burnpack file and count slots per record.

    Slots are 4-byte words of the data section: ``flat_slots`` = (record end - data base)
    / 4, ``named_slots`` = tensor bytes / 4, ``padding_slots`` = bytes between tensors / 4
    (flat = named + padding when every tensor is a multiple of 4 bytes).
    """
    if isinstance(ts_or_path, TensorSet):
        ts = ts_or_path
    else:
        from dmlib.io import open_tensors

        ts = open_tensors(ts_or_path)
    if ts.format != "burnpack":
        raise UnsupportedError(f"the padding census reads burnpack files, not {ts.format}", path=ts.path)
    gaps: list[dict] = []
    slots: list[dict] = []
    records = ts.records or (ts,)
    prev_end = None
    for r in records:
        if prev_end is not None and r.start > prev_end:
            gaps.append(_gap_row(ts, r.index, "between-records", prev_end, r.start))
        meta_end = r.start + 10 + r.metadata_size
        if r.data_base > meta_end:
            gaps.append(_gap_row(ts, r.index, "after-metadata", meta_end, r.data_base))
        cur = r.data_base
        rec_gaps = []
        for t in r.disk_order():
            if t.offset > cur:
                rec_gaps.append(_gap_row(ts, r.index, "between-tensors", cur, t.offset))
            cur = max(cur, t.offset + t.nbytes)
        gaps.extend(rec_gaps)
        named = sum(t.nbytes for t in r.values())
        pad = sum(g["nbytes"] for g in rec_gaps)
        slots.append(
            {
                "record": r.index,
                "layout": r.layout["layout"],
                "data_base": r.data_base,
                "start": r.start,
                "end": r.end,
                "n_tensors": len(r),
                "flat_slots": (r.end - r.data_base) // 4,
                "named_slots": named // 4,
                "padding_slots": pad // 4,
                "padding_nonzero_slots": sum(g["_nonzero_slots"] for g in rec_gaps),
                "nan": sum(g["nan"] for g in rec_gaps),
                "huge": sum(g["huge"] for g in rec_gaps),
            }
        )
        prev_end = r.end
    gdf = pd.DataFrame(gaps, columns=[*GAP_COLUMNS, "_nonzero_slots"]).drop(columns="_nonzero_slots")
    return Census(gaps=gdf, slots=pd.DataFrame(slots, columns=SLOT_COLUMNS))
