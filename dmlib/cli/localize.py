"""Commands over capture directories and repeated outputs, all over files already made.

``dmlib localize A B`` (where do two captures of one model first diverge?), ``dmlib
arbitrate`` (which run of a culprit op is nearer float64) and ``dmlib repeats`` (how often
repeats differ, with Wilson 95% intervals).

The patch test needs the live model and has no command: call :func:`dmlib.patch_test`.
"""

from __future__ import annotations

import argparse
from typing import Any

from dmlib.cli._common import (
    EXIT_CODES,
    EXIT_INCONCLUSIVE,
    ONE_DOCUMENT,
    add_common,
    exit_code,
    print_json,
)
from dmlib.cli._table import fmt, table
from dmlib.errors import DmlibError

INCONCLUSIVE_CODE = (
    f"\n  {EXIT_INCONCLUSIVE}  inconclusive: no judged boundary differs, but some boundary could "
    "not be judged\n     (its rows cannot be attributed to the request) and the model's outputs "
    "were not\n     shown to match"
)

# columns of the readable table (the JSON output carries every column)
_TABLE = [
    "boundary",
    "role",
    "identical",
    "n_diff",
    "n_diff_rows",
    "max_abs",
    "rel_fro",
    "max_ulp",
    "diff_blocks",
    "new_blocks",
    "diff_positions",
]


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``localize``, ``arbitrate`` and ``repeats``."""
    _add_localize(sub)
    _add_arbitrate(sub)
    _add_repeats(sub)


def _add_localize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "localize",
        help="find the first boundary where two captures diverge",
        description="Compare two capture directories (written by dmlib.capture) boundary by "
        "boundary in execution order, per logical request: which boundaries differ, in which "
        "blocks of positions, and the culprit (inputs identical, output differs). With --repeat "
        "the verdict is valid only if the repeat captures are byte-identical; a planted one-bit "
        "change is checked wherever a boundary was dumped (negative control; without dumps "
        "it is not run, and the verdict says why). Layout inputs (attention masks, position "
        "ids, cache positions, cu_seqlens) follow the batch layout and are never judged. Prints boundaries that are not clean "
        "(--all: every boundary) and the verdict. A boundary is judged per request: rows per "
        "position through the row map, rows per sequence (first axis = batch) through the "
        "batch row the request fills alone, else the whole tensor when both captures have its "
        "shape. Whenever a boundary cannot be judged, nothing else differs, and the model's "
        "own outputs were not captured and shown to match, the answer is inconclusive "
        "(exit 3), with one line naming what could not be judged and why.",
    )
    p.add_argument("a", help="reference capture directory")
    p.add_argument("b", help="capture compared against it")
    p.add_argument(
        "--request", metavar="ID", help="request id to compare (default: every common request)"
    )
    p.add_argument(
        "--repeat",
        nargs="+",
        metavar="DIR",
        help="repeat capture of A's layout (then, optionally, of B's)",
    )
    p.add_argument(
        "--negative",
        metavar="DIR",
        help="capture of a different input, which must be found different",
    )
    p.add_argument("--all", action="store_true", help="list clean boundaries too")
    p.add_argument(
        "--limit",
        type=int,
        default=40,
        help="at most this many table rows (default 40; 0: no limit)",
    )
    add_common(
        p, json="print one JSON document (rows and attrs)", epilog=EXIT_CODES + INCONCLUSIVE_CODE
    )
    p.set_defaults(func=run_localize)


def _fmt(v: Any) -> str:
    return _ranges(v) if isinstance(v, list) else fmt(v)


def _ranges(blocks: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5': block lists stay one short cell."""
    if not blocks:
        return "-"
    out, start, prev = [], blocks[0], blocks[0]
    for b in [*blocks[1:], None]:
        if b is not None and b == prev + 1:
            prev = b
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if b is not None:
            start = prev = b
    return ",".join(out)


def run_localize(args: argparse.Namespace) -> int:
    """``dmlib localize A B``: boundaries that differ, the culprit, the controls."""
    from dmlib.localize.boundaries import CaptureVerdict, compare_captures

    repeat = tuple(args.repeat) if args.repeat else None
    df = compare_captures(
        args.a, args.b, request=args.request, repeat=repeat, negative=args.negative
    )
    v = CaptureVerdict.of(df)
    if args.json:
        print_json({"rows": df, "attrs": dict(df.attrs)})
    else:
        shown = df if args.all else df[~df["role"].isin(["clean", "layout"])]
        if args.limit and len(shown) > args.limit:
            print(f"(first {args.limit} of {len(shown)} rows; --limit 0 for all)")
            shown = shown.head(args.limit)
        if len(shown):
            print(table(shown, _TABLE, cell=_fmt))
        print(v)
    return exit_code(v)


def _add_arbitrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "arbitrate",
        help="measure both runs of a captured op against its float64 replay",
        description="Replay one op of two captures made with ops=True in float64 from each "
        "run's own dumped inputs and report each run's distance to it (ULP of the output "
        "dtype, relative error). Default op: the culprit op of `dmlib localize`. Exit 0 when "
        "both runs are close to float64, 1 when one departs or no verdict could be reached.",
    )
    p.add_argument("a", help="capture directory (ops=True, op tensors dumped whole)")
    p.add_argument("b", help="capture compared against it")
    p.add_argument("--op", metavar="ID", help="op id in A, e.g. 'enc.layer.0/aten.addmm#0'")
    p.add_argument("--request", metavar="ID", help="measure only this request's rows")
    p.add_argument("--factor", type=float, default=10.0,
                   help="a run departs when its relative error is this many times the other's")  # fmt: skip
    p.add_argument("--backend", choices=("auto", "torch", "numpy"), default="auto",
                   help="where the float64 replay runs (auto: torch if installed, else numpy)")  # fmt: skip
    add_common(p, json=ONE_DOCUMENT)
    p.set_defaults(func=run_arbitrate)


def _add_repeats(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser(
        "repeats",
        help="fraction of repeats that differ, with a Wilson 95%% interval",
        description="Each ARM=FILE,FILE,... lists outputs of one arm (checkpoint files or "
        "capture directories); the first is the arm's reference, the rest its repeats. "
        "Prints per arm the repeats that differ bit for bit from the reference, the "
        "fraction with a Wilson 95%% interval and the distinct outputs. --observer lists "
        "outputs made with a capture on; while they differ from the (first) arm's reference "
        "no verdict is given. Exit 0 when no repeat differs, 1 otherwise or when withheld.",
    )
    r.add_argument("arms", nargs="+", metavar="ARM=PATH,PATH,...")
    r.add_argument("--observer", metavar="PATH,PATH,...", help="outputs made with capture on")
    r.add_argument("--observer-arm", metavar="ARM", help="arm the observer runs repeat")
    add_common(r, json=ONE_DOCUMENT, format=True)
    r.set_defaults(func=run_repeats)


def run_arbitrate(args: argparse.Namespace) -> int:
    """``dmlib arbitrate A B``: each run of an op against its float64 replay."""
    from dmlib.localize.arbitrate import COLUMNS, arbitrate

    res = arbitrate(
        args.a, args.b, args.op, request=args.request, factor=args.factor, backend=args.backend
    )
    if args.json:
        doc = {"op": res.op, "verdict": res.verdict, "reason": res.reason, "rows": res.table}
        print_json(doc, default=None)
    else:
        if len(res.table):
            print(table(res.table, COLUMNS, cell=fmt))
        print(res)
    return exit_code(res)


def _arm(text: str) -> tuple[str, list[str]]:
    name, sep, paths = text.partition("=")
    files = [p for p in paths.split(",") if p]
    if not sep or not name or not files:
        raise DmlibError(f"arm {text!r}: expected NAME=PATH,PATH,...")
    return name, files


def run_repeats(args: argparse.Namespace) -> int:
    """``dmlib repeats ARM=PATH,...``: the fraction of repeats that differ."""
    from dmlib.localize.rates import COLUMNS, repeat_rates

    arms = dict(_arm(a) for a in args.arms)
    observer = None if args.observer is None else [p for p in args.observer.split(",") if p]
    res = repeat_rates(arms, observer=observer, observer_arm=args.observer_arm)
    if args.json:
        doc = {"verdict": res.verdict, "reason": res.reason, "observer": res.observer,
               "rows": res.table}  # fmt: skip
        print_json(doc, default=None)
    else:
        print(table(res.table, COLUMNS, cell=fmt))
        print(res)
    return exit_code(res)
