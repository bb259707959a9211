"""What the cells of the matrix notebooks show, one call each.

``run_matrix`` and ``ulp_distributions`` open their study with :func:`study_matrix` (the
runs at their last shared step and :func:`dmlib.matrix` of them, computed once per
report through :mod:`dmlib.report.cache`); every later cell is one call here returning
what it shows (a table, a figure saved through :func:`~dmlib.report.save_figure`, a
finding). Sentences come from :mod:`dmlib.report.prose`; numbers are recorded through
:func:`~dmlib.report.record`. A section's conclusion lines accumulate on the
:class:`StudyMatrix` and :func:`conclude` says them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from dmlib.errors import DmlibError
from dmlib.report import cache, prose
from dmlib.report.notebook import finding, record, runs_at_last_step, save_figure, say, skip

__all__ = [
    "StudyMatrix",
    "conclude",
    "differing_rows",
    "effective_weights",
    "matrix_finding",
    "matrix_heatmap",
    "pairs_table",
    "runs_table",
    "study_matrix",
    "top_differing",
    "ulp_histogram",
    "ulp_hist_table",
    "ulp_pairs_table",
    "worst_rel_fro",
]


@dataclass
class StudyMatrix:
    """The runs a matrix notebook compares and their matrix (``dmlib.matrix`` frame)."""

    study: Any
    labels: list[str]
    files: dict[str, Path]
    when: str
    matrix: pd.DataFrame | None
    lines: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """True when the study could not be compared (said once, by :func:`study_matrix`)."""
        return self.matrix is None

    @property
    def control(self) -> str | None:
        """The study's control run (None when none is declared)."""
        return self.study.control

    @property
    def frame(self) -> pd.DataFrame:
        """The matrix (refused, one line, when nothing was compared)."""
        if self.matrix is None:
            raise DmlibError(f"{self.study.title}: the runs were not compared")
        return self.matrix

    @property
    def verdict(self) -> Any:
        """The matrix's :class:`~dmlib.MatrixVerdict`."""
        return self.frame.attrs["verdict"]

    @property
    def pairs(self) -> pd.DataFrame:
        """One row per pair of runs: the verdict's pairs."""
        return pd.DataFrame(self.verdict["pairs"])


def study_matrix(study: Any, small: bool = False, *, use_cache: bool = True) -> StudyMatrix:
    """The runs of ``study`` at their last shared step (:func:`runs_at_last_step`) and their
    matrix, computed once per report; records ``runs`` and ``when`` and says which runs.

    A study with fewer than two runs, or runs that cannot be compared (a ``DmlibError``),
    gets one line saying what is missing and how to add it, and an empty
    :class:`StudyMatrix` on which every later cell shows nothing."""
    if len(study.runs) < 2:
        skip(prose.FEWER_THAN_TWO_RUNS_HERE)
        return StudyMatrix(study=study, labels=[], files={}, when="", matrix=None)
    labels, files, when = runs_at_last_step(study, small)
    record("runs", labels)
    record("when", when)
    say(prose.matrix_runs(study.title, len(labels), when, study.control))
    try:
        m = cache.study_matrix(study, files, control=study.control, use_cache=use_cache)
    except DmlibError as err:
        skip(f"the runs could not be compared: {err}")
        return StudyMatrix(study=study, labels=labels, files=files, when=when, matrix=None)
    return StudyMatrix(study=study, labels=labels, files=files, when=when, matrix=m)


def runs_table(sm: StudyMatrix) -> pd.DataFrame | None:
    """Each run and the checkpoint compared (relative to the study's folder)."""
    if sm.empty:
        return None
    return pd.DataFrame(
        {"run": list(sm.files), "file": [sm.study.rel(p) for p in sm.files.values()]}
    )


def pairs_table(sm: StudyMatrix) -> pd.DataFrame | None:
    """The verdict's pairs, one row per pair of runs."""
    if sm.empty:
        return None
    return sm.pairs


def worst_rel_fro(sm: StudyMatrix) -> None:
    """Records each pair's worst rel_fro, the bit-identical pairs and the separation, and
    says each pair's, once (one line per pair; no table repeating them)."""
    if sm.empty:
        return None
    pairs, v = sm.pairs, sm.verdict
    by_pair = {f"{a}/{b}": x for a, b, x in zip(pairs["a"], pairs["b"], pairs["worst_rel_fro"])}
    record("worst_rel_fro", by_pair)
    record("identical_pairs", v["identical_pairs"])
    record("separation_orders", v["separation_orders"])
    say(*prose.pair_worst_lines(pairs))


def matrix_heatmap(sm: StudyMatrix) -> Any:
    """Figure 1 of ``run_matrix``: worst rel_fro over the stored tensors, every pair."""
    if sm.empty:
        return None
    import matplotlib.pyplot as plt

    from dmlib import plots

    fig, ax = plt.subplots(figsize=(7.5, 6))
    plots.run_matrix_heatmap(
        sm.pairs, value="worst_rel_fro", order=sm.labels, compared="numel", ax=ax,
        title=f"Worst rel_fro over stored tensors, {sm.when}",
    )  # fmt: skip
    save_figure(fig, "run_matrix_worst_rel_fro")
    return fig


def differing_rows(sm: StudyMatrix) -> pd.DataFrame:
    """The matrix rows of the pairs without the control (every row when none is declared)."""
    m, control = sm.frame, sm.control
    return m[~m["a"].eq(control) & ~m["b"].eq(control)] if control else m


def matrix_finding(sm: StudyMatrix) -> str | None:
    """Records the matrix's finding (:func:`prose.matrix`) and keeps its conclusion lines."""
    if sm.empty:
        return None
    text, lines = _matrix_prose(sm)
    sm.lines += lines
    return finding(text)


def _matrix_prose(sm: StudyMatrix) -> tuple[str, list[str]]:
    """:func:`prose.matrix` of the study's matrix: its finding and conclusion lines."""
    rows = differing_rows(sm)
    ordered = rows.loc[rows["n_diff"] > 0].sort_values("rel_fro", ascending=False)["name"]
    return prose.matrix(
        sm.verdict, sm.when, n_tensors=int(sm.frame["name"].nunique()),
        differing=list(dict.fromkeys(ordered)), frame=sm.frame,
    )  # fmt: skip


def effective_weights(sm: StudyMatrix) -> pd.DataFrame | None:
    """Figure 2 of ``run_matrix``: the effective weight ``W`` of the factor groups, pair
    by pair (:func:`dmlib.factor_matrix`); skipped when the study declares none."""
    if sm.empty:
        return None
    study = sm.study
    if not study.factor_groups:
        skip("the study declares no factor groups ([[factor_groups]]): no effective-weight matrix")
        return None
    import matplotlib.pyplot as plt

    from dmlib import plots
    from dmlib.forensics.factors import factor_matrix

    sources = study.sources(sm.files)
    effective = factor_matrix(sources, study.factor_group_objects()).attrs["pairs"]
    fig, ax = plt.subplots(figsize=(7.5, 6))
    plots.run_matrix_heatmap(
        effective, value="rel_fro", order=sm.labels, ax=ax,
        title=f"Worst rel_fro of the effective weight W, {sm.when}",
    )  # fmt: skip
    save_figure(fig, "run_matrix_effective_rel_fro")
    pairs = zip(effective["a"], effective["b"], effective["rel_fro"])
    record("effective_rel_fro", {f"{a}/{b}": v for a, b, v in pairs})
    sm.lines += prose.effective(effective, sm.pairs, sm.control, sm.when)
    return effective


def ulp_hist_table(sm: StudyMatrix) -> tuple[pd.DataFrame, str, str | None]:
    """The ULP histogram summed over the pairs without the control and over those with
    it: ``(hist, same_group, control_group)`` (``hist``: ``pairs``, ``bucket``, ``count``)."""
    from dmlib.stats.compare import ulp_long

    control = sm.control
    long = ulp_long(sm.frame)
    same_name, ctrl_name = (
        ("pairs without the control", f"pairs with the control {control}")
        if control
        else ("all pairs", None)
    )
    long["pairs"] = [
        ctrl_name if control in (a, b) else same_name for a, b in zip(long["a"], long["b"])
    ]
    grouped = long.groupby(["pairs", "bucket"], observed=False, sort=True)["count"]
    return grouped.sum().reset_index(), same_name, ctrl_name


def ulp_pairs_table(sm: StudyMatrix) -> pd.DataFrame:
    """The ULP histogram of each pair of runs: ``pair`` ("a/b"), ``group`` (pairs without
    the control, pairs with it), ``bucket``, ``count``; the pairs in the matrix's order, those
    without the control first, and only the buckets from the first to the last holding a
    differing element in some pair."""
    from dmlib.stats.compare import ulp_long

    control = sm.control
    long = ulp_long(sm.frame)
    same_name, ctrl_name = (
        ("pairs without the control", f"pairs with the control {control}")
        if control
        else ("pairs", None)
    )
    long["pair"] = long["a"].astype(str) + "/" + long["b"].astype(str)
    long["group"] = [
        ctrl_name if control in (a, b) else same_name for a, b in zip(long["a"], long["b"])
    ]
    per = long.groupby(["group", "pair", "bucket"], observed=True, sort=False)["count"].sum()
    per = per.reset_index()
    order = [f"{a}/{b}" for a, b in zip(sm.pairs["a"], sm.pairs["b"])]
    per["_g"] = per["group"].eq(ctrl_name)
    per["_p"] = per["pair"].map({p: i for i, p in enumerate(order)})
    per = per.sort_values(["_g", "_p", "bucket"], kind="stable").drop(columns=["_g", "_p"])
    used = per.groupby("bucket", observed=True, sort=True)["count"].sum()
    nz = [b for b, c in used.items() if c > 0]
    if nz:
        cats = list(used.index)
        keep = cats[cats.index(nz[0]) : cats.index(nz[-1]) + 1]
        per = per[per["bucket"].isin(keep)]
    return per.reset_index(drop=True)


def ulp_histogram(sm: StudyMatrix) -> Any:
    """Figure 1 of ``ulp_distributions``: the ULP distance of every differing element,
    one line per pair of runs coloured by group (a bit-identical pair is named, never
    pooled away); records both groups' totals; skipped when every element is identical."""
    if sm.empty:
        return None
    hist, same_name, ctrl_name = ulp_hist_table(sm)
    record("hist_same_total", int(hist.loc[hist["pairs"].eq(same_name), "count"].sum()))
    ctrl_total = int(hist.loc[hist["pairs"].eq(ctrl_name), "count"].sum()) if ctrl_name else None
    record("hist_control_total", ctrl_total)
    if hist["count"].sum() == 0:
        skip(f"every element is bit-identical in every pair {sm.when}: no ULP distance to draw")
        return None
    import matplotlib.pyplot as plt

    from dmlib import plots

    fig, ax = plt.subplots(figsize=(11, 4.8))
    plots.ulp_histogram_by_pair(
        ulp_pairs_table(sm), ax=ax,
        # on two lines: one long line widens the image and the page shrinks the plot
        title=prose.ulp_title(sm.verdict, sm.when, sm.control, sm.frame).replace(": ", ":\n", 1),
    )  # fmt: skip
    save_figure(fig, "ulp_histogram")
    return fig


_VERDICT_NUMBERS = (
    "same_worst_rel_fro",
    "control_rel_fro",
    "separation_orders",
    "same_max_ulp",
    "control_max_ulp",
    "identical_pairs",
    "never_differ",
)


def top_differing(sm: StudyMatrix, n: int = 10) -> pd.DataFrame | None:
    """Records the verdict's numbers and the finding; returns the ``n`` differing tensors
    (pairs without the control) with the largest rel_fro."""
    if sm.empty:
        return None
    for key in _VERDICT_NUMBERS:
        record(key, sm.verdict[key])
    # its own finding, in ULP (run_matrix states the pairs in rel_fro); the same conclusions
    finding(prose.ulp_finding(sm.verdict, sm.when))
    sm.lines += _matrix_prose(sm)[1]
    rows = differing_rows(sm)
    cols = ["a", "b", "name", "n_diff", "max_ulp", "median_ulp", "rel_fro"]
    return rows.loc[rows["n_diff"] > 0, cols].sort_values("rel_fro", ascending=False).head(n)


def conclude(sm: StudyMatrix) -> None:
    """Says the conclusion lines the sections above computed (nothing when there are none)."""
    if sm.lines:
        say(*sm.lines)
