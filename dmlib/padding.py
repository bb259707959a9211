"""Padding: every byte of a checkpoint that belongs to no tensor.

Burn's writer zeroes its padding; other writers leave stale allocator memory there
(NaNs, |v| >= 1e30) that moves from run to run. Read flat, those bytes look like
parameters or like a numerical problem; they are neither. Two views:

- :func:`padding_census` (one burnpack file): each gap, whether it is zero, what it holds
  read as float32, and the slot accounting (flat = named + padding) a reader needs to
  quote honest denominators.
- :func:`padding_across_runs` (several runs of one model, any file-backed format): each
  dirty or differing float32 slot, whether it differs run to run, and a check that none
  lies inside a named tensor of any run; :func:`padding_summary` totals it per run.

A *slot* is a 4-byte word of the file's absolute 4-byte grid lying wholly inside a gap
(every burnpack data base is 256-aligned, so the grid is the tensors' grid too).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pandas as pd

from dmlib.errors import DmlibError, UnsupportedError
from dmlib.sources import Source, open_source, opened
from dmlib.tensor import TensorSet

__all__ = [
    "Census",
    "padding_across_runs",
    "padding_census",
    "padding_summary",
]

HUGE = 1e30  # |v| >= 1e30 (inf included) counts as "huge": no trained parameter is that large
SLOT = 4  # bytes of one float32 slot

# padding_census: one row per gap, one row per record
GAP_COLUMNS = [
    "record",
    "kind",
    "start",
    "end",
    "nbytes",
    "zero",
    "nonzero_bytes",
    "f32_slots",
    "nan",
    "huge",
]
SLOT_COUNT_COLUMNS = (
    "flat_slots",
    "named_slots",
    "padding_slots",
    "padding_nonzero_slots",
    "nan",
    "huge",
)
RECORD_COLUMNS = ["record", "layout", "data_base", "start", "end", "n_tensors", *SLOT_COUNT_COLUMNS]

# padding_across_runs: one row per (run, slot), one row per run
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


def slot_grid(start: int, end: int) -> tuple[int, int]:
    """``[first, last)``: the byte range of the whole 4-byte slots inside ``[start, end)``.

    Empty (``last <= first``) when the gap holds no whole slot.
    """
    return -(-start // SLOT) * SLOT, end // SLOT * SLOT


def is_huge(values: np.ndarray) -> np.ndarray:
    """``|v| >= HUGE`` elementwise (NaN is not huge)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.abs(values) >= HUGE


# -- one file: the census ---------------------------------------------------------------


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
    a, b = slot_grid(start, end)
    if b > a:
        words = np.asarray(ts.read_range(a, b)).view("<f4")
        nan = int(np.isnan(words).sum())
        huge = int(is_huge(words).sum())
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
        "f32_slots": max(b - a, 0) // SLOT,
        "nan": nan,
        "huge": huge,
        "_nonzero_slots": wnz,
    }


def padding_census(ts_or_path: Source) -> Census:
    """List every gap of a burnpack file and count slots per record.

    Slots are 4-byte words of the data section: ``flat_slots`` = (record end - data base)
    / 4, ``named_slots`` = tensor bytes / 4, ``padding_slots`` = bytes between tensors / 4
    (flat = named + padding when every tensor is a multiple of 4 bytes).
    """
    with opened(ts_or_path) as ts:
        return _census(ts)


def _gap_ranges(ts: TensorSet) -> list[tuple[int, str, int, int]]:
    """(record, kind, start, end) of every gap of a burnpack file, read from its layout only."""
    gaps: list[tuple[int, str, int, int]] = []
    records = ts.records or (ts,)
    prev_end = None
    for r in records:
        if prev_end is not None and r.start > prev_end:
            gaps.append((r.index, "between-records", prev_end, r.start))
        meta_end = r.start + 10 + r.metadata_size
        if r.data_base > meta_end:
            gaps.append((r.index, "after-metadata", meta_end, r.data_base))
        cur = r.data_base
        for t in r.disk_order():
            if t.offset > cur:
                gaps.append((r.index, "between-tensors", cur, t.offset))
            cur = max(cur, t.offset + t.nbytes)
        prev_end = r.end
    return gaps


def _census(ts: TensorSet) -> Census:
    if ts.format != "burnpack":
        raise UnsupportedError(
            f"the padding census reads burnpack files, not {ts.format}", path=ts.path
        )
    gaps = [_gap_row(ts, *g) for g in _gap_ranges(ts)]
    slots: list[dict] = []
    for r in ts.records or (ts,):
        rec_gaps = [g for g in gaps if g["record"] == r.index and g["kind"] == "between-tensors"]
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
                "flat_slots": (r.end - r.data_base) // SLOT,
                "named_slots": named // SLOT,
                "padding_slots": pad // SLOT,
                "padding_nonzero_slots": sum(g["_nonzero_slots"] for g in rec_gaps),
                "nan": sum(g["nan"] for g in rec_gaps),
                "huge": sum(g["huge"] for g in rec_gaps),
            }
        )
    gdf = pd.DataFrame(gaps, columns=[*GAP_COLUMNS, "_nonzero_slots"]).drop(
        columns="_nonzero_slots"
    )
    return Census(gaps=gdf, slots=pd.DataFrame(slots, columns=RECORD_COLUMNS))


# -- several runs ----------------------------------------------------------------------


def _gaps(ts: TensorSet) -> pd.DataFrame:
    """Padding gaps of a file: record, kind, start, end (absolute byte offsets)."""
    if ts.format == "burnpack":
        return pd.DataFrame(_gap_ranges(ts), columns=["record", "kind", "start", "end"])
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
    """The padding slots of one run, and the byte ranges of its tensors.

    ``scans`` holds, per gap of ``_gaps(ts)`` in order, what
    :func:`dmlib.engine.refs.scan_padding` finds there (read here, or by a Dask worker);
    None: read the gaps here.
    """

    def __init__(
        self, label: str, ts: TensorSet, scans: list[dict[str, Any]] | None = None
    ) -> None:
        from dmlib.engine.refs import scan_padding

        self.label, self.path = label, ts.path
        gaps = [g for g in _gaps(ts).itertuples(index=False) if int(g.end) > int(g.start)]
        if scans is None:
            scans = [scan_padding(np.asarray(ts.read_range(int(g.start), int(g.end)), np.uint8),
                                  int(g.start), int(g.end)) for g in gaps]  # fmt: skip
        offsets, words, recs, kinds = [], [], [], []
        self.padding_bytes = self.nonzero_bytes = 0
        for (rec, kind, start, end), scan in zip(gaps, scans, strict=True):
            start, end = int(start), int(end)
            self.padding_bytes += end - start
            self.nonzero_bytes += scan["nonzero_bytes"]
            # whole float32 slots of the file's 4-byte grid that lie inside the gap
            first, last = slot_grid(start, end)
            if last <= first:
                continue
            slot_off = np.arange(first, last, SLOT, dtype=np.int64)
            slots = np.zeros(slot_off.size, np.uint32)  # a slot the scan did not list is zero
            slots[(scan["offsets"] - first) // SLOT] = scan["bits"]
            offsets.append(slot_off)
            words.append(slots)
            recs.append(np.full(slots.size, int(rec), dtype=np.int64))
            kinds.append(np.full(slots.size, str(kind), dtype=object))
        cat = np.concatenate
        self.offset = cat(offsets) if offsets else np.zeros(0, np.int64)
        self.bits = cat(words) if words else np.zeros(0, np.uint32)
        self.record = cat(recs) if recs else np.zeros(0, np.int64)
        self.kind = cat(kinds) if kinds else np.zeros(0, object)
        tensors = [t for t in ts.disk_order() if t.offset is not None and t.nbytes > 0]
        self.t_start = np.array([t.offset for t in tensors], dtype=np.int64)
        self.t_end = np.array([cast(int, t.offset) + t.nbytes for t in tensors], dtype=np.int64)
        self.t_name = [t.name for t in tensors]

    def tensor_at(self, offsets: np.ndarray) -> list[str | None]:
        """Name of this run's tensor overlapping each 4-byte slot, or None."""
        if not self.t_name:
            return [None] * len(offsets)
        i = np.searchsorted(self.t_start, offsets + SLOT, side="left") - 1
        hit = (i >= 0) & (self.t_end[np.clip(i, 0, None)] > offsets)
        return [self.t_name[j] if h else None for j, h in zip(i, hit, strict=True)]


def padding_across_runs(
    runs: Mapping[str, Source] | Sequence[Source], *, engine: str = "local"
) -> pd.DataFrame:
    """Compare the padding bytes of several runs of the same model, slot by slot.

    Parameters
    ----------
    runs
        Paths or TensorSets (labelled by file name), or a mapping label -> path/TensorSet.
    engine
        ``"local"``: read here; ``"dask"``: every gap (cut into pieces of
        ``hashing.PIECE`` bytes) read by a task on Dask's current scheduler from a file
        every worker can see; only the nonzero slots come back. The same frame.

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
    from dmlib.engine import check_engine

    labelled = _labels(runs)
    if not labelled:
        raise DmlibError("padding_across_runs needs at least one run")
    check_engine(engine)
    with contextlib.ExitStack() as stack:
        sets = {label: open_source(src, stack) for label, src in labelled.items()}
        loaded = [_Run(label, ts, _scans(ts, engine)) for label, ts in sets.items()]
    all_offsets, differs = _differing_slots(loaded)
    layouts = {
        tuple(zip(r.t_name, r.t_start.tolist(), r.t_end.tolist(), strict=True)) for r in loaded
    }
    frames: list[pd.DataFrame] = []
    totals: list[dict[str, Any]] = []
    for r in loaded:
        frame, total = _run_slots(r, differs[np.searchsorted(all_offsets, r.offset)], loaded)
        frames.append(frame)
        totals.append(total)
    frames = [f for f in frames if len(f)]
    df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=SLOT_COLUMNS)
    df.attrs["runs"] = totals
    df.attrs["differs"] = bool(differs.any())
    df.attrs["same_layout"] = len(layouts) == 1
    df.attrs["inside_tensor"] = sum(t["inside_tensor"] for t in totals)
    return df


def _scans(ts: TensorSet, engine: str) -> list[dict[str, Any]] | None:
    """The gaps' scans read by Dask workers (engine "dask"); None: _Run reads them here."""
    if engine != "dask":
        return None
    from dmlib.engine.dask_reads import padding_scans

    gaps = [(int(g.start), int(g.end)) for g in _gaps(ts).itertuples(index=False)]
    return padding_scans(ts, [(s, e) for s, e in gaps if e > s])


def _differing_slots(loaded: list[_Run]) -> tuple[np.ndarray, np.ndarray]:
    """Every slot offset of any run (sorted) and whether that slot differs between runs."""
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
    return all_offsets, shared & (bits != bits[:1]).any(axis=0)


def _run_slots(r: _Run, dif: np.ndarray, loaded: list[_Run]) -> tuple[pd.DataFrame, dict[str, Any]]:
    """One run's reported slots (dirty or differing, ``dif`` per slot) and its totals."""
    dirty = r.bits != 0
    with np.errstate(invalid="ignore", over="ignore"):
        value = r.bits.view("<f4").astype(np.float64)
        nan = np.isnan(value)
        huge = is_huge(value)
    sel = dirty | dif
    off = r.offset[sel]
    inside: list[str | None] = [None] * int(sel.sum())
    for other in loaded:
        for j, name in enumerate(other.tensor_at(off)):
            inside[j] = inside[j] or name
    frame = pd.DataFrame(
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
    total = {
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
    return frame, total


def padding_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per-run totals of a :func:`padding_across_runs` frame: ``run``, ``path``,
    ``padding_bytes``, ``nonzero_bytes``, ``padding_slots``, ``dirty_slots``, ``nan``,
    ``huge``, ``differing_slots``, ``inside_tensor``."""
    runs: list[dict[str, Any]] = df.attrs.get("runs", [])
    return pd.DataFrame(runs, columns=RUN_COLUMNS)
