"""``dmlib localize A B``: where do two captures of one model first diverge?"""

from __future__ import annotations

import argparse
import json
from typing import Any

from dmlib._json import jsonable
from dmlib.cli import EXIT_CODES, add_common_epilog
from dmlib.cli._table import fmt, table

EXIT_INCONCLUSIVE = 3
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
]


def register(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--json", action="store_true", help="print one JSON document (rows and attrs)")
    add_common_epilog(p)
    p.epilog = EXIT_CODES + INCONCLUSIVE_CODE
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
    from dmlib.localize.boundaries import CaptureVerdict, compare_captures

    repeat = tuple(args.repeat) if args.repeat else None
    df = compare_captures(
        args.a, args.b, request=args.request, repeat=repeat, negative=args.negative
    )
    v = CaptureVerdict.of(df)
    if args.json:
        doc = {"rows": jsonable(df, default=str), "attrs": jsonable(dict(df.attrs), default=str)}
        print(json.dumps(doc, indent=1))
    else:
        shown = df if args.all else df[~df["role"].isin(["clean", "layout"])]
        if args.limit and len(shown) > args.limit:
            print(f"(first {args.limit} of {len(shown)} rows; --limit 0 for all)")
            shown = shown.head(args.limit)
        if len(shown):
            print(table(shown, _TABLE, cell=_fmt))
        print(v)
    if v:
        return 0
    return EXIT_INCONCLUSIVE if v.status == "inconclusive" and not v.failed_control else 1
