"""What the cells of ``step_growth`` show, one call each.

Like :mod:`dmlib.report.sections`: each function returns what its cell shows (a table,
a figure saved through :func:`~dmlib.report.save_figure`, a finding), sentences come
from :mod:`dmlib.report.prose`, numbers are recorded through
:func:`~dmlib.report.record`, the conclusion lines gather on the :class:`Ladder`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from dmlib.report import prose
from dmlib.report.notebook import finding, record, save_figure, say, skip

__all__ = [
    "Ladder",
    "check",
    "conclude",
    "divergence",
    "growth_grid",
    "ladder_finding",
    "ladder_runs",
    "rates",
]


@dataclass
class Ladder:
    """The runs with a step ladder, the reference, and what the cells computed."""

    study: Any
    ladder: dict[str, dict[int, Path]]
    reference: str
    repeat_of: dict[str, str]
    sources: dict[str, Any] | None = None
    df: pd.DataFrame | None = None
    repeats: dict[str, pd.DataFrame] = field(default_factory=dict)
    small: list[str] = field(default_factory=list)
    below: float = 0.1
    rates: pd.DataFrame | None = None
    lines: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """True when the study has no step ladder (said once, by :func:`ladder_runs`)."""
        return not self.ladder


def ladder_runs(study: Any, small: bool = False) -> Ladder:
    """The runs with checkpoints at two or more steps, the reference first (three runs
    when ``small``); records ``runs`` and ``reference`` and says the steps.

    A study without a step ladder gets one line saying what is missing and how to add
    it, and an empty :class:`Ladder` on which every later cell shows nothing."""
    ladder = study.ladders()
    if not ladder:
        skip(prose.NO_LADDER_HERE)
        return Ladder(study=study, ladder={}, reference="", repeat_of={})
    reference = study.reference if study.reference in ladder else next(iter(ladder))
    labels = [reference, *[k for k in ladder if k != reference]]
    if small:  # a quick run: the reference and two more runs
        labels = labels[:3]
    ladder = {k: ladder[k] for k in labels}
    repeat_of = {r: o for r, o in study.repeats.items() if r in ladder and o in ladder}
    record("runs", labels)
    record("reference", reference)
    steps = sorted({s for v in ladder.values() for s in v})
    say(prose.ladder_runs(study.title, len(ladder), reference, steps))
    return Ladder(study=study, ladder=ladder, reference=reference, repeat_of=repeat_of)


def check(sg: Ladder) -> pd.DataFrame | None:
    """:func:`dmlib.check_steps` of every checkpoint (does it record the step it claims?);
    records the counts and the highest verified step."""
    if sg.empty:
        return None
    from dmlib.forensics.ladder import check_steps

    sg.sources = sg.study.ladder_sources(sg.ladder)  # [names] and mappings applied
    checks = check_steps(sg.sources)
    record("n_checkpoints", len(checks))
    record("n_flagged", int(checks["flagged"].sum()))
    ok = checks["status"].eq("ok")
    record("max_verified_step", int(checks.loc[ok, "step"].max()) if ok.any() else None)
    cols = ["run", "step", "path", "recorded_step", "status", "detail"]
    return checks.assign(path=[sg.study.rel(p) for p in checks["path"]])[cols]


def _repeat_frames(sg: Ladder) -> dict[str, pd.DataFrame]:
    """Each repeat pair's ladder: from the reference's frame, else computed on its own."""
    from dmlib.forensics.ladder import step_ladder

    out = {}
    sources = sg.sources or {}  # set by the ladder's cell before the repeats are asked for
    for r, o in sg.repeat_of.items():
        if sg.df is not None and o == sg.reference:
            out[f"{o}/{r}"] = sg.df[sg.df["pair"].eq(f"{o}/{r}")]
        else:
            pair = {o: sources[o], r: sources[r]}
            out[f"{o}/{r}"] = step_ladder(pair, reference=o)
    return out


def divergence(sg: Ladder, below: float = 0.1) -> pd.DataFrame | None:
    """:func:`dmlib.step_ladder` against the reference and each repeat pair; records the
    small-norm parameters (norm below ``below``); returns the three largest per pair and step."""
    if sg.empty:
        return None
    from dmlib.forensics.ladder import small_norm, step_ladder

    if sg.sources is None:
        sg.sources = sg.study.ladder_sources(sg.ladder)
    if len(sg.ladder) < 2:
        skip(prose.ONE_LADDER)
    else:
        sg.df = step_ladder(sg.sources, reference=sg.reference)
    sg.repeats, sg.below = _repeat_frames(sg), below
    if sg.df is None:
        return None
    sg.small, first_step = small_norm(sg.df, below)
    record("small_norm", sg.small)
    say(prose.small_norm_line(sg.small, below, first_step))
    top = sg.df.sort_values(["pair", "step", "rank"]).groupby(["pair", "step"]).head(3)
    return top[["pair", "step", "rank", "name", "norm", "n_diff", "rel_fro"]]


def growth_grid(sg: Ladder) -> Any:
    """Figure 1: rel_fro of every parameter against the reference by step, one panel per run."""
    if sg.df is None:
        return None
    from dmlib import plots

    fig = plots.step_growth_grid(
        sg.df, sg.reference, highlight=sg.small, highlight_label=f"norm < {sg.below}"
    )
    save_figure(fig, "step_growth_rel_fro")
    return fig


def rates(sg: Ladder) -> pd.DataFrame | None:
    """Figure 2: growth of rel_fro per step by group (:func:`dmlib.growth_rates`); returns
    the rates (skipped, with the table still shown, when no group can be fitted)."""
    if sg.df is None:
        return None
    import matplotlib.pyplot as plt

    from dmlib import plots
    from dmlib.forensics.ladder import growth_rates

    sg.rates = growth_rates(sg.df, by=sg.study.group_of(list(sg.df["name"].unique())))
    drawn = sg.rates.dropna(subset=["slope"])
    if len(drawn):
        fig, ax = plt.subplots(figsize=(9, 4.5))
        title = prose.growth_title(drawn["step_min"].min(), drawn["step_max"].max())
        plots.growth_rate_bars(sg.rates, ax=ax, title=title)  # pairs without a rate named
        save_figure(fig, "step_growth_rates")
    else:
        skip(prose.NO_GROWTH)
    return sg.rates


def ladder_finding(sg: Ladder, n: int = 5) -> pd.DataFrame | None:
    """Records the last step's figures, the rates and the finding (:func:`prose.ladder`);
    returns the ``n`` largest movers per pair at the last step."""
    df = sg.df
    if df is None:
        return None
    last = int(df["step"].max())
    at_last = df[df["step"].eq(last)]
    record("last_step", last)
    record("repeat_n_diff", {p: int(s["n_diff"].sum()) for p, s in sg.repeats.items()})
    movers = {
        p: g.loc[g["rel_fro"].idxmax(), "name"]
        for p, g in at_last.groupby("pair")
        if g["rel_fro"].max() > 0
    }
    record("top_mover_at_last_step", movers)
    by_step = df.groupby(["pair", "step"])["rel_fro"].max().items()
    record("max_rel_fro_by_pair_and_step", {f"{p}@{s}": float(v) for (p, s), v in by_step})
    record("rates", [] if sg.rates is None else sg.rates.to_dict("records"))
    text, lines = prose.ladder(
        df, sg.reference, sg.repeats, sg.rates, sg.small, sg.below, control=sg.study.control
    )
    finding(text)
    sg.lines += lines
    top = at_last.sort_values("rel_fro", ascending=False).groupby("pair").head(n)
    return top[["pair", "step", "name", "norm", "rel_fro"]]


def conclude(sg: Ladder) -> None:
    """Says the conclusion lines the cells above computed (nothing when there are none)."""
    if sg.lines:
        say(*sg.lines)
