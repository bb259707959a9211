"""Structure-aware forensics on the command line.

``dmlib factors`` (effective weights of factorised layers), ``dmlib firstcol`` (first
divergent column and sign flips over all run pairs), ``dmlib ladder`` (divergence per
training step, with checkpoint step integrity) and ``dmlib gapcheck`` (padding bytes
across runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dmlib.cli import add_common_epilog
from dmlib.cli._dask import add_dask
from dmlib.cli._dask import engine as engine_of
from dmlib.cli._table import add_format, add_selection, fmt, labelled_paths, table
from dmlib.errors import DmlibError


def register(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser(
        "factors",
        help="compare factorised layers by their effective weights",
        description="Compare the layers two checkpoints store as factors by the weight they "
        "compute (U diag(s) V^T or A B, in float64): rel_fro, max_abs and n_diff of the "
        "effective weight, and how many elements of the factors themselves differ. "
        "Exit 1 when any effective weight differs or a layer is in one checkpoint only.",
    )
    f.add_argument("a", help="reference checkpoint")
    f.add_argument("b", help="checkpoint compared against it")
    _group_arg(f, required=True)
    f.add_argument("--json", action="store_true", help="print one JSON document")
    add_format(f)
    add_dask(f)
    add_common_epilog(f)
    f.set_defaults(func=run_factors)

    c = sub.add_parser(
        "firstcol",
        help="first divergent column and sign flips over every pair of runs",
        description="For every tensor every pair of runs shares: the first column whose bits "
        "differ (for a Householder QR's Q, the iteration at which the runs first disagreed), "
        "and how many columns are flipped (cosine below --threshold) against sign-preserving "
        "scatter. Exit 1 when any tensor pair differs.",
    )
    c.add_argument("runs", nargs="+", metavar="LABEL=PATH", help="at least two runs")
    add_selection(c)
    c.add_argument("--axis", type=int, default=1, help="axis of the columns (default 1)")
    c.add_argument(
        "--threshold", type=float, default=-0.9, help="cosine below which a column is flipped"
    )
    c.add_argument("--json", action="store_true", help="print one JSON document")
    add_format(c)
    add_common_epilog(c)
    c.set_defaults(func=run_firstcol)

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
        "checkpoint-N/ folders as the steps) or an Orbax CheckpointManager folder (its step "
        "folders)",
    )
    lad.add_argument("--reference", metavar="LABEL", help="compare every run against this one")
    from dmlib.cli.map_cmd import add_run_maps

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
    _group_arg(lad, required=False)
    lad.add_argument("--json", action="store_true", help="print one JSON document")
    add_format(lad)
    add_dask(lad)
    add_common_epilog(lad)
    lad.set_defaults(func=run_ladder)

    g = sub.add_parser(
        "gapcheck",
        help="padding bytes across runs: dirty slots, NaN/huge values, run-to-run differences",
        description="Read the padding of several runs of one model (same layout) as float32 "
        "slots: where the dirty slots are, how many NaN and |v|>=1e30 per run, whether the "
        "padding differs run to run, and whether any such slot lies inside a named tensor. "
        "Exit 1 when any padding slot is dirty or differs between runs.",
    )
    g.add_argument("paths", nargs="+", metavar="[LABEL=]PATH", help="checkpoints of the same model")
    g.add_argument(
        "--limit", type=int, default=40, help="slots listed (default 40; --json lists all)"
    )
    g.add_argument("--json", action="store_true", help="print one JSON document")
    add_format(g)
    add_dask(g)
    add_common_epilog(g)
    g.set_defaults(func=run_gapcheck)


# ---------------------------------------------------------------------------
# argument helpers


def _group_arg(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument(
        "--group",
        action="append",
        required=required,
        metavar="KIND:PATTERNS",
        help="svd:U,S,V or lowrank:A,B; each pattern holds {prefix}; a trailing ^T marks a "
        "stored transpose (e.g. svd:{prefix}.u,{prefix}.s,{prefix}.vt^T); repeatable",
    )


def parse_group(text: str):
    """A FactorGroup from ``svd:U,S,V`` or ``lowrank:A,B`` (``^T`` suffix: transposed)."""
    from dmlib.forensics.factors import FactorGroup

    kind, sep, rest = text.partition(":")
    pats = [p.strip() for p in rest.split(",")] if sep else []
    want = {"svd": 3, "lowrank": 2}.get(kind)
    if want is None or len(pats) != want or not all(pats):
        raise DmlibError(f"expected --group svd:U,S,V or lowrank:A,B, got {text!r}")
    trans = [p.endswith("^T") for p in pats]
    pats = [p[:-2] if t else p for p, t in zip(pats, trans, strict=True)]
    if kind == "svd":
        if trans[1]:
            raise DmlibError(
                f"the singular values of {text!r} are a vector; ^T applies to U and V only"
            )
        return FactorGroup.svd(*pats, transpose_u=trans[0], transpose_v=trans[2])
    return FactorGroup.lowrank(*pats, transpose_a=trans[0], transpose_b=trans[1])


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
        if not sep or not colon or not label or not path or not step.lstrip("-").isdigit():
            raise DmlibError(f"expected LABEL:STEP=PATH (e.g. s5a:5=runs/s5a/m.bpk), got {item!r}")
        steps = ladder.setdefault(label, {})
        if int(step) in steps:
            raise DmlibError(f"run {label!r} has step {step} twice")
        steps[int(step)] = path
    return ladder


def _dump(doc: dict[str, Any]) -> None:
    from dmlib._json import jsonable

    print(json.dumps(jsonable(doc, default=str), indent=1))


# ---------------------------------------------------------------------------
# subcommands


def run_factors(args: argparse.Namespace) -> int:
    from dmlib.forensics.factors import compare_factors

    groups = [parse_group(g) for g in args.group]
    with engine_of(args) as engine:
        df = compare_factors(args.a, args.b, groups, engine=engine)
    differs = bool(((df["status"] != "ok") | (df["n_diff"].fillna(0) > 0)).any())
    if args.json:
        _dump(
            {
                "rows": df,
                "worst_group": df.attrs["worst_group"],
                "worst_rel_fro": df.attrs["worst_rel_fro"],
            }
        )
        return int(differs)
    cols = [
        "group",
        "kind",
        "shape",
        "norm",
        "rel_fro",
        "max_abs",
        "n_diff",
        "factor_n_diff",
        "status",
    ]
    print(table(df, cols))
    print(
        f"{'DIFFERENT' if differs else 'IDENTICAL'}: {len(df)} layers; worst rel_fro "
        f"{fmt(df.attrs['worst_rel_fro'])} ({df.attrs['worst_group']})"
    )
    return int(differs)


def run_firstcol(args: argparse.Namespace) -> int:
    from dmlib.forensics.columns import first_divergent_columns, sign_flip_table

    runs = labelled_paths(args.runs)
    fc = first_divergent_columns(runs, include=args.include, exclude=args.exclude, axis=args.axis)
    flips = sign_flip_table(
        runs, include=args.include, exclude=args.exclude, axis=args.axis, threshold=args.threshold
    )
    df = fc.merge(flips.drop(columns=["a", "b", "n_cols"]), on=["pair", "name"], how="left")
    summary = dict(fc.attrs["summary"])
    summary["n_flipped"] = int(df["n_flipped"].sum()) if len(df) else 0
    code = 0 if bool(df["identical"].all()) else 1
    if args.json:
        _dump({"rows": df, "summary": summary})
        return code
    cols = [
        "pair",
        "name",
        "first_col",
        "n_cols",
        "identical",
        "n_changed",
        "n_flipped",
        "min_cosine",
    ]
    print(table(df, cols))
    print(
        f"{summary['n_pairs']} tensor pairs, {summary['n_identical']} identical; first divergent "
        f"column min {fmt(summary['first_col_min'])} median {fmt(summary['first_col_median'])} "
        f"max {fmt(summary['first_col_max'])}; {summary['n_flipped']} flipped columns"
    )
    return code


def run_ladder(args: argparse.Namespace) -> int:
    from dmlib.cli.map_cmd import mapped_notes, run_maps
    from dmlib.forensics.ladder import growth_rates, ladder_summary, step_ladder

    ladder = parse_ladder(args.ckpts)
    groups = [parse_group(g) for g in args.group] if args.group else None
    with engine_of(args) as engine:
        df = step_ladder(
            ladder,
            reference=args.reference,
            include=args.include,
            exclude=args.exclude,
            groups=groups,
            step_key=args.step_key,
            keep_flagged=args.keep_flagged,
            engine=engine,
            mapping=run_maps(args.map),
        )
    import pandas as pd

    growth = growth_rates(df)
    checks = pd.DataFrame(df.attrs["checks"])
    if not args.allow_missing:
        bad = checks[checks["status"].isin(["missing", "unreadable"])]
        if len(bad):
            first = bad.iloc[0]
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise DmlibError(
                f"run {first['run']} step {first['step']}: {first['detail']}{more}; "
                "pass --allow-missing to report such checkpoints instead"
            )
    flagged = bool(checks["flagged"].any())
    code = 1 if flagged or bool((df["n_diff"] > 0).any()) else 0
    summary = ladder_summary(df, top=args.top)
    if args.json:
        _dump(
            {
                "checks": checks,
                "pairs": summary,
                "rows": df,
                "growth": growth,
                "excluded": df.attrs["excluded"],
                "mapped": df.attrs.get("mapped", {}),
            }
        )
        return code
    for line in mapped_notes(df.attrs.get("mapped", {})):
        print(line)
    for e in df.attrs["excluded"]:
        print(f"excluded: run {e['run']} step {e['step']}: {e['detail']}", file=sys.stderr)
    if args.details:
        print(table(checks, ["run", "step", "recorded_step", "status", "detail", "path"]))
    else:
        counts = checks["status"].value_counts()
        print(
            f"checkpoints: {len(checks)}; "
            + ", ".join(f"{n} {s}" for s, n in counts.items())
            + " (recorded step against claimed)"
        )
        for c in checks[checks["status"] != "ok"].itertuples(index=False):
            print(
                f"  {c.status}: run {c.run} step {c.step}: {c.detail.removeprefix(c.status + ': ')}"
            )
    for r in summary.itertuples(index=False):
        print(_pair_line(r))
    if args.details and len(df):
        moved = df[(df["rank"] <= args.top) & (df["n_diff"] > 0)].sort_values(
            ["step", "pair", "rank"]
        )
        cols = [
            "step",
            "pair",
            "rank",
            "name",
            "kind",
            "numel",
            "norm",
            "rel_fro",
            "max_abs",
            "n_diff",
        ]
        print()
        print(table(moved, cols) if len(moved) else "no tensor differs at any step")
        print()
        print(table(growth.sort_values("slope", ascending=False), list(growth.columns)))
    return code


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


def run_gapcheck(args: argparse.Namespace) -> int:
    from dmlib.padding import padding_across_runs, padding_summary

    runs = labelled_paths(args.paths, optional=True)
    with engine_of(args) as engine:
        df = padding_across_runs(runs, engine=engine)
    summary = padding_summary(df)
    code = 1 if len(df) else 0
    if args.json:
        _dump(
            {
                "runs": summary,
                "slots": df,
                "differs": df.attrs["differs"],
                "inside_tensor": df.attrs["inside_tensor"],
                "same_layout": df.attrs["same_layout"],
            }
        )
        return code
    print(table(summary, list(summary.columns)))
    if len(df):
        print()
        cols = [
            "run",
            "record",
            "kind",
            "offset",
            "value",
            "nan",
            "huge",
            "dirty",
            "differs",
            "inside_tensor",
        ]
        print(table(df.head(args.limit), cols))
        if len(df) > args.limit:
            print(f"... {len(df) - args.limit} more slots (--limit N, or --json for all)")
    if not df.attrs["same_layout"]:
        print("note: the runs do not share one tensor layout; only common padding is compared")
    print(
        f"padding {'differs' if df.attrs['differs'] else 'is the same'} across runs; "
        f"{len(df)} dirty or differing slots; {df.attrs['inside_tensor']} inside a named tensor"
    )
    return code
