"""``dmlib gapcheck``: the padding bytes of several runs (dirty slots, NaN and huge values,
run-to-run differences)."""

from __future__ import annotations

import argparse

from dmlib.cli._common import ONE_DOCUMENT, add_common, exit_code, print_json
from dmlib.cli._dask import engine as engine_of
from dmlib.cli._table import labelled_paths, table


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``gapcheck``."""
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
    add_common(g, json=ONE_DOCUMENT, format=True, dask=True)
    g.set_defaults(func=run_gapcheck)


def run_gapcheck(args: argparse.Namespace) -> int:
    """``dmlib gapcheck``: the runs' padding census and the dirty or differing slots."""
    from dmlib.padding import padding_across_runs, padding_summary

    runs = labelled_paths(args.paths, optional=True)
    with engine_of(args) as engine:
        df = padding_across_runs(runs, engine=engine)
    summary = padding_summary(df)
    code = exit_code(differs=len(df) > 0)
    if args.json:
        print_json(
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
