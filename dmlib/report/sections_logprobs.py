"""What the cells of ``logprob_drift`` show, one call each.

Like the other ``sections*`` modules: each function returns what its cell shows (a table,
a figure saved through :func:`~dmlib.report.save_figure`, a finding), numbers are
recorded through :func:`~dmlib.report.record`, and names from the study reach Markdown
only through :func:`~dmlib.report.md_code`. The sentences are built here from the
ladder's numbers (the study's ``[logprobs]`` section: :mod:`dmlib.report.study_logprobs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd

from dmlib.numfmt import prose, sci
from dmlib.report.htmlsafe import md_code
from dmlib.report.notebook import finding, record, save_figure, say, skip
from dmlib.stats.logprobs import LADDER_SHOWN

__all__ = ["Drift", "drift_figure", "drift_finding", "drift_runs", "drift_table"]

#: What a study without log-prob runs is told to add (one line, no traceback).
NO_LOGPROBS = (
    "the study has no log-prob runs: add a [logprobs] section to study.toml naming, per "
    "run, the sampler's and the trainer's log-prob files of each step "
    '(policy = { a = "lp/policy/sampler_*.jsonl", b = "lp/policy/trainer_*.safetensors" }) '
    'and control = "RUN" for an lr=0 run (see docs/logprobs.md)'
)


@dataclass
class Drift:
    """The ladder of the study's log-prob runs (None when the study has none)."""

    df: pd.DataFrame | None
    control: str | None

    @property
    def empty(self) -> bool:
        return self.df is None


def drift_runs(study: Any, small: bool = False) -> Drift:
    """Every run's mismatch at every step (:func:`dmlib.logprob_ladder`); says which runs
    and steps, records them. A study without ``[logprobs]`` gets one line saying what to
    add, and an empty :class:`Drift` on which the later cells show nothing."""
    lp = getattr(study, "logprobs", None)
    if lp is None:
        skip(NO_LOGPROBS)
        return Drift(None, None)
    from dmlib.stats.logprobs import logprob_ladder

    labels = list(lp.runs)
    if small:  # a quick run: two runs and the control
        labels = [k for k in labels if k != lp.control][:2] + ([lp.control] if lp.control else [])
    runs = {k: {s: (str(a), str(b)) for s, (a, b) in lp.runs[k].items()} for k in labels}
    df = logprob_ladder(runs, control=lp.control, mask=None if lp.mask is None else str(lp.mask))
    record("runs", labels)
    record("control", lp.control)
    steps = sorted({int(s) for s in df["step"]})
    control = "no control run" if lp.control is None else f"control {md_code(lp.control)} (lr=0)"
    say(
        f"{len(labels)} runs ({', '.join(md_code(k) for k in labels)}; {control}), "
        f"log-probs of the sampler (A) and the trainer (B) at steps {', '.join(map(str, steps))}."
    )
    return Drift(df, lp.control)


def drift_table(d: Drift) -> pd.DataFrame | None:
    """One row per run and step: the gate's status and the mismatch figures; records them."""
    if d.empty:
        return None
    assert d.df is not None
    record("ladder", d.df.to_dict("records"))
    return d.df[[c for c in LADDER_SHOWN if c in d.df.columns]]


def drift_figure(d: Drift, y: str = "k3") -> Any:
    """The figure: ``y`` per step for each run, the control as a band."""
    if d.empty:
        return None
    import matplotlib.pyplot as plt

    from dmlib import plots

    fig, ax = plt.subplots(figsize=(8, 4.5))
    plots.logprob_drift(d.df, y=y, ax=ax, title=f"{y} of sampler against trainer, per step")
    save_figure(fig, f"logprob_drift_{y}")
    return fig


def drift_finding(d: Drift, y: str = "k3") -> str | None:
    """The finding: each run's ``y`` at its last comparable step against the control's
    largest, and the steps that were not comparable."""
    if d.empty:
        return None
    df = d.df
    assert df is not None
    bad = df[df["status"] == "not comparable"]
    ok = df[df["status"].isin(["identical", "differs"])]
    ctrl = ok[ok["is_control"]] if d.control is not None else ok.iloc[0:0]
    band = float(ctrl[y].max()) if len(ctrl) else None
    parts = []
    for run, sub in ok[~ok["is_control"]].groupby("run", sort=False):
        last = sub.sort_values("step").iloc[-1]
        parts.append(_run_sentence(str(run), int(last["step"]), float(last[y]), y, band))
    if bad.shape[0]:
        where = ", ".join(f"{md_code(r.run)} step {r.step}" for r in bad.itertuples())
        parts.append(f"not comparable (the identity gate failed, no figure): {where}")
    if not parts:
        parts.append("no step of any run could be compared")
    record("band", band)
    return finding("; ".join(parts) + ".")


def _run_sentence(run: str, step: int, value: float, y: str, band: float | None) -> str:
    text = f"{md_code(run)}: {y} {sci(value)} at step {step}"
    if band is None:
        return text
    if value <= band:
        return f"{text}, within the lr=0 control's band (up to {sci(band)})"
    if band == 0:
        return f"{text}, where the lr=0 control shows no mismatch at any step"
    return f"{text}, {prose(value / band)} times the lr=0 control's largest ({sci(band)})"
