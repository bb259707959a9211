"""``dmlib arbitrate`` (which run of a culprit op is nearer float64) and ``dmlib repeats``
(how often repeats differ, with Wilson 95% intervals), both over files already made.

The patch test needs the live model and has no command: call :func:`dmlib.patch_test`.
"""

from __future__ import annotations

import argparse
import json

from dmlib._json import jsonable
from dmlib.cli import add_common_epilog
from dmlib.cli._table import add_format, fmt, table
from dmlib.errors import DmlibError


def register(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--json", action="store_true", help="print one JSON document")
    add_common_epilog(p)
    p.set_defaults(func=run_arbitrate)

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
    r.add_argument("--json", action="store_true", help="print one JSON document")
    add_format(r)
    add_common_epilog(r)
    r.set_defaults(func=run_repeats)


def run_arbitrate(args: argparse.Namespace) -> int:
    from dmlib.localize.arbitrate import COLUMNS, arbitrate

    res = arbitrate(
        args.a, args.b, args.op, request=args.request, factor=args.factor, backend=args.backend
    )
    if args.json:
        doc = {"op": res.op, "verdict": res.verdict, "reason": res.reason, "rows": res.table}
        print(json.dumps(jsonable(doc), indent=1))
    else:
        if len(res.table):
            print(table(res.table, COLUMNS, cell=fmt))
        print(res)
    return 0 if res.verdict == "both-close" else 1


def _arm(text: str) -> tuple[str, list[str]]:
    name, sep, paths = text.partition("=")
    files = [p for p in paths.split(",") if p]
    if not sep or not name or not files:
        raise DmlibError(f"arm {text!r}: expected NAME=PATH,PATH,...")
    return name, files


def run_repeats(args: argparse.Namespace) -> int:
    from dmlib.localize.rates import COLUMNS, repeat_rates

    arms = dict(_arm(a) for a in args.arms)
    observer = None if args.observer is None else [p for p in args.observer.split(",") if p]
    res = repeat_rates(arms, observer=observer, observer_arm=args.observer_arm)
    if args.json:
        doc = {"verdict": res.verdict, "reason": res.reason, "observer": res.observer,
               "rows": res.table}  # fmt: skip
        print(json.dumps(jsonable(doc), indent=1))
    else:
        print(table(res.table, COLUMNS, cell=fmt))
        print(res)
    return 0 if res.verdict == "deterministic" else 1
