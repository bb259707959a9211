"""Sentences computed from results: the findings and conclusions the notebooks print.

Every sentence here is built from the numbers it quotes (and the step they belong to);
nothing is written in advance, so no sentence can be false for someone else's runs.
Each function returns ``(finding, lines)``: the notebook's one-line result and the
bullet points of its conclusion, as Markdown: every name, label and reason from the data
goes in through :func:`~dmlib.report.htmlsafe.md_code` (names) or
:func:`~dmlib.report.htmlsafe.md_text` (labels, phrases), so none can carry markup.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from dmlib.localize.expertjudge import FLIP_REASON
from dmlib.numfmt import general
from dmlib.numfmt import prose as fmt  # a number for prose: one formatter for every output
from dmlib.report.htmlsafe import md_code as _c
from dmlib.report.htmlsafe import md_text as _t

__all__ = ["anatomy", "captures", "columns", "fmt", "ladder", "matrix", "not_burnpack"]


def _list(names: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(_c(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def matrix(
    verdict: Mapping[str, Any],
    when: str,
    *,
    n_tensors: int,
    differing: Sequence[str],
    frame: pd.DataFrame | None = None,
) -> tuple[str, list[str]]:
    """Pairs of runs (``dmlib.matrix``'s verdict) ``when`` ("at step 20").

    ``frame``: the matrix's rows; when they hold optimizer state (training checkpoints),
    the finding quotes the model weights alone first and the optimizer state apart.
    """
    control = _t(verdict["control"]) if verdict["control"] is not None else None
    others = [p for p in verdict["pairs"] if not p["control"]]
    parts = by_component(frame, verdict["control"]) if frame is not None else {}
    if "weights" in parts and len(parts) > 1:  # the weights' numbers lead the finding
        w = parts["weights"]
        verdict = {**verdict, "same_worst_rel_fro": w["same"], "same_max_ulp": w["same_max_ulp"],
                   "control_rel_fro": w["control"], "separation_orders": w["separation"]}  # fmt: skip
    finding, lines = _matrix_finding(verdict, when, control, others)
    if "weights" in parts and len(parts) > 1:
        finding = finding.replace(": ", ", model weights only: ", 1) + _state_sentence(
            parts, control
        )
    if others or control is None:
        lines += _identical_pairs_lines(verdict, when, control, others)
    lines += _tensor_lines(n_tensors, differing, control)
    mu, med = verdict.get("same_max_ulp"), verdict.get("same_worst_median_ulp")
    if mu and med is not None and mu > 100 * max(med, 1):
        lines.append(
            f"max_ulp {fmt(mu)} is set by a few elements (the worst tensor's median is {fmt(med)} ULP): "
            "near zero one ULP is tiny, so rel_fro is the measure of what a layer computes."
        )
    return finding, lines


def by_component(frame: pd.DataFrame, control: str | None) -> dict[str, dict[str, Any]]:
    """The matrix's worst numbers per component of a training checkpoint (``weights``,
    ``optimizer``...: :func:`dmlib.stats.components.component_of`): ``same`` (worst rel_fro
    over the pairs without the control), ``same_max_ulp``, ``control`` (the least, over
    the control's pairs, of each pair's worst rel_fro) and ``separation`` (log10 of
    control / same; inf when same is 0, None without either)."""
    from dmlib.stats.components import component_of

    if frame is None or not len(frame):
        return {}
    comp = frame["name"].map(lambda n: component_of(str(n)))
    is_c = frame["a"].eq(control) | frame["b"].eq(control) if control else comp.eq("")
    out: dict[str, dict[str, Any]] = {}
    for c in dict.fromkeys(comp):
        mine = comp.eq(c)
        same = frame.loc[mine & ~is_c]
        rel = pd.to_numeric(same["rel_fro"], errors="coerce").fillna(0.0)
        ulp = pd.to_numeric(same["max_ulp"], errors="coerce").fillna(0)
        ctrl_rows = frame.loc[mine & is_c]
        worst = (
            pd.to_numeric(ctrl_rows["rel_fro"], errors="coerce")
            .groupby([ctrl_rows["a"], ctrl_rows["b"]])
            .max()
        )
        s = float(rel.max()) if len(same) else None
        k = float(worst.min()) if len(worst) and worst.notna().any() else None
        sep = None
        if s is not None and k is not None and k > 0:
            sep = math.inf if s == 0 else math.log10(k / s)
        out[c] = {"same": s, "same_max_ulp": int(ulp.max()) if len(same) else None,
                  "control": k, "separation": sep}  # fmt: skip
    return out


def _state_sentence(parts: Mapping[str, Mapping[str, Any]], control: str | None) -> str:
    """The optimizer state (and any other component) apart from the weights."""
    said = []
    for c, v in parts.items():
        if c == "weights" or v["same"] is None:
            continue
        text = f"{_t(c)} state: at most {fmt(v['same'])}"
        if control is not None and v["control"] is not None:
            text += f" without the control, {fmt(v['control'])} with it"
        said.append(text)
    return (" Apart from the weights, " + "; ".join(said) + ".") if said else ""


def _matrix_finding(
    verdict: Mapping[str, Any], when: str, control: str | None, others: list[Mapping[str, Any]]
) -> tuple[str, list[str]]:
    """The matrix's finding and the line on how the pairs stand against the control."""
    pairs = verdict["pairs"]
    when_cap = _t(when.capitalize())
    k = len(verdict["identical_pairs"])
    same, ctrl, sep = (
        verdict["same_worst_rel_fro"],
        verdict["control_rel_fro"],
        verdict["separation_orders"],
    )
    if control is None:
        finding = (
            f"{when_cap}: worst rel_fro over {len(pairs)} pairs of runs {fmt(same)}; "
            f"{k} of {len(pairs)} pairs bit-identical (no control declared)."
        )
        return finding, [
            "No control is declared, so nothing here says how large a real difference would be; "
            "declare a run that is expected to differ (another seed) as `control`."
        ]
    if not others:
        return f"{when_cap}: the only pair involves the control {control}, rel_fro {fmt(ctrl)}.", []
    one = len(others) == 1
    body = (
        ("is bit-identical" if one else "are all bit-identical")
        if k == len(others)
        else f"differ{'s' if one else ''} by at most rel_fro {fmt(same)} (max {fmt(verdict['same_max_ulp'])} ULP)"
    )
    subject = (
        f"the one pair without the control ({_t(others[0]['a'])}/{_t(others[0]['b'])})"
        if one
        else f"the {len(others)} pairs without the control"
    )
    sep_text = "" if sep is None or math.isinf(sep) else f", {sep:.1f} orders of magnitude apart"
    finding = (
        f"{when_cap}: {subject} {body}; "
        f"every pair with {control} by at least {fmt(ctrl)}{sep_text}."
    )
    return finding, _separation_lines(sep, same, ctrl, _t(when))


def _separation_lines(sep: float | None, same: Any, ctrl: Any, when: str) -> list[str]:
    """How far the control stands above the worst pair without it (``when`` already escaped)."""
    if sep is None:
        return []
    if math.isinf(sep):
        return [
            f"Every pair without the control is bit-identical {when}; the control differs by {fmt(ctrl)}."
        ]
    if sep >= 2:
        return [
            f"The least difference to the control is {sep:.1f} orders of magnitude above the "
            f"worst pair without it ({fmt(ctrl)} vs {fmt(same)}, {when}): those runs agree far "
            "more closely than a run expected to differ."
        ]
    if sep >= 1:
        return [
            f"The control is {sep:.1f} orders of magnitude above the worst pair without it "
            f"({fmt(ctrl)} vs {fmt(same)}, {when}): a clear but not wide separation."
        ]
    return [
        f"The worst pair without the control ({fmt(same)}) is within an order of magnitude "
        f"of the control ({fmt(ctrl)}, {when}): those runs differ about as much as a run "
        "expected to differ."
    ]


def _identical_pairs_lines(
    verdict: Mapping[str, Any], when: str, control: str | None, others: list[Mapping[str, Any]]
) -> list[str]:
    """Whether some, none or all of the pairs (without the control) are bit-identical."""
    group = others if control is not None else verdict["pairs"]
    k = len(verdict["identical_pairs"])
    if 0 < k < len(group):
        return [
            f"{k} of {len(group)} pairs are bit-identical ({', '.join(_t(x) for x in verdict['identical_pairs'][:6])}) "
            "while the others differ: a difference between processes that some runs share and "
            "others do not, rather than noise every run carries."
        ]
    if k == 0 and group:
        return [f"No pair{' without the control' if control else ''} is bit-identical {_t(when)}."]
    return []


def _tensor_lines(n_tensors: int, differing: Sequence[str], control: str | None) -> list[str]:
    """How many tensors are bit-identical in every pair, and which differ."""
    if not n_tensors:
        return []
    if differing:
        return [
            f"{n_tensors - len(differing)} of {n_tensors} tensors are bit-identical in every pair"
            f"{' without the control' if control else ''}; the {len(differing)} that differ: {_list(list(differing))}."
        ]
    return [
        f"All {n_tensors} tensors are bit-identical in every pair{' without the control' if control else ''}."
    ]


def effective(eff: pd.DataFrame, stored: pd.DataFrame, control: str | None, when: str) -> list[str]:
    """Effective weights (``factor_matrix`` pairs) against stored tensors, pair by pair."""
    is_c = (
        (eff["a"].eq(control) | eff["b"].eq(control))
        if control
        else pd.Series(False, index=eff.index)
    )
    same_w = eff.loc[~is_c, "rel_fro"].max() if (~is_c).any() else None
    s_is_c = (
        (stored["a"].eq(control) | stored["b"].eq(control))
        if control
        else pd.Series(False, index=stored.index)
    )
    same_s = stored.loc[~s_is_c, "worst_rel_fro"].max() if (~s_is_c).any() else None
    when = _t(when)
    line = (
        f"Judged on the weight the factorised layers compute, pairs{' without the control' if control else ''} "
        f"differ by at most rel_fro {fmt(same_w)} {when}, against {fmt(same_s)} for the worst stored tensor."
    )
    if control and is_c.any():
        line += f" Pairs with the control: at least {fmt(eff.loc[is_c, 'rel_fro'].min())}."
    return [line]


def columns(
    summary: Mapping[str, Any], n_flipped: int, n_changed: int, when: str
) -> tuple[str, list[str]]:
    """First divergent columns of factor tensors (``first_divergent_columns`` summary)."""
    n, ident = summary["n_pairs"], summary["n_identical"]
    when_cap, when = _t(when.capitalize()), _t(when)
    if n == ident:
        finding = f"{when_cap}: all {n} factor-tensor pairs are bit-identical; no column diverges."
        return finding, [finding]
    finding = (
        f"{when_cap}: the first divergent column ranges over {summary['first_col_min']}..{summary['first_col_max']} "
        f"(median {fmt(summary['first_col_median'])}) across {n - ident} differing factor-tensor pairs; {ident} of {n} bit-identical."
    )
    lines = [
        f"Every column before a pair's first divergent column is bit-identical {when}; where the factors "
        "come from a Householder QR, that column is the iteration at which the two processes first rounded differently.",
    ]
    if summary["first_col_min"] == summary["first_col_max"]:
        lines.append(
            f"Every differing pair first diverges at the same column, {summary['first_col_min']}: a fixed point, as a systematic cause would give."
        )
    else:
        lines.append(
            "The first divergent column varies between pairs: the cause is not tied to one fixed column."
        )
    if ident:
        lines.append(
            f"{ident} of {n} factor-tensor pairs are bit-identical next to differing ones."
        )
    lines.append(
        f"{n_flipped} of {n_changed} changed columns have cosine below -0.9 (a negated column)"
        + (": the differences are a sign-preserving scatter." if n_flipped == 0 else ".")
    )
    return finding, lines


def ladder(
    df: pd.DataFrame,
    reference: str,
    repeats: Mapping[str, pd.DataFrame],
    rates: pd.DataFrame,
    small: Sequence[str],
    small_norm: float,
    control: str | None = None,
) -> tuple[str, list[str]]:
    """A step ladder against ``reference`` (``dmlib.step_ladder``) and its repeat pairs.

    Pairs with the ``control`` are described line by line but kept out of the finding's
    summary of the other runs, and quoted after it.
    """
    steps = sorted(int(s) for s in df["step"].unique())
    lines = [_pair_line(pair, sub, repeat=True) for pair, sub in repeats.items()]
    pairs = [p for p in dict.fromkeys(df["pair"]) if p not in set(repeats)]
    ctrl_pairs = [p for p in pairs if control is not None and control in p.split("/")]
    earliest, n_div = None, 0
    for pair in pairs:
        sub = df[df["pair"].eq(pair)]
        lines.append(_pair_line(pair, sub))
        first = _first(sub)
        if first is not None and pair not in ctrl_pairs:
            n_div += 1
            if earliest is None or first < earliest[0]:
                earliest = (first, pair)
    last = steps[-1] if steps else None
    at_last = df[df["step"].eq(last)]
    lines += _rate_lines(rates)
    if small and len(at_last):
        lines += _small_lines(at_last, small, small_norm, last)
    others = [p for p in pairs if p not in ctrl_pairs]
    finding = _ladder_finding(reference, steps, others, ctrl_pairs, earliest, n_div, at_last)
    finding += _controls_and_repeats(df, ctrl_pairs, repeats, steps)
    if not repeats:
        lines.append(
            "No repeat is declared ([repeats]): nothing shows whether a run of the same configuration "
            "reproduces itself, so differences cannot be attributed to the configurations alone."
        )
    return finding, lines


def _rate_lines(rates: pd.DataFrame) -> list[str]:
    """Per pair: the median growth of rel_fro per step over its groups."""
    lines = []
    for pair, g in rates.dropna(subset=["slope"]).groupby("pair"):
        med = float(g["slope"].median())
        lines.append(
            f"{_t(pair)}: rel_fro {'grows' if med > 0 else 'shrinks'} by a median {abs(med):.2g} decades per step "
            f"over its groups (fit over steps {int(g['step_min'].min())}-{int(g['step_max'].max())} where rel_fro > 0)."
        )
    return lines


def _small_lines(
    at_last: pd.DataFrame, small: Sequence[str], small_norm: float, last: int | None
) -> list[str]:
    """Per pair at the last step: median rel_fro of the small-norm parameters against the others."""
    lines = []
    for pair, g in at_last.groupby("pair"):
        is_small = g["name"].isin(small)
        a, b = g.loc[is_small, "rel_fro"].median(), g.loc[~is_small, "rel_fro"].median()
        if is_small.any() and (~is_small).any() and (a > 0 or b > 0):
            lines.append(
                f"{_t(pair)} at step {last}: parameters of norm < {small_norm} have median rel_fro {fmt(a)}, "
                f"the others {fmt(b)}."
            )
    return lines


def _ladder_finding(
    reference: str,
    steps: list[int],
    others: list[str],
    ctrl_pairs: list[str],
    earliest: tuple[int, str] | None,
    n_div: int,
    at_last: pd.DataFrame,
) -> str:
    """The ladder's finding for the runs besides repeats and the control."""
    span = (
        f"steps {steps[0]}-{steps[-1]}"
        if len(steps) > 1
        else f"step {steps[0]}"
        if steps
        else "no step"
    )
    if not others:
        return (
            f"Against {_t(reference)}, {span}: no run besides repeats and the control to compare."
        )
    if earliest is None:
        return f"Against {_t(reference)}, {span}: every run{' but the control' if ctrl_pairs else ''} is bit-identical at every step."
    at_o = at_last[at_last["pair"].isin(others)]
    top = at_o.loc[at_o["rel_fro"].idxmax()] if len(at_o) and at_o["rel_fro"].max() > 0 else None
    word = "run" if len(others) == 1 else "runs"
    finding = (
        f"Against {_t(reference)}, {span}: {n_div} of {len(others)} {word}{' besides the control' if ctrl_pairs else ''} "
        f"{'diverges' if n_div == 1 else 'diverge'}, the earliest from step {earliest[0]} ({_t(earliest[1])})"
        + _first_compared(earliest[0], steps)
    )
    if top is not None:
        last = steps[-1] if steps else None
        finding += f"; largest rel_fro at step {last}: {fmt(top['rel_fro'])} ({_c(top['name'])}, {_t(top['pair'])})"
    return finding + "."


def _controls_and_repeats(
    df: pd.DataFrame,
    ctrl_pairs: list[str],
    repeats: Mapping[str, pd.DataFrame],
    steps: list[int],
) -> str:
    """The sentences the finding ends with: each control pair, then each repeat pair."""
    text = ""
    for pair in ctrl_pairs:
        first = _first(df[df["pair"].eq(pair)])
        text += f" Control {_t(pair)}: " + (
            "bit-identical at every step."
            if first is None
            else f"differs from step {first} on{_first_compared(first, steps)}."
        )
    for pair, sub in repeats.items():
        first = _first(sub)
        text += (
            f" Repeat {_t(pair)}: bit-identical at every step."
            if first is None
            else f" Repeat {_t(pair)}: differs from step {first}{_first_compared(first, steps)}."
        )
    return text


def _first_compared(step: int, steps: Sequence[int]) -> str:
    """ " (the first step compared)" when ``step`` is: no earlier step shows it began there."""
    return " (the first step compared)" if steps and step == min(steps) else ""


def _first(sub: pd.DataFrame) -> int | None:
    per = sub.groupby("step")["n_diff"].sum()
    nz = per[per > 0]
    return int(nz.index.min()) if len(nz) else None


def _pair_line(pair: str, sub: pd.DataFrame, *, repeat: bool = False) -> str:
    steps = sorted(int(s) for s in sub["step"].unique())
    first = _first(sub)
    what = f"Repeat {_t(pair)}" if repeat else _t(pair)
    if first is None:
        text = f"{what}: bit-identical at every step compared ({', '.join(map(str, steps))})."
        if repeat:
            text += " The training loop reproduces itself here, so the other runs' differences come from what their configurations change."
        return text
    before = [s for s in steps if s < first]
    worst = sub.loc[sub["rel_fro"].idxmax()]
    text = (
        f"{what}: "
        + (f"bit-identical through step {before[-1]}, " if before else "")
        + f"differs from step {first} on"
        + ("" if before else " (the first step compared)")
        + f"; max rel_fro {fmt(worst['rel_fro'])} at step {int(worst['step'])} ({_c(worst['name'])})."
    )
    if repeat:
        text += " Runs of the same configuration do not reproduce each other here, so a difference in another run cannot be put down to its configuration alone."
    return text


def captures(results: Mapping[str, pd.DataFrame]) -> tuple[str, list[str]]:
    """Capture comparisons (``compare_captures`` frames by label), first one leading."""
    lines = []
    finding = ""
    for i, (label, df) in enumerate(results.items()):
        at = df.attrs
        unjudged = at.get("unjudged", [])
        # expert boundaries holding a token routed in one run only: the routing table's flips
        flips = [u for u in unjudged if str(u["reason"]).startswith(FLIP_REASON)]
        if at["first_divergent_boundary"] is not None:  # the flips are told apart there
            unjudged = [u for u in unjudged if u not in flips]
        shown = "; ".join(f"{_c(u['boundary'])} ({_t(u['reason'])})" for u in unjudged[:4])
        label = _t(label)
        shown += f"; and {len(unjudged) - 4} more" if len(unjudged) > 4 else ""
        if at["first_divergent_boundary"] is not None:
            text = f"{label}: first divergent boundary {_c(at['first_divergent_boundary'])}"
            text += (
                f"; culprit (inputs identical, output differs): {_c(at['culprit'])}."
                if at["culprit"]
                else "; no culprit (no boundary with identical inputs and a differing output)."
            )
            others = list(at.get("culprits") or [])[1:]
            if others:
                text += f" Other entry points (also culprits): {_list(others)}."
            if unjudged:
                text += f" {len(unjudged)} boundaries could not be judged: {shown}."
            if flips:
                text += (f" {len(flips)} expert boundaries hold a token routed to that expert in "
                         "one run only (routing flips: see the routing table): not judged.")  # fmt: skip
        elif at.get("status") == "identical" and not unjudged:
            text = f"{label}: identical at all {at['n_comparable']} boundaries."
        elif at.get("status") == "identical":
            text = (
                f"{label}: identical: the model's outputs match and no judged boundary differs; "
                f"{len(unjudged)} inner boundaries could not be judged: {shown}."
            )
        else:
            text = (
                f"{label}: inconclusive: no difference at the {at['n_comparable']} boundaries judged, "
                f"but {len(unjudged)} could not be judged and the model's outputs were not shown "
                f"to match: {shown}."
            )
        rc, nc = at.get("repeat_control"), at.get("negative_control") or {}
        if rc is not None:
            text += (
                " Repeat control held."
                if rc.get("held")
                else " Repeat control FAILED: the same layout captured twice differs, so this difference cannot be told from run-to-run noise."
            )
        if nc.get("passed") is not None:
            text += (
                " Negative control passed."
                if nc["passed"]
                else " Negative control FAILED: the comparison missed a planted difference."
            )
        lines.append(text)
        if i == 0:
            finding = text
    first = next(iter(results.values()))
    if first.attrs.get("repeat_control") is None:
        lines.append(
            "No repeat capture is declared for the first comparison ([captures.repeats]): a difference cannot be told from run-to-run noise."
        )
    return finding, lines


NO_SAME_NAMES = "no two sources hold the same tensor names (declare such files in [anatomy])"


def not_burnpack(name: str, file_format: str) -> str:
    """Why a file gets no byte-layout map (plain text, for :func:`~dmlib.report.skip`)."""
    return (
        f"{name} is a {file_format} file: the byte-layout map and padding census read "
        "burnpack files"
    )


def anatomy(
    slots: Mapping[str, Sequence[Mapping[str, Any]]],
    facts: Sequence[Mapping[str, Any]],
    n_files: int,
) -> tuple[str, list[str]]:
    """Checkpoint anatomy: slot counts per burnpack file (``padding_census`` slots records by
    file) and pairs of sources holding the same tensor names (``facts``: ``a``, ``b``,
    ``tensors``, ``identical_tensors``, ``file_sha256_equal``), of ``n_files`` files listed."""
    lines = [_slots_line(name, recs) for name, recs in slots.items()]
    lines += [_same_names_line(f) for f in facts]
    n_dirty = sum(1 for recs in slots.values() if any(r["padding_nonzero_slots"] for r in recs))
    finding = (
        f"{len(slots)} burnpack file(s) mapped; {n_dirty} with non-zero padding"
        if slots
        else f"{n_files} file(s) listed, none burnpack"
    )
    if facts:
        n = sum(f["identical_tensors"] and not f["file_sha256_equal"] for f in facts)
        finding += f"; {n} pair(s) hold identical tensors in different files"
    return finding + ".", lines


def _slots_line(name: str, recs: Sequence[Mapping[str, Any]]) -> str:
    pad = sum(r["padding_slots"] for r in recs)
    nz = sum(r["padding_nonzero_slots"] for r in recs)
    head = (
        f"{_c(name)}: {sum(r['named_slots'] for r in recs):,} named slots and {pad:,} padding "
        f"slots over {len(recs)} record(s); "
    )
    if not nz:
        return head + "the padding is all zero bytes."
    return head + (
        f"{nz:,} padding slots hold non-zero bytes ({sum(r['nan'] for r in recs)} NaN, "
        f"{sum(r['huge'] for r in recs)} |v| >= 1e30): a flat read counts them as parameters."
    )


def _same_names_line(f: Mapping[str, Any]) -> str:
    text = f"{_c(f['a'])} and {_c(f['b'])}: {f['tensors']} tensors, "
    if not f["identical_tensors"]:
        return text + "not identical."
    if f["file_sha256_equal"]:
        return text + "bit-identical, and the files are byte-identical."
    return text + "bit-identical, yet the files differ: compare named tensors, never file hashes."


def matrix_runs(title: str, n_runs: int, when: str, control: str | None) -> str:
    """The runs a matrix notebook compares, in one sentence."""
    tail = f", control {_c(control)}" if control else ", no control declared"
    return f"{_t(title)}: {n_runs} runs {_t(when)}{tail}."


def ulp_title(
    verdict: Mapping[str, Any],
    when: str,
    control: str | None,
    frame: pd.DataFrame | None = None,
) -> str:
    """The ULP histogram's title: the worst rel_fro without the control, and against it.

    ``frame``: the matrix's rows; when they hold more than the model weights (a training
    checkpoint's optimizer state), the histogram counts every component's elements and the
    title says so, quoting the weights' numbers (as the finding does), not a pooled worst."""
    parts = by_component(frame, control) if frame is not None else {}
    what, whose = "", ""
    if "weights" in parts and len(parts) > 1:
        w = parts["weights"]
        verdict = {**verdict, "same_worst_rel_fro": w["same"], "control_rel_fro": w["control"],
                   "separation_orders": w["separation"]}  # fmt: skip
        what = f" ({' and '.join(parts)} elements)"  # fixed words: component_of's names
        whose = "model weights' "
    sep = verdict["separation_orders"]
    title = (
        f"ULP distance of differing elements{what}, {when}: {whose}worst rel_fro "
        f"{'without the control ' if control else 'over the pairs '}"
        f"{fmt(verdict['same_worst_rel_fro'])}"
    )
    if control:
        title += f" vs control {fmt(verdict['control_rel_fro'])}" + (
            f", {sep:.1f} orders of magnitude apart"
            if sep is not None and abs(sep) != float("inf")
            else ""
        )
    return title


def anatomy_files(names: Sequence[str]) -> str:
    """The files the anatomy notebook reads, in one sentence."""
    return f"{len(names)} file(s) read: {', '.join(_c(n) for n in names)}."


def column_runs(n_runs: int, when: str, patterns: Sequence[str]) -> str:
    """The runs and factor tensors the column notebook compares, in one sentence."""
    return (
        f"{n_runs} runs without the control, {_t(when)}; factor tensors: "
        f"{', '.join(_c(p) for p in patterns) or 'none'}."
    )


def column_histogram_title(n_pairs: int, n_runs: int, when: str, n_identical: int) -> str:
    """The first-divergent-column histogram's title."""
    return (
        f"First divergent column over {n_pairs} factor-tensor pairs "
        f"({n_runs} runs, {when}); {n_identical} pairs bit-identical"
    )


def all_columns_identical(when: str) -> str:
    """Why the column histogram is skipped (plain text, for :func:`~dmlib.report.skip`)."""
    return f"every factor-tensor pair is bit-identical {when}: no column to draw"


FEWER_THAN_TWO_RUNS = (
    "fewer than two runs besides the control: no pair to compare column by column; add a "
    "run to [runs] in the study.toml"
)


def pair_worst_lines(pairs: pd.DataFrame) -> list[str]:
    """One line per pair of runs: its worst rel_fro over the stored tensors (``%g``)."""
    return [
        f"{_t(a)}/{_t(b)}: worst rel_fro {general(v)}"
        for a, b, v in zip(pairs["a"], pairs["b"], pairs["worst_rel_fro"])
    ]


def ladder_runs(title: str, n_runs: int, reference: str, steps: Sequence[int]) -> str:
    """The runs a step ladder compares and the steps they were saved at, in one sentence."""
    return (
        f"{_t(title)}: {n_runs} runs against {_c(reference)}; steps: "
        f"{', '.join(str(s) for s in steps)}."
    )


def small_norm_line(small: Sequence[str], below: float, step: int) -> str:
    """How many parameters are small-norm at the first step, with the first eight named."""
    head = f"{len(small)} small-norm parameters (norm < {fmt(below)} at step {step})"
    return head + (f": {_list(small, 8)}." if small else ".")


ONE_LADDER = "only one run has a step ladder: nothing to compare it with"
NO_GROWTH = "no group has rel_fro > 0 at two steps or more: no growth rate to fit"


def growth_title(step_min: Any, step_max: Any) -> str:
    """The growth-rate figure's title (the steps the fits span)."""
    return f"Growth of rel_fro per step by group (fit over steps {step_min}-{step_max} where rel_fro > 0)"


def captures_compared(request: str | None, reference: str, others: Sequence[str]) -> str:
    """The request, the reference capture and the captures compared with it, in one sentence."""
    req = _c(request) if request else "every request"
    return f"Request: {req}; reference: {_c(reference)}; compared: {_list(others, len(others)) or 'none'}."


NO_DUMPED_BOUNDARY = (
    "no boundary was dumped in both captures: no element statistics to draw "
    "(Figure 2 uses the hashes)"
)
NO_OP_CAPTURES = (
    "the study declares no op-level captures ([captures.ops]): no first divergent op, "
    "patch test or fp64 arbitration"
)


def ulp_finding(verdict: Mapping[str, Any], when: str) -> str:
    """``ulp_distributions``' finding: the pairs' distances in ULP (``dmlib.matrix``'s
    verdict), where ``run_matrix``'s finding speaks in rel_fro."""
    control = verdict["control"]
    others = [p for p in verdict["pairs"] if not p["control"]] if control else verdict["pairs"]
    k, n = len(verdict["identical_pairs"]), len(others)
    mu, med = verdict.get("same_max_ulp"), verdict.get("same_worst_median_ulp")
    head = f"{_t(when.capitalize())}: "
    if n:
        subject = "pairs without the control" if control else "pairs"
        spread = f"by at most {fmt(mu)} ULP (the largest per-tensor median {fmt(med)} ULP)"
        head += (
            f"all {n} {subject} bit-identical (0 ULP)"
            if k == n
            else f"none of the {n} {subject} is bit-identical; they differ {spread}"
            if k == 0
            else f"{k} of {n} {subject} bit-identical; the others differ {spread}"
        )
    if control:
        head += ("; " if n else "") + (
            f"every pair with the control {_t(control)} reaches at least "
            f"{fmt(verdict.get('control_max_ulp'))} ULP in its worst tensor"
        )
    return head + "."


# what a notebook says when its study lacks the data it reads: what is missing, how to add it
NO_CAPTURES_HERE = (
    "this study declares no captures: add a [captures] table to its study.toml (request, "
    "reference and [captures.folders] naming folders written by dmlib.capture; README, "
    "'Your runs, your report'), or point STUDY at a study that has one"
)
ONLY_REFERENCE_CAPTURE = (
    "this study's [captures.folders] names only the reference capture: add another "
    "capture of the same request (another layout) to compare it with"
)
NO_LADDER_HERE = (
    "no run of this study has checkpoints at two or more steps: give a run in [runs] a "
    "folder or a glob of checkpoints, one per step (each records its step, or has it as the "
    "last number of its name), or point STUDY at a study that has one"
)
NO_CHECKPOINT_HERE = (
    "this study names no checkpoint: add [runs] (label = a checkpoint file) or "
    "[anatomy] files = [...] to its study.toml"
)
FEWER_THAN_TWO_RUNS_HERE = (
    "this study has fewer than two runs: add runs to [runs] in its study.toml "
    '(label = "path/to/checkpoint"), or point STUDY at a study that has them'
)
NO_FACTOR_GROUPS_HERE = (
    "this study declares no factor groups: add [[factor_groups]] to its study.toml "
    '(kind = "svd" with u, s, v name patterns such as "{prefix}.u", or "lowrank" with a, b)'
)


def no_factor_tensors(patterns: Sequence[str], runs: Sequence[str]) -> str:
    """Why the column notebook has nothing to compare (plain text, for ``skip``)."""
    return (
        f"no tensor of the runs ({', '.join(runs)}) matches the factor groups' patterns "
        f"({', '.join(patterns) or 'none'}): nothing was compared; check the name patterns in "
        "[[factor_groups]] against the checkpoint's names (dmlib inspect lists them)"
    )


# -- LoRA adapters and gradients (notebooks/adapters.ipynb) -------------------------------

NO_ADAPTERS_HERE = (
    "this study has no LoRA adapter runs and no gradients: give a run in [runs] a folder of "
    "PEFT adapter folders (save_pretrained, one per step), and per-step gradient files in "
    "[adapters.gradients] (docs/adapters.md), or point STUDY at a study that has them"
)
NO_ADAPTER_LADDER = (
    "no run's checkpoints are LoRA adapters at a step: the growth of the weight each target "
    "adds cannot be drawn"
)
NO_GRADIENTS = (
    "the study gives no per-step gradients ([adapters.gradients] with two or more runs): "
    "the global gradient L2 cannot be drawn"
)


def adapter_growth(
    run: str, n_targets: int, first: int, last: int, worst: str, start: float, end: float
) -> str:
    """How the weight the targets add changed between two steps, the fastest-growing named."""
    return (
        f"In run {_c(run)}, from step {first} to step {last}, the target whose added weight "
        f"grew most of the {n_targets} is {_c(worst)}: ‖scaling · B A‖_F went from "
        f"{fmt(start)} to {fmt(end)}."
    )


def gradient_l2_finding(
    group: str, last: int, reference: str, pairs: Mapping[str, float], control: Mapping[str, float]
) -> str:
    """The global gradient L2 of every run against the reference at the last step, the
    control's last (0 said as bit-identical)."""

    def one(run: str, v: float) -> str:
        return f"{_c(run)} {fmt(v)}" + (" (bit-identical)" if v == 0 else "")

    text = f"At step {last}, the global relative L2 of the {_c(group)} gradients against {_c(reference)}"
    if pairs:
        text += ": " + ", ".join(one(k, v) for k, v in pairs.items())
    if control:
        text += f"{';' if pairs else ':'} the control " + ", ".join(
            one(k, v) for k, v in control.items()
        )
    return text + "."
