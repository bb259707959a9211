"""Padding bytes across several runs of one model.

Some checkpoint writers leave whatever the allocator held in the padding between
tensors: NaNs and |v| >= 1e30 that move from run to run. Read flat, those bytes look
like a numerical problem; they are not parameters. This module finds them, reads each
4-byte slot as float32, says whether the padding differs run to run, and checks that no
dirty or differing slot lies inside a named tensor of any run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from dmlib.errors import DmlibError
from dmlib.sources import Source, open_source
from dmlib.tensor import TensorSet

__all__ = ["padding_across_runs", "padding_summary"]

HUGE = 1e30
SLOT = 4  # bytes of one float32 slot

SLOT_COLUMNS = [
    "run",
    "record",
    "kind",
    "offset",
    "bits",
    "value",
    "nan",
    "huge",
    "dirty",
    "differs",
    "inside_tensor",
]
RUN_COLUMNS = [
    "run",
    "path",
    "padding_bytes",
    "nonzero_bytes",
    "padding_slots",
    "dirty_slots",
    "nan",
    "huge",
    "differing_slots",
    "inside_tensor",
]


def _gaps(ts: TensorSet) -> pd.DataFrame:
    """Padding gaps of a file: record, kind, start, end (absolute byte offsets)."""
    if ts.format == "burnpack":
        from dmlib.census import padding_census

        return padding_census(ts).gaps[["record", "kind", "start", "end"]]
    # other formats: the bytes between consecutive tensors of the data section
    rows, cur = [], None
    for t in ts.disk_order():
        if t.offset is None:
            raise DmlibError(
                f"tensor {t.name!r} has no file offset; padding needs a file-backed tensor set",
                path=ts.path,
            )
        if cur is not None and t.offset > cur:
            rows.append((t.record, "between-tensors", cur, t.offset))
        cur = max(cur or 0, t.offset + t.nbytes)
    return pd.DataFrame(rows, columns=["record", "kind", "start", "end"])


def _labels(runs: Mapping[str, Source] | Sequence[Source]) -> dict[str, Source]:
    if isinstance(runs, Mapping):
        return {str(k): v for k, v in runs.items()}
    out: dict[str, Source] = {}
    for i, src in enumerate(runs):
        p = (
            src.path
            if isinstance(src, TensorSet)
            else (os.fspath(src) if isinstance(src, (str, os.PathLike)) else None)
        )
        label = os.path.basename(os.path.dirname(p)) + "/" + os.path.basename(p) if p else f"run{i}"
        if label in out or not p:
            label = f"run{i}"
        out[label] = src
    return out


class _Run:
    """The padding slots of one run, and the byte ranges of its tensors."""

    def __init__(self, label: str, ts: TensorSet) -> None:
        self.label, self.path = label, ts.path
        gaps = _gaps(ts)
        offsets, words, recs, kinds = [], [], [], []
        self.padding_bytes = self.nonzero_bytes = 0
        for rec, kind, start, end in gaps.itertuples(index=False):
            start, end = int(start), int(end)
            if end <= start:
                continue
            raw = np.asarray(ts.read_range(start, end), dtype=np.uint8)
            self.padding_bytes += raw.size
            self.nonzero_bytes += int(np.count_nonzero(raw))
            # whole float32 slots of the file's 4-byte grid that lie inside the gap
            first = -(-start // SLOT) * SLOT
            last = end // SLOT * SLOT
            if last <= first:
                continue
            slots = raw[first - start : last - start].view("<u4")
            offsets.append(np.arange(first, last, SLOT, dtype=np.int64))
            words.append(slots.astype(np.uint32))
            recs.append(np.full(slots.size, int(rec), dtype=np.int64))
            kinds.append(np.full(slots.size, str(kind), dtype=object))
        cat = np.concatenate
        self.offset = cat(offsets) if offsets else np.zeros(0, np.int64)
        self.bits = cat(words) if words else np.zeros(0, np.uint32)
        self.record = cat(recs) if recs else np.zeros(0, np.int64)
        self.kind = cat(kinds) if kinds else np.zeros(0, object)
        tensors = [t for t in ts.disk_order() if t.offset is not None and t.nbytes > 0]
        self.t_start = np.array([t.offset for t in tensors], dtype=np.int64)
        self.t_end = np.array([t.offset + t.nbytes for t in tensors], dtype=np.int64)
        self.t_name = [t.name for t in tensors]

    def tensor_at(self, offsets: np.ndarray) -> list[str | None]:
        """Name of this run's tensor overlapping each 4-byte slot, or None."""
        if not self.t_name:
            return [None] * len(offsets)
        i = np.searchsorted(self.t_start, offsets + SLOT, side="left") - 1
        hit = (i >= 0) & (self.t_end[np.clip(i, 0, None)] > offsets)
        return [self.t_name[j] if h else None for j, h in zip(i, hit, strict=True)]


def padding_across_runs(runs: Mapping[str, Source] | Sequence[Source]) -> pd.DataFrame:
    """Compare the padding bytes of several runs of the same model, slot by slot.

    Parameters
    ----------
    runs
        Paths or TensorSets (labelled by file name), or a mapping label -> path/TensorSet.

    Returns
    -------
    DataFrame
        One row per (run, slot) for every float32 slot of padding that is dirty (not all
        zero) in that run or differs between runs: ``run``, ``record``, ``kind`` (the gap:
        "after-metadata", "between-tensors", "between-records"), ``offset`` (absolute byte
        offset), ``bits`` (the u32 word), ``value`` (read as little-endian float32),
        ``nan``, ``huge`` (|value| >= 1e30), ``dirty``, ``differs`` (the slot is padding
        in every run and its bits are not the same in all of them) and ``inside_tensor``
        (the tensor of any run overlapping the slot; None expected).
        ``attrs["runs"]``: per-run totals (see :func:`padding_summary`);
        ``attrs["differs"]``: any slot differs; ``attrs["inside_tensor"]``: how many
        reported slots lie inside a named tensor; ``attrs["same_layout"]``: every run
        has the same tensors at the same offsets (when not, a slot that is padding in
        some runs only is reported if dirty, never as differing).
    """
    labelled = _labels(runs)
    if not labelled:
        raise DmlibError("padding_across_runs needs at least one run")
    with contextlib.ExitStack() as stack:
        loaded = [_Run(label, open_source(src, stack)) for label, src in labelled.items()]
    # offset -> (bits per run); a slot absent from a run counts as differing
    all_offsets = np.unique(np.concatenate([r.offset for r in loaded]))
    n = len(all_offsets)
    present = np.zeros((len(loaded), n), dtype=bool)
    bits = np.zeros((len(loaded), n), dtype=np.uint32)
    for k, r in enumerate(loaded):
        pos = np.searchsorted(all_offsets, r.offset)
        present[k, pos] = True
        bits[k, pos] = r.bits
    # only a slot that is padding in every run can be compared run to run; one that is
    # padding in some runs only is reported when dirty, and checked against their tensors
    shared = present.all(axis=0)
    differs = shared & (bits != bits[:1]).any(axis=0)
    layouts = {
        tuple(zip(r.t_name, r.t_start.tolist(), r.t_end.tolist(), strict=True)) for r in loaded
    }
    frames, totals = [], []
    for r in loaded:
        pos = np.searchsorted(all_offsets, r.offset)
        dif = differs[pos]
        dirty = r.bits != 0
        with np.errstate(invalid="ignore", over="ignore"):
            value = r.bits.view("<f4").astype(np.float64)
            nan = np.isnan(value)
            huge = np.abs(value) >= HUGE
        sel = dirty | dif
        off = r.offset[sel]
        inside: list[str | None] = [None] * int(sel.sum())
        for other in loaded:
            for j, name in enumerate(other.tensor_at(off)):
                inside[j] = inside[j] or name
        frames.append(
            pd.DataFrame(
                {
                    "run": r.label,
                    "record": r.record[sel],
                    "kind": r.kind[sel],
                    "offset": off,
                    "bits": r.bits[sel].astype(np.int64),
                    "value": value[sel],
                    "nan": nan[sel],
                    "huge": huge[sel],
                    "dirty": dirty[sel],
                    "differs": dif[sel],
                    "inside_tensor": pd.Series(inside, dtype=object),
                },
                columns=SLOT_COLUMNS,
            )
        )
        totals.append(
            {
                "run": r.label,
                "path": r.path,
                "padding_bytes": r.padding_bytes,
                "nonzero_bytes": r.nonzero_bytes,
                "padding_slots": int(r.offset.size),
                "dirty_slots": int(dirty.sum()),
                "nan": int(nan.sum()),
                "huge": int(huge.sum()),
                "differing_slots": int(dif.sum()),
                "inside_tensor": sum(x is not None for x in inside),
            }
        )
    frames = [f for f in frames if len(f)]
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=SLOT_COLUMNS)
    df.attrs["runs"] = totals
    df.attrs["differs"] = bool(differs.any())
    df.attrs["same_layout"] = len(layouts) == 1
    df.attrs["inside_tensor"] = sum(t["inside_tensor"] for t in totals)
    return df


def padding_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per-run totals of a :func:`padding_across_runs` frame: ``run``, ``path``,
    ``padding_bytes``, ``nonzero_bytes``, ``padding_slots``, ``dirty_slots``, ``nan``,
    ``huge``, ``differing_slots``, ``inside_tensor``."""
    runs: list[dict[str, Any]] = df.attrs.get("runs", [])
    return pd.DataFrame(runs, columns=RUN_COLUMNS)
