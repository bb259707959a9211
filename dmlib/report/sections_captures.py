"""What the cells of ``capture_boundaries`` show, one call each.

Like :mod:`dmlib.report.sections`: each function returns what its cell shows (a table,
a figure saved through :func:`~dmlib.report.save_figure`, a finding), sentences come
from :mod:`dmlib.report.prose`, numbers are recorded through
:func:`~dmlib.report.record`, the conclusion lines gather on the :class:`Captures`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from dmlib.report import prose
from dmlib.report.notebook import (
    compare_study_captures,
    finding,
    md_code,
    md_text,
    record,
    save_figure,
    say,
    skip,
)

__all__ = [
    "Captures",
    "block_heatmap",
    "boundary_profile",
    "captures",
    "conclude",
    "culprit",
    "expert_rows",
    "op_level",
    "routing",
]

SUMMARY_KEYS = (
    "first_divergent_boundary",
    "culprit",
    "n_divergent",
    "n_comparable",
    "n_boundaries",
    "valid",
)
CULPRIT_COLUMNS = [
    "boundary",
    "role",
    "identical",
    "n_diff",
    "n_diff_rows",
    "max_abs",
    "rel_fro",
    "max_ulp",
    "diff_blocks",
]


@dataclass
class Captures:
    """The study's capture comparisons (``REF vs LABEL`` -> compare_captures frame)."""

    study: Any
    results: dict[str, pd.DataFrame]
    lines: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """True when nothing was compared (said once, by :func:`captures`)."""
        return not self.results

    @property
    def main_label(self) -> str:
        """The first comparison's label (the reference against the first other capture)."""
        return next(iter(self.results))

    @property
    def main(self) -> pd.DataFrame:
        """The first comparison's frame."""
        return self.results[self.main_label]


def captures(study: Any) -> tuple[Captures, pd.DataFrame | None]:
    """Each capture compared with the reference (:func:`compare_study_captures`); records
    ``reference`` and says what is compared; returns the comparisons and one summary row
    per comparison.

    A study without captures, or whose captures hold only the reference, gets one line
    saying what is missing and how to add it, and empty comparisons on which every later
    cell shows nothing."""
    cap = study.captures
    if cap is None or not [k for k in cap.folders if k != cap.reference]:
        skip(prose.NO_CAPTURES_HERE if cap is None else prose.ONLY_REFERENCE_CAPTURE)
        return Captures(study=study, results={}), None
    ref = cap.reference
    record("reference", ref)
    say(prose.captures_compared(cap.request, ref, [k for k in cap.folders if k != ref]))
    cb = Captures(study=study, results=compare_study_captures(study))
    rows = {label: {k: df.attrs[k] for k in SUMMARY_KEYS} for label, df in cb.results.items()}
    return cb, pd.DataFrame.from_dict(rows, orient="index")


def boundary_profile(cb: Captures) -> Any:
    """Figure 1: rel_fro at each boundary for each comparison (skipped when no boundary
    was dumped in both captures)."""
    if cb.empty:
        return None
    long = pd.concat(
        [df.assign(comparison=label) for label, df in cb.results.items()], ignore_index=True
    )
    if not long["rel_fro"].notna().any():
        skip(prose.NO_DUMPED_BOUNDARY)
        return None
    import matplotlib.pyplot as plt

    from dmlib import plots

    cap = cb.study.captures
    first = {label: df.attrs["first_divergent_boundary"] for label, df in cb.results.items()}
    title = f"Request {cap.request or '(all)'}: rel_fro per boundary against {cap.reference}"
    fig, ax = plt.subplots(figsize=(12, 5))
    plots.boundary_profile(long, first_divergent=first, ax=ax, title=title)
    save_figure(fig, "captures_boundary_profile")
    return fig


def block_heatmap(cb: Captures) -> Any:
    """Figure 2: for the first comparison, which blocks of rows differ at each boundary."""
    if cb.empty:
        return None
    import matplotlib.pyplot as plt

    from dmlib import plots

    main = cb.main
    index = main.attrs["block_index"]
    several = len({x[0] for x in index}) > 1  # blocks of several requests: name the request
    labels = [f"{r}:[{s},{e})" if several else f"[{s},{e})" for r, _, s, e in index]
    fig, ax = plt.subplots(figsize=(9, min(14, 3 + 0.05 * len(main))))
    title = f"{cb.main_label}: differing blocks; first divergent: {main.attrs['first_divergent_boundary']}"
    plots.block_heatmap(main, n_blocks=len(index), block_labels=labels, ax=ax, title=title)
    save_figure(fig, "captures_block_heatmap")
    return fig


def culprit(cb: Captures) -> pd.DataFrame | None:
    """Records the first comparison's verdict and the finding (:func:`prose.captures`);
    returns its culprit, entry and enclosing boundaries, the differing ones with element
    statistics, and the states the forward left in its cache."""
    if cb.empty:
        return None
    main, a = cb.main, cb.main.attrs
    for key in ("first_divergent_boundary", "culprit", "n_divergent", "n_boundaries", "valid"):
        record(key, a[key])
    record("repeat_control_held", (a["repeat_control"] or {}).get("held"))
    record("negative_control_passed", a["negative_control"]["passed"])
    record(
        "first_divergent", {k: df.attrs["first_divergent_boundary"] for k, df in cb.results.items()}
    )
    row = main[main["boundary"] == a["culprit"]]
    record("culprit_rel_fro", row["rel_fro"].iloc[0] if len(row) else None)
    text, lines = prose.captures(cb.results)
    finding(text)
    cb.lines += lines
    # the states the forward left in its cache are listed whether or not they differ: an
    # identical output with a differing state is what the next pass would consume
    state = main["boundary"].str.contains(":state.", regex=False)
    # element statistics of the boundaries that differ (a hash-identical one reads 0 there)
    sized = main["rel_fro"].notna() & (main["identical"] == False)  # noqa: E712
    shown = main["role"].isin(["culprit", "entry", "encloses-culprit"]) | sized
    table = main.loc[shown | state, CULPRIT_COLUMNS].copy()
    # three significant digits: a fixed six decimals showed a 1-ULP state difference
    # (3.6e-15) and a 1e-7 drift as 0.0 beside identical False (the numbers are recorded)
    for col in ("max_abs", "rel_fro"):
        table[col] = [x if pd.isna(x) else f"{x:.3g}" for x in table[col]]
    return table


def op_level(cb: Captures) -> pd.DataFrame | None:
    """The op-level captures (:func:`dmlib.report.oplevel.op_level`): records their numbers,
    says their sentences, returns the arbitration table (skipped when none are declared)."""
    if cb.empty:
        return None
    cap = cb.study.captures
    if not cap.ops:
        skip(prose.NO_OP_CAPTURES)
        return None
    from dmlib.report import oplevel

    ops = oplevel.op_level(cap)
    for key, value in ops.numbers.items():
        record(key, value)
    say(*ops.lines)
    return ops.table


# what a reader needs first (which token, which experts, how near the tie, what it did)
# comes first: a wide table runs off the page on its right
ROUTING_COLUMNS = [
    "comparison", "router", "position", "experts_a", "experts_b", "margin_a", "margin_ulp_a",
    "margin_b", "margin_ulp_b", "diff_at_flip", "diff_elsewhere", "elsewhere_position",
    "request", "step", "scores",
]  # fmt: skip


def _flip_row(comparison: str, f: dict[str, Any]) -> dict[str, Any]:
    """One flip as a table row: its effect (the MoE block's largest |difference| at the
    flipped position against the largest elsewhere, where both captures dumped it) spread
    into columns, so the flipped token standing out is read off the table."""
    e = f.get("effect") or {}
    return {"comparison": comparison, **f, "diff_at_flip": e.get("at_flip"),
            "diff_elsewhere": e.get("elsewhere"),
            "elsewhere_position": e.get("elsewhere_position")}  # fmt: skip


def routing(cb: Captures) -> pd.DataFrame | None:
    """The tokens whose experts changed (``attrs["routing"]`` of each comparison): records
    the flips per comparison, says how many, returns one row per flip (skipped where no
    capture recorded an MoE router)."""
    if cb.empty:
        return None
    reports = {k: df.attrs.get("routing") for k, df in cb.results.items()}
    if all(r is None for r in reports.values()):
        skip("no MoE router was recorded in these captures (a dense model): no routing report")
        return None
    record("routing_flips", {k: (r or {}).get("n_flips") for k, r in reports.items()})
    rows = [_flip_row(k, f) for k, r in reports.items() if r is not None for f in r["flips"]]
    if not rows:
        say("No token's set of experts changed in any comparison.")
        return None
    say(*(f"{md_code(k)}: {_tokens(r['n_flips'])} changed experts{_first_flip(r['flips'])}"
          for k, r in reports.items() if r is not None))  # fmt: skip
    return pd.DataFrame(rows).reindex(columns=ROUTING_COLUMNS)


def _tokens(n: int) -> str:
    return f"{n} token" + ("" if n == 1 else "s")


def _first_flip(flips: list[dict[str, Any]]) -> str:
    """The first flip in words (which token, which experts, how near the tie, its effect),
    so that it reads without the table's right-hand columns; "" where there is none."""
    if not flips:
        return ""
    f = flips[0]
    text = (f"; the first: {md_code(f['router'])} position {f['position']}, experts "
            f"{f['experts_a']} → {f['experts_b']}")  # fmt: skip
    if "margin_a" in f and "margin_b" in f:
        text += (f", margin {f['margin_a']:.3g} ({f['margin_ulp_a']} ULP) against "
                 f"{f['margin_b']:.3g} ({f['margin_ulp_b']} ULP)")  # fmt: skip
    e = f.get("effect")
    if e:
        text += (f"; the MoE block's output differs by {e['at_flip']:.3g} at that token, "
                 f"{e['elsewhere']:.3g} at most elsewhere")  # fmt: skip
    return text


def _per_module(differ: list[dict[str, Any]]) -> str:
    """How many differing expert rows each experts module has, in execution order."""
    counts: dict[str, int] = {}
    for d in differ:
        counts[d["module"]] = counts.get(d["module"], 0) + 1
    return ", ".join(f"{md_code(m)} {n}" for m, n in counts.items())


# (each row's boundary is module:expert<e>.<stage>, the columns before it: not repeated)
EXPERT_COLUMNS = [
    "comparison", "module", "expert", "stage", "request", "position", "role", "step",
]  # fmt: skip


def expert_rows(cb: Captures) -> pd.DataFrame | None:
    """The expert rows that differ (``attrs["experts"]`` of each comparison: one row per
    (expert, stage, request, position) whose digests differ, in execution order): records
    how many per comparison, says the first, returns the table (skipped where no capture
    recorded expert rows)."""
    if cb.empty:
        return None
    reports = {k: df.attrs.get("experts") for k, df in cb.results.items()}
    if all(r is None for r in reports.values()):
        skip("no expert rows were recorded in these captures (dmlib.capture(..., experts=True) "
             "on a mixture-of-experts model records them)")  # fmt: skip
        return None
    record("expert_rows_differ", {k: (r or {}).get("n_rows_differ") for k, r in reports.items()})
    rows = [
        {"comparison": k, **d} for k, r in reports.items() if r is not None for d in r["differ"]
    ]
    if not rows:
        say("No expert row differs in any comparison (rows routed to an expert in one run only "
            "are routing flips, listed above).")  # fmt: skip
        return None
    say(*(f"{md_code(k)}: {r['n_rows_differ']} expert rows differ ({_per_module(r['differ'])}); "
          f"the first: {md_text(r['first_divergent']['text'])}"
          for k, r in reports.items() if r is not None and r["first_divergent"]))  # fmt: skip
    return pd.DataFrame(rows).reindex(columns=EXPERT_COLUMNS)


def conclude(cb: Captures) -> None:
    """Says the conclusion lines the cells above computed (nothing when there are none)."""
    if cb.lines:
        say(*cb.lines)
