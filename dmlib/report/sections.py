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
    "worst_rel_fro",
]


@dataclass
class StudyMatrix:
    """The runs a matrix notebook compares and their matrix (``dmlib.matrix`` frame)."""

    study: Any
    labels: list[str]
    files: dict[str, Path]
    when: str
    matrix: pd.DataFrame
    lines: list[str] = field(default_factory=list)

    @property
    def control(self) -> str | None:
        """The study's control run (None when none is declared)."""
        return self.study.control

    @property
    def verdict(self) -> Any:
        """The matrix's :class:`~dmlib.MatrixVerdict`."""
        return self.matrix.attrs["verdict"]

    @property
    def pairs(self) -> pd.DataFrame:
        """One row per pair of runs: the verdict's pairs."""
        return pd.DataFrame(self.verdict["pairs"])


def study_matrix(study: Any, small: bool = False, *, use_cache: bool = True) -> StudyMatrix:
    """The runs of ``study`` at their last shared step (:func:`runs_at_last_step`) and their
    matrix, computed once per report; records ``runs`` and ``when`` and says which runs."""
    labels, files, when = runs_at_last_step(study, small)
    record("runs", labels)
    record("when", when)
    say(prose.matrix_runs(study.title, len(labels), when, study.control))
    m = cache.study_matrix(study, files, control=study.control, use_cache=use_cache)
    return StudyMatrix(study=study, labels=labels, files=files, when=when, matrix=m)


def runs_table(sm: StudyMatrix) -> pd.DataFrame:
    """Each run and the checkpoint compared (relative to the study's folder)."""
    return pd.DataFrame(
        {"run": list(sm.files), "file": [sm.study.rel(p) for p in sm.files.values()]}
    )


def pairs_table(sm: StudyMatrix) -> pd.DataFrame:
    """The verdict's pairs, one row per pair of runs."""
    return sm.pairs


def worst_rel_fro(sm: StudyMatrix) -> pd.DataFrame:
    """Records each pair's worst rel_fro, the bit-identical pairs and the separation, and
    says each pair's; returns the pairs' ``a``, ``b``, ``identical`` and ``worst_rel_fro``."""
    pairs, v = sm.pairs, sm.verdict
    by_pair = {f"{a}/{b}": x for a, b, x in zip(pairs["a"], pairs["b"], pairs["worst_rel_fro"])}
    record("worst_rel_fro", by_pair)
    record("identical_pairs", v["identical_pairs"])
    record("separation_orders", v["separation_orders"])
    say(*prose.pair_worst_lines(pairs))
    return pairs[["a", "b", "identical", "worst_rel_fro"]]


def matrix_heatmap(sm: StudyMatrix) -> Any:
    """Figure 1 of ``run_matrix``: worst rel_fro over the stored tensors, every pair."""
    import matplotlib.pyplot as plt

    from dmlib import plots

    fig, ax = plt.subplots(figsize=(7.5, 6))
    plots.run_matrix_heatmap(
        sm.pairs, value="worst_rel_fro", order=sm.labels, ax=ax,
        title=f"Worst rel_fro over stored tensors, {sm.when}",
    )  # fmt: skip
    save_figure(fig, "run_matrix_worst_rel_fro")
    return fig


def differing_rows(sm: StudyMatrix) -> pd.DataFrame:
    """The matrix rows of the pairs without the control (every row when none is declared)."""
    m, control = sm.matrix, sm.control
    return m[~m["a"].eq(control) & ~m["b"].eq(control)] if control else m


def matrix_finding(sm: StudyMatrix) -> str:
    """Records the matrix's finding (:func:`prose.matrix`) and keeps its conclusion lines."""
    rows = differing_rows(sm)
    ordered = rows.loc[rows["n_diff"] > 0].sort_values("rel_fro", ascending=False)["name"]
    text, lines = prose.matrix(
        sm.verdict, sm.when, n_tensors=int(sm.matrix["name"].nunique()),
        differing=list(dict.fromkeys(ordered)),
    )  # fmt: skip
    sm.lines += lines
    return finding(text)


def effective_weights(sm: StudyMatrix) -> pd.DataFrame | None:
    """Figure 2 of ``run_matrix``: the effective weight ``W`` of the factor groups, pair
    by pair (:func:`dmlib.factor_matrix`); skipped when the study declares none."""
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
    long = ulp_long(sm.matrix)
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


def ulp_histogram(sm: StudyMatrix) -> Any:
    """Figure 1 of ``ulp_distributions``: the ULP distance of every differing element by
    group of pairs; records both groups' totals; skipped when every element is identical."""
    hist, same_name, ctrl_name = ulp_hist_table(sm)
    record("hist_same_total", int(hist.loc[hist["pairs"].eq(same_name), "count"].sum()))
    ctrl_total = int(hist.loc[hist["pairs"].eq(ctrl_name), "count"].sum()) if ctrl_name else None
    record("hist_control_total", ctrl_total)
    if hist["count"].sum() == 0:
        skip(f"every element is bit-identical in every pair {sm.when}: no ULP distance to draw")
        return None
    import matplotlib.pyplot as plt

    from dmlib import plots

    drawn = set(hist.loc[hist["count"].gt(0), "pairs"])
    fig, ax = plt.subplots(figsize=(11, 4.8))
    plots.ulp_histogram(
        hist[hist["count"].gt(0) | hist["pairs"].isin(drawn)], hue="pairs", ax=ax,
        title=prose.ulp_title(sm.verdict, sm.when, sm.control),
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


def top_differing(sm: StudyMatrix, n: int = 10) -> pd.DataFrame:
    """Records the verdict's numbers and the finding; returns the ``n`` differing tensors
    (pairs without the control) with the largest rel_fro."""
    for key in _VERDICT_NUMBERS:
        record(key, sm.verdict[key])
    matrix_finding(sm)
    rows = differing_rows(sm)
    cols = ["a", "b", "name", "n_diff", "max_ulp", "median_ulp", "rel_fro"]
    return rows.loc[rows["n_diff"] > 0, cols].sort_values("rel_fro", ascending=False).head(n)


def conclude(sm: StudyMatrix) -> None:
    """Says the conclusion lines the sections above computed (nothing when there are none)."""
    if sm.lines:
        say(*sm.lines)
