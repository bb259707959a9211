"""What the cells of ``adapters`` show, one call each.

Like :mod:`dmlib.report.sections_ladder`: each function returns what its cell shows (a
table, a figure saved through :func:`~dmlib.report.save_figure`, a finding), sentences
come from :mod:`dmlib.report.prose`, numbers are recorded through
:func:`~dmlib.report.record`. The adapters are the study's runs whose checkpoints are LoRA
adapters (:func:`adapter_run_labels`); the gradients are the ``[adapters]`` section's
(:mod:`dmlib.report.study_adapters`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from dmlib.report import prose
from dmlib.report.notebook import finding, record, save_figure, say, skip

__all__ = [
    "Adapters",
    "adapter_run_labels",
    "adapters_finding",
    "adapters_of",
    "delta_figure",
    "delta_growth",
    "gradient_figure",
    "gradient_l2",
]


def adapter_run_labels(study: Any) -> list[str]:
    """The study's runs whose every checkpoint is a LoRA adapter (a PEFT folder, or an
    adapter weights file beside its ``adapter_config.json``)."""
    from dmlib.io.hf_pretrained import is_adapter

    return [k for k, r in study.runs.items()
            if r.checkpoints and all(is_adapter(p) for p in r.checkpoints.values())]  # fmt: skip


@dataclass
class Adapters:
    """The adapter runs (``{label: {step: path}}``), the gradient section, what cells computed."""

    study: Any
    runs: dict[str, dict[int, Path]]
    gradients: Any = None
    growth: pd.DataFrame | None = None
    l2: pd.DataFrame | None = None

    @property
    def empty(self) -> bool:
        """True when the study has neither adapter runs nor gradients (said once)."""
        return not self.runs and not (self.gradients and self.gradients.gradients)


def adapters_of(study: Any, small: bool = False) -> Adapters:
    """The adapter runs with their steps (three runs when ``small``) and the gradients;
    records ``adapter_runs``. A study with neither gets one line saying what is missing."""
    labels = adapter_run_labels(study)
    ref = study.reference if study.reference in labels else None
    labels = ([ref] if ref else []) + [k for k in labels if k != ref]
    labels = labels[:3] if small else labels
    runs = {k: {s: p for s, p in study.runs[k].checkpoints.items() if s is not None}
            for k in labels}  # fmt: skip
    ad = Adapters(study=study, runs={k: v for k, v in runs.items() if v}, gradients=study.adapters)
    if ad.empty:
        skip(prose.NO_ADAPTERS_HERE)
        return ad
    record("adapter_runs", list(ad.runs))
    say(*(prose.ladder_runs(study.title, len(ad.runs), k, sorted(v)) for k, v in ad.runs.items()))
    return ad


def delta_growth(ad: Adapters) -> pd.DataFrame | None:
    """The Frobenius norm of the weight each target adds (``scaling * B @ A``, float64), per
    run and step: columns ``run``, ``step``, ``target``, ``delta_norm``; recorded."""
    if ad.empty:
        return None
    if not any(len(v) for v in ad.runs.values()):
        skip(prose.NO_ADAPTER_LADDER)
        return None
    from dmlib.forensics.lora import open_adapter

    rows = []
    for run, steps in ad.runs.items():
        for step, path in sorted(steps.items()):
            with contextlib.ExitStack() as stack:
                adapter = open_adapter(path, stack)
                for target in adapter.targets:
                    delta = adapter.delta(target)[0]
                    rows.append({"run": run, "step": step, "target": target,
                                 "delta_norm": float(np.linalg.norm(delta))})  # fmt: skip
    ad.growth = pd.DataFrame(rows, columns=["run", "step", "target", "delta_norm"])
    record("delta_growth", ad.growth.to_dict("records"))
    return ad.growth


def delta_figure(ad: Adapters) -> Any:
    """Figure 1: the weight each target adds, by step, in the first adapter run."""
    if ad.growth is None or not len(ad.growth):
        return None
    import matplotlib.pyplot as plt

    from dmlib.plots.adapters import adapter_delta_growth

    run = next(iter(ad.runs))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    adapter_delta_growth(ad.growth[ad.growth["run"] == run], ax=ax, title=f"run {run}")
    save_figure(fig, "adapters_delta_growth")
    return fig


def gradient_l2(ad: Adapters) -> pd.DataFrame | None:
    """The global relative L2 of the gradient group (:func:`dmlib.group_l2`) of every run
    against the reference run, at every step both saved: columns ``pair``, ``a``, ``b``,
    ``step``, ``rel_l2``, ``control``; recorded."""
    if ad.empty:
        return None
    g = ad.gradients
    if g is None or len(g.gradients) < 2:
        skip(prose.NO_GRADIENTS)
        return None
    from dmlib.stats.group_l2 import group_l2_records

    labels = list(g.gradients)
    control = g.control or (ad.study.control if ad.study.control in labels else None)
    ref = ad.study.reference if ad.study.reference in labels and ad.study.reference != control \
        else next(k for k in labels if k != control)  # fmt: skip
    rows = []
    for other in (k for k in labels if k != ref):
        for step in sorted(set(g.gradients[ref]) & set(g.gradients[other])):
            (r,) = group_l2_records(g.gradients[ref][step], g.gradients[other][step], [g.group])
            rows.append({"pair": f"{ref} vs {other}", "a": ref, "b": other, "step": step,
                         "rel_l2": r["rel_l2"], "n_tensors": r["n_tensors"],
                         "control": other == control})  # fmt: skip
    ad.l2 = pd.DataFrame(rows, columns=["pair", "a", "b", "step", "rel_l2", "n_tensors", "control"])
    record("gradient_l2", ad.l2.to_dict("records"))
    record("gradient_group", g.group)
    return ad.l2


def gradient_figure(ad: Adapters) -> Any:
    """Figure 2: the global gradient L2 per step, the control's pair dashed."""
    if ad.l2 is None or not len(ad.l2):
        return None
    import matplotlib.pyplot as plt

    from dmlib.plots.adapters import gradient_l2_steps

    fig, ax = plt.subplots(figsize=(9, 4.5))
    gradient_l2_steps(ad.l2, ax=ax, title=f"gradient group {ad.gradients.group}")
    save_figure(fig, "adapters_gradient_l2")
    return fig


def adapters_finding(ad: Adapters) -> str | None:
    """The notebook's finding: the target whose added weight grew most in the first
    adapter run, and every run's gradient L2 against the reference at the last step, the
    control's last."""
    if ad.empty:
        return None
    parts = []
    if ad.growth is not None and len(ad.growth):
        run = next(iter(ad.runs))
        sub = ad.growth[ad.growth["run"] == run]
        first, last = int(sub["step"].min()), int(sub["step"].max())
        a = sub[sub["step"] == first].set_index("target")["delta_norm"]
        b = sub[sub["step"] == last].set_index("target")["delta_norm"]
        grew = (b - a).dropna()
        if first != last and len(grew):
            worst = str(grew.idxmax())
            parts.append(prose.adapter_growth(run, len(b), first, last, worst, a[worst], b[worst]))
    if ad.l2 is not None and len(ad.l2):
        last_step = int(ad.l2["step"].max())
        at = ad.l2[ad.l2["step"] == last_step]
        ref = str(at["a"].iloc[0])
        others, ctrl = at[~at["control"]], at[at["control"]]
        same = dict(zip(others["b"], others["rel_l2"], strict=True))
        control = dict(zip(ctrl["b"], ctrl["rel_l2"], strict=True))
        parts.append(prose.gradient_l2_finding(ad.gradients.group, last_step, ref, same, control))
    return finding(" ".join(parts)) if parts else None
