"""What the cells of ``checkpoint_anatomy`` and ``qr_first_divergent_column`` show, one call each.

Like :mod:`dmlib.report.sections`: each function returns what its cell shows (a table,
figures saved through :func:`~dmlib.report.save_figure`, a finding), sentences come from
:mod:`dmlib.report.prose`, numbers are recorded through :func:`~dmlib.report.record`, and
the conclusion lines gather on the section object for :func:`conclude`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from dmlib.report import prose
from dmlib.report.notebook import finding, record, save_figure, say, skip

__all__ = [
    "Anatomy",
    "Columns",
    "anatomy_files",
    "census",
    "column_histogram",
    "column_runs",
    "conclude",
    "first_columns",
    "same_names",
    "tensors",
]

SLOT_COLUMNS = [
    "record",
    "flat_slots",
    "named_slots",
    "padding_slots",
    "padding_nonzero_slots",
    "nan",
    "huge",
]


@dataclass
class Anatomy:
    """The files the anatomy notebook reads, what it opened and counted."""

    study: Any
    files: list[Path]
    opened: dict[str, Any] = field(default_factory=dict)
    slots: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)


def anatomy_files(study: Any) -> Anatomy:
    """The study's ``[anatomy]`` files, else the reference run's last checkpoint; records
    ``files`` and says which (one line saying what is missing and how to add it when the
    study names no checkpoint: every later cell then shows nothing)."""
    if not study.runs and not study.anatomy:
        skip(prose.NO_CHECKPOINT_HERE)
        return Anatomy(study=study, files=[])
    ref_run = study.runs[study.reference or next(iter(study.runs))]
    files = study.anatomy or [ref_run.last()[1]]
    names = [study.rel(p) for p in files]
    record("files", names)
    say(prose.anatomy_files(names))
    return Anatomy(study=study, files=list(files))


def _burnpack_figures(i: int, path: Path, table: pd.DataFrame, c: Any, n_records: int) -> None:
    """The byte layout and the slot counts of one burnpack file, saved as figures."""
    import matplotlib.pyplot as plt

    from dmlib import plots

    fig, ax = plt.subplots(figsize=(11, 3.2))
    title = f"{path.name}: byte layout of {n_records} record(s)"
    plots.layout_map(table, c.gaps, ax=ax, title=title)
    save_figure(fig, f"anatomy_layout_{i}")
    fig, ax = plt.subplots(figsize=(9, 4.5))
    title = f"{path.name}: flat vs named vs padding slots per record"
    plots.slot_counts(c.slots, ax=ax, title=title)
    save_figure(fig, f"anatomy_slots_{i}")


def census(an: Anatomy) -> pd.DataFrame | None:
    """Opens each file; maps the layout and counts the slots of each burnpack file (two
    figures per file); records ``slots``. One row per file: format, size, records,
    tensors, and for burnpack files the gaps holding non-zero bytes, NaN and huge slots."""
    if not an.files:
        return None
    from dmlib.io import open_tensors
    from dmlib.padding import padding_census

    rows = []
    for i, path in enumerate(an.files):
        name, ts = an.study.rel(path), open_tensors(path)
        an.opened[name] = ts
        table, n_records = ts.table(), len(ts.records) or 1
        row = {"file": name, "format": ts.format, "bytes": path.stat().st_size}
        row.update(records=n_records, tensors=len(table))
        if ts.format != "burnpack":
            skip(prose.not_burnpack(name, ts.format))
            rows.append(row)
            continue
        c = padding_census(ts)
        an.slots[name] = c.slots[SLOT_COLUMNS].to_dict("records")
        _burnpack_figures(i, path, table, c, n_records)
        row.update(
            gaps=len(c.gaps), nonzero_gaps=int((c.gaps["nonzero_bytes"] > 0).sum()),
            padding_nan=int(c.slots["nan"].sum()), padding_huge=int(c.slots["huge"].sum()),
        )  # fmt: skip
        rows.append(row)
    record("slots", an.slots)
    return pd.DataFrame(rows)


def tensors(an: Anatomy, n: int = 20) -> pd.DataFrame | None:
    """The first ``n`` tensors of each file opened by :func:`census`: file, name, dtype,
    shape and bytes."""
    if not an.files:
        return None
    cols = ["name", "dtype", "shape", "nbytes"]
    parts = [ts.table()[cols].head(n).assign(file=name) for name, ts in an.opened.items()]
    if not parts:
        return pd.DataFrame(columns=["file", *cols])
    return pd.concat(parts, ignore_index=True)[["file", *cols]]


def _record_sources(an: Anatomy) -> dict[str, Any]:
    """Each record of each opened file (``file#index`` when a file holds several)."""
    sources = {}
    for name, ts in an.opened.items():
        for r in ts.records if len(ts.records) > 1 else [ts]:
            sources[f"{name}#{r.index}" if len(ts.records) > 1 else name] = r
    return sources


def same_names(an: Anatomy) -> pd.DataFrame | None:
    """Sources in different files holding the same tensor names, compared by their named
    tensors and by their file hashes; records ``same_names`` and the finding."""
    if not an.files:
        return None
    from dmlib.hashing import hash_file
    from dmlib.stats.compare import compare, summarize

    sources = _record_sources(an)
    keys, facts = list(sources), []
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            if a.split("#")[0] == b.split("#")[0] or set(sources[a]) != set(sources[b]):
                continue
            s = summarize(compare(sources[a], sources[b]))
            fa, fb = (an.opened[x.split("#")[0]].path for x in (a, b))
            facts.append(
                {"a": a, "b": b, "tensors": s["n_tensors"], "identical_tensors": bool(s["identical"]),
                 "file_sha256_equal": hash_file(fa) == hash_file(fb)}
            )  # fmt: skip
    record("same_names", facts)
    text, lines = prose.anatomy(an.slots, facts, n_files=len(an.files))
    if not facts:
        skip(prose.NO_SAME_NAMES)
    finding(text)
    an.lines += lines
    return pd.DataFrame(facts)


@dataclass
class Columns:
    """The runs and factor tensors the column notebook compares, and its results."""

    study: Any
    runs: list[str]
    files: dict[str, Path]
    when: str
    patterns: list[str]
    table: pd.DataFrame | None = None
    summary: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)


def column_runs(study: Any, small: bool = False) -> Columns:
    """The runs besides the control (three when ``small``) at their last shared step and
    the factor tensors' name patterns; records ``runs`` and ``factor_patterns``.

    A study without factor groups gets one line saying what is missing and how to add
    it; every later cell then shows nothing."""
    labels = [k for k in study.runs if k != study.control]
    if not study.factor_groups:
        skip(prose.NO_FACTOR_GROUPS_HERE)
        return Columns(study=study, runs=[], files={}, when="", patterns=[])
    if small:  # a quick run: three runs
        labels = labels[:3]
    files, when = study.at_last_step(labels)
    patterns = [
        g[k].replace("{prefix}", "*") for g in study.factor_groups for k in ("u", "v", "a", "b") if k in g
    ]  # fmt: skip
    record("runs", labels)
    record("factor_patterns", patterns)
    say(prose.column_runs(len(files), when, patterns))
    return Columns(study=study, runs=labels, files=files, when=when, patterns=patterns)


def first_columns(qc: Columns) -> pd.Series | None:
    """Each pair's first divergent column of each factor tensor, and the negated columns;
    records the summary and the finding (skipped with fewer than two runs)."""
    if not qc.study.factor_groups:  # said by column_runs
        return None
    if len(qc.files) < 2:
        skip(prose.FEWER_THAN_TWO_RUNS)
        return None
    from dmlib.forensics.columns import first_divergent_columns, sign_flip_table

    sources = qc.study.sources(qc.files)
    table = first_divergent_columns(sources, include=qc.patterns)
    if not len(table):  # nothing compared is no finding: say what to fix
        skip(prose.no_factor_tensors(qc.patterns, list(qc.files)))
        return None
    qc.table, qc.summary = table, table.attrs["summary"]
    flips = sign_flip_table(sources, include=qc.patterns)
    for key, value in qc.summary.items():
        record(key, value)
    n_flipped, n_changed = int(flips["n_flipped"].sum()), int(flips["n_changed"].sum())
    record("n_flipped", n_flipped)
    record("n_changed_columns", n_changed)
    text, lines = prose.columns(qc.summary, n_flipped, n_changed, qc.when)
    finding(text)
    qc.lines += lines
    return pd.Series(qc.summary)


def column_histogram(qc: Columns) -> pd.DataFrame | None:
    """Figure 1: how many (pair, factor tensor) combinations first differ at each column;
    returns per pair the tensors, the identical ones and the earliest column."""
    if qc.table is None:
        return None
    s = qc.summary
    if s["n_pairs"] <= s["n_identical"]:
        skip(prose.all_columns_identical(qc.when))
        return None
    import matplotlib.pyplot as plt

    from dmlib import plots

    fig, ax = plt.subplots(figsize=(10, 4.5))
    title = prose.column_histogram_title(s["n_pairs"], len(qc.files), qc.when, s["n_identical"])
    plots.first_column_histogram(qc.table, ax=ax, title=title)
    save_figure(fig, "first_divergent_column")
    return qc.table.groupby("pair").agg(
        tensors=("name", "size"), identical=("identical", "sum"), earliest_col=("first_col", "min")
    )


def conclude(section: Any) -> None:
    """Says the conclusion lines the section's cells computed (nothing when there are none)."""
    if section.lines:
        say(*section.lines)
