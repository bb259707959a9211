"""``dmlib factors`` (effective weights of factorised layers) and ``dmlib firstcol`` (first
divergent column and sign flips over all run pairs): statistics that need the structure
that produced the tensors."""

from __future__ import annotations

import argparse

from dmlib.cli._common import ONE_DOCUMENT, add_common, exit_code, print_json
from dmlib.cli._dask import engine as engine_of
from dmlib.cli._table import add_selection, fmt, labelled_paths, table
from dmlib.errors import DmlibError


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``factors`` and ``firstcol``."""
    _add_factors(sub)
    _add_firstcol(sub)


def _add_factors(sub: argparse._SubParsersAction) -> None:
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
    add_group(f, required=True)
    add_common(f, json=ONE_DOCUMENT, format=True, dask=True)
    f.set_defaults(func=run_factors)


def _add_firstcol(sub: argparse._SubParsersAction) -> None:
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
    add_common(c, json=ONE_DOCUMENT, format=True)
    c.set_defaults(func=run_firstcol)


def add_group(p: argparse.ArgumentParser, *, required: bool) -> None:
    """``--group KIND:PATTERNS`` (repeatable): the factorised layers to compare."""
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


def run_factors(args: argparse.Namespace) -> int:
    """``dmlib factors A B --group ...``: factorised layers by effective weight."""
    from dmlib.forensics.factors import compare_factors

    groups = [parse_group(g) for g in args.group]
    with engine_of(args) as engine:
        df = compare_factors(args.a, args.b, groups, engine=engine)
    differs = bool(((df["status"] != "ok") | (df["n_diff"].fillna(0) > 0)).any())
    code = exit_code(differs=differs)
    if args.json:
        print_json(
            {
                "rows": df,
                "worst_group": df.attrs["worst_group"],
                "worst_rel_fro": df.attrs["worst_rel_fro"],
            }
        )
        return code
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
    return code


def run_firstcol(args: argparse.Namespace) -> int:
    """``dmlib firstcol LABEL=PATH ...``: first divergent column and sign flips."""
    from dmlib.forensics.columns import first_divergent_columns, sign_flip_table

    runs = labelled_paths(args.runs)
    fc = first_divergent_columns(runs, include=args.include, exclude=args.exclude, axis=args.axis)
    flips = sign_flip_table(
        runs, include=args.include, exclude=args.exclude, axis=args.axis, threshold=args.threshold
    )
    df = fc.merge(flips.drop(columns=["a", "b", "n_cols"]), on=["pair", "name"], how="left")
    summary = dict(fc.attrs["summary"])
    summary["n_flipped"] = int(df["n_flipped"].sum()) if len(df) else 0
    code = exit_code(differs=not bool(df["identical"].all()))
    if args.json:
        print_json({"rows": df, "summary": summary})
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
