"""``dmlib ladder``: divergence between runs at every training step, each checkpoint's
recorded step checked against the claimed one first."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from dmlib.cli._common import ONE_DOCUMENT, add_common, exit_code, print_json
from dmlib.cli._dask import engine as engine_of
from dmlib.cli._groups import add_group_l2
from dmlib.cli._table import add_selection, fmt, table
from dmlib.cli.compare import add_run_rename
from dmlib.cli.map import add_run_maps, located_lines, mapped_notes, run_maps
from dmlib.cli.structure import add_group, parse_group
from dmlib.errors import DmlibError
from dmlib.numfmt import prose, short
from dmlib.textsafe import shown


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``ladder``."""
    lad = sub.add_parser(
        "ladder",
        help="divergence between runs at every training step, with step integrity checks",
        description="Compare same-seed runs checkpoint by checkpoint along a step ladder. Every "
        "checkpoint's recorded step is checked against the claimed one first; artifacts "
        "(e.g. a step-0 save claimed as step 50), missing and unreadable files are reported "
        "and left out. Prints one line per pair of runs: the first step at which it diverges "
        "(or 'bit-identical at every step'), the fastest movers at the last step and the growth "
        "of rel_fro per step (slope of log10 rel_fro of all tensors together); --details for "
        "the per-step and per-tensor tables. Exit 1 when any tensor differs or any checkpoint "
        "is flagged.",
    )
    lad.add_argument(
        "ckpts",
        nargs="+",
        metavar="LABEL:STEP=PATH",
        help="one checkpoint of one run, or LABEL=FOLDER: a Trainer output folder (its "
        "checkpoint-N/ folders as the steps), an Orbax CheckpointManager folder (its step "
        "folders) or a folder of checkpoints (each one's step: the step it records, else "
        "trainer_state.json beside it, else the last number of its name), as study.toml's "
        "[runs] takes them",
    )
    lad.add_argument("--reference", metavar="LABEL", help="compare every run against this one")
    add_run_rename(lad)
    add_run_maps(lad)
    lad.add_argument(
        "--step-key",
        default="auto",
        help="where a checkpoint records its step: auto, scalars:KEY, metadata:KEY, "
        "name:REGEX or path:REGEX (group 1 captures the step)",
    )
    lad.add_argument("--keep-flagged", action="store_true", help="compare flagged checkpoints too")
    lad.add_argument(
        "--allow-missing",
        action="store_true",
        help="report missing or unreadable checkpoints as flagged rows (exit 1) instead of "
        "refusing the ladder (exit 2)",
    )
    lad.add_argument("--top", type=int, default=3, help="fastest movers named per pair (default 3)")
    lad.add_argument(
        "--details",
        action="store_true",
        help="also print the step check of every checkpoint, the fastest movers of every step "
        "and the growth rate of every tensor",
    )
    add_selection(lad)
    add_group(lad, required=False)
    add_group_l2(lad, names="the names as compared (after --rename, --map; whatever --include "
                 "and --exclude); per step and pair, with its growth from step to step")  # fmt: skip
    add_common(lad, json=ONE_DOCUMENT, format=True, dask=True)
    lad.set_defaults(func=run_ladder)


def _manager_steps(path: str) -> dict[int, str]:
    """An Orbax CheckpointManager folder's step folders (empty for anything else)."""
    import os

    if not os.path.isdir(path):
        return {}
    from dmlib.io.orbax import step_folders

    return step_folders(path)


def _run_folder(*, label: str, path: str, ladder: dict[str, dict[int, str]]) -> bool:
    """``LABEL=FOLDER`` of a Trainer output folder: its ``checkpoint-N/`` folders as the
    steps (N; each checkpoint's recorded ``global_step`` is checked against it). False
    for a folder that holds no training checkpoint."""
    import os

    if not os.path.isdir(path):
        return False
    from dmlib.io.hf_trainer import checkpoints_of

    found = checkpoints_of(path)
    if not found:
        return False
    if label in ladder:
        raise DmlibError(f"run {label!r} is given twice")
    ladder[label] = dict(found)
    return True


def parse_ladder(items: list[str]) -> dict[str, dict[int, str]]:
    """``{label: {step: path}}`` from ``LABEL:STEP=PATH`` items, or ``LABEL=FOLDER`` for a
    Trainer output folder (its ``checkpoint-N/`` folders) or an Orbax CheckpointManager
    folder (its numbered step folders)."""
    ladder: dict[str, dict[int, str]] = {}
    for item in items:
        head, sep, path = item.partition("=")
        if sep and head and ":" not in head and _run_folder(label=head, path=path, ladder=ladder):
            continue
        label, colon, step = head.rpartition(":")
        if sep and head and not colon and _manager_steps(path):  # LABEL=ORBAX_MANAGER_FOLDER
            ladder.setdefault(head, {}).update(_manager_steps(path))
            continue
        if sep and head and not colon and os.path.isdir(path):  # a folder of checkpoints
            _folder_steps(head, path, ladder)
            continue
        if not sep or not colon or not label or not path or not step.lstrip("-").isdigit():
            raise DmlibError(f"expected LABEL:STEP=PATH (e.g. s5a:5=runs/s5a/m.bpk), got {item!r}")
        steps = ladder.setdefault(label, {})
        if int(step) in steps:
            raise DmlibError(f"run {label!r} has step {step} twice")
        steps[int(step)] = path
    return ladder


def _folder_steps(label: str, path: str, ladder: dict[str, dict[int, str]]) -> None:
    """``LABEL=FOLDER`` of checkpoint files (or folders a reader opens whole), each at its
    step as study.toml's ``[runs]`` finds it; refused, saying what was looked for, when the
    folder holds none or a checkpoint has no step."""
    from pathlib import Path

    from dmlib.report.study import resolve_runs

    if label in ladder:
        raise DmlibError(f"run {label!r} is given twice")
    run = resolve_runs({label: path}, Path.cwd(), Path(path))[label]
    if not run.steps:
        raise DmlibError(
            f"run {label!r}: {len(run.checkpoints)} checkpoint in the folder {path!r} and no "
            "step for it: a ladder needs a step per checkpoint (LABEL:STEP=PATH)"
        )
    ladder[label] = {s: str(run.checkpoints[s]) for s in run.steps}


def run_ladder(args: argparse.Namespace) -> int:
    """``dmlib ladder``: compare the ladder, refuse missing checkpoints, print or dump."""
    from dmlib.forensics.ladder import growth_rates, ladder_summary

    df = _step_ladder(args)
    import pandas as pd

    growth = growth_rates(df)
    checks = pd.DataFrame(df.attrs["checks"])
    if not args.allow_missing:
        _refuse_missing(checks)
    flagged = bool(checks["flagged"].any())
    code = exit_code(differs=flagged or bool((df["n_diff"] > 0).any()))
    summary = ladder_summary(df, top=args.top)
    if args.json:
        print_json(
            {
                "checks": checks,
                "pairs": summary,
                "rows": df,
                "growth": growth,
                "excluded": df.attrs["excluded"],
                "mapped": df.attrs.get("mapped", {}),
                "located": df.attrs.get("located", []),
                "name_warnings": df.attrs.get("name_warnings", []),
                **_group_docs(df),
            }
        )
        return code
    for line in mapped_notes(df.attrs.get("mapped", {})):
        print(line)
    for w in df.attrs.get("name_warnings", []):
        print(f"warning: step {w['step']}: {w['message']}")
    for e in df.attrs["excluded"]:
        print(f"excluded: run {e['run']} step {e['step']}: {e['detail']}", file=sys.stderr)
    _print_checks(checks, details=args.details)
    for r in summary.itertuples(index=False):
        print(_pair_line(r))
    for line in located_lines(df.attrs.get("located", [])):
        print(line)
    if "group_l2" in df.attrs:
        print(group_l2_lines(df.attrs["group_l2"], df.attrs["group_l2_growth"]))
    if args.details and len(df):
        _print_details(df, growth, top=args.top)
    return code


def _step_ladder(args: argparse.Namespace) -> Any:
    """The ladder's frame (:func:`dmlib.forensics.ladder.step_ladder`) for the arguments."""
    from dmlib.forensics.ladder import step_ladder

    ladder = parse_ladder(args.ckpts)
    groups = [parse_group(g) for g in args.group] if args.group else None
    with engine_of(args) as engine:
        return step_ladder(
            ladder,
            reference=args.reference,
            include=args.include,
            exclude=args.exclude,
            groups=groups,
            step_key=args.step_key,
            keep_flagged=args.keep_flagged,
            engine=engine,
            mapping=run_maps(args.map),
            rename=args.rename,
            group_l2=args.group_l2,
        )


def _group_docs(df: Any) -> dict[str, Any]:
    """``group_l2`` and ``group_l2_growth`` for ``--json`` (nothing without --group-l2)."""
    return {k: df.attrs[k] for k in ("group_l2", "group_l2_growth") if k in df.attrs}


def group_l2_lines(rows: list[dict[str, Any]], growth: list[dict[str, Any]]) -> str:
    """The ladder of each group's global relative L2: a line per pair and step, a column
    per group (its rel_l2, and its growth over the pair's previous step), then a line per
    pair and group from its first step to its last."""
    labels = list(dict.fromkeys(r["group"] for r in rows))
    heads = {g: shown(g) for g in labels}
    by_step: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        line = by_step.setdefault((r["pair"], r["step"]), {"pair": r["pair"], "step": r["step"]})
        line[heads[r["group"]]] = r["rel_l2"]
        line[heads[r["group"]] + " growth"] = r["growth"]
    cols = ["pair", "step"] + [c for g in labels for c in (heads[g], heads[g] + " growth")]
    out = [
        "global relative L2 ||a - b|| / ||a|| over each group's tensors together (float64), "
        "growth: its ratio to the pair's previous step",
        table([by_step[k] for k in sorted(by_step)], cols, key=2),
    ]
    for g in growth:
        slope = (
            f"{'+' if g['slope'] > 0 else ''}{prose(g['slope'])} decades per step over "
            f"{g['n_steps']} steps"
            if g["slope"] == g["slope"]
            else f"no rate (rel_l2 > 0 at {g['n_steps']} step{'s' if g['n_steps'] != 1 else ''})"
        )
        out.append(
            f"{shown(g['pair'])} {heads[g['group']]}: rel_l2 {short(g['rel_l2_first'])} at step "
            f"{g['step_first']}, {short(g['rel_l2_last'])} at step {g['step_last']} "
            f"(x{short(g['factor'])}); growth {slope}"
        )
    return "\n".join(out)


def _refuse_missing(checks: Any) -> None:
    """Bad input (exit 2) when a checkpoint is missing or unreadable (no --allow-missing)."""
    bad = checks[checks["status"].isin(["missing", "unreadable"])]
    if len(bad):
        first = bad.iloc[0]
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise DmlibError(
            f"run {first['run']} step {first['step']}: {first['detail']}{more}; "
            "pass --allow-missing to report such checkpoints instead"
        )


def _print_checks(checks: Any, *, details: bool) -> None:
    """The step check of every checkpoint (``details``), else the counts and the flagged."""
    if details:
        print(table(checks, ["run", "step", "recorded_step", "status", "detail", "path"], key=2))
        return
    counts = checks["status"].value_counts()
    print(
        f"checkpoints: {len(checks)}; "
        + ", ".join(f"{n} {s}" for s, n in counts.items())
        + " (recorded step against claimed)"
    )
    for c in checks[checks["status"] != "ok"].itertuples(index=False):
        print(f"  {c.status}: run {c.run} step {c.step}: {c.detail.removeprefix(c.status + ': ')}")


def _print_details(df: Any, growth: Any, *, top: int) -> None:
    """The fastest movers of every step and the growth rate of every tensor."""
    moved = df[(df["rank"] <= top) & (df["n_diff"] > 0)].sort_values(["step", "pair", "rank"])
    cols = ["step", "pair", "rank", "name", "kind", "numel", "norm", "rel_fro", "max_abs", "n_diff"]
    print()
    print(table(moved, cols, key=4) if len(moved) else "no tensor differs at any step")
    print()
    print(table(growth.sort_values("slope", ascending=False), list(growth.columns)))


def _pair_line(r: Any) -> str:
    """One line for one pair of a ladder."""
    steps = ", ".join(map(str, r.steps))
    if r.identical:
        return f"{r.pair}: bit-identical at every step ({steps})"
    before = [s for s in r.steps if s < r.first_diff_step]
    text = f"{r.pair}: first diverges at step {r.first_diff_step}"
    text += (
        f" (bit-identical at {', '.join(map(str, before))})"
        if before
        else " (the first step compared)"
    )
    movers = ", ".join(f"{n} {fmt(v)}" for n, v in r.movers)
    text += f"; fastest movers at step {r.last_step} (rel_fro): {movers or '-'}"
    slope = (
        f"{r.slope:+.3g} decades of rel_fro per step over {r.n_steps_fit} steps"
        if r.slope == r.slope
        else f"no rate (rel_fro > 0 at {r.n_steps_fit} step{'s' if r.n_steps_fit != 1 else ''})"
    )
    return f"{text}; growth {slope}"
