"""``dmlib logprobs`` and ``dmlib logprob-ladder``: the log-probs two runs give the same
tokens (a sampler's and a trainer's), behind an identity gate, in the figures RL
post-training reads; and the same along training steps against an lr=0 control."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any

from dmlib.cli._common import (
    EXIT_CODES,
    EXIT_NOT_COMPARABLE,
    ONE_DOCUMENT,
    add_common,
    exit_code,
    print_json,
)
from dmlib.cli._table import fmt, table
from dmlib.errors import DmlibError

# the shared exit-status text with the inconclusive case these commands have
EPILOG = EXIT_CODES.replace(
    "  4  internal", "  3  inconclusive: no token counted, nothing was compared\n  4  internal"
)

_GATE = (
    "Before any number, the identity gate: the sequences, the counted tokens of each, the "
    "token ids, positions and masks, and the weights' hash and sampling settings in the "
    "files' metadata are checked where both sides give them; a mismatch is 'not comparable' "
    "(exit 5), never a numerical difference."
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``logprobs`` and ``logprob-ladder``."""
    _add_logprobs(sub)
    _add_ladder(sub)


def _add_logprobs(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "logprobs",
        help="the log-probs two runs give the same tokens: mismatch figures RL users read",
        description="Compare per-token log-probs of the same tokens from two runs (the "
        "sampler as A, the trainer as B: the KL estimators then estimate KL(A || B) from A's "
        "samples). Inputs: safetensors, npz, torch or any format dmlib reads (a padded "
        "'logprobs' [S, T] with 'mask' or 'lengths', or one 'logprobs.N' per sequence), or "
        "JSONL (one sequence per line); see docs/logprobs.md. " + _GATE + " Prints the "
        "overall figures (mean and max |dlogprob|, k1/k2/k3, chi2, |dp|, Pearson r, share "
        "over ln 2, max ULP; whole-distribution KL and top-k overlap where logits or top-k "
        "log-probs are given), the worst positions, and the control beside.",
    )
    p.add_argument("a", metavar="A", help="log-probs of the run that sampled the tokens")
    p.add_argument("b", metavar="B", help="log-probs of the other run (the trainer)")
    p.add_argument(
        "--control",
        metavar="C",
        help="a control run's log-probs (an lr=0 or repeat run), compared with A the same way",
    )
    p.add_argument(
        "--mask",
        metavar="PATH",
        help="a file holding 'mask' ([S, T] or 'mask.N' per sequence; 1 counts), applied "
        "on top of each side's own mask",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=20,
        help="ids compared by topk_overlap where full logits are given (default 20)",
    )
    p.add_argument("--worst", type=int, default=5, help="worst positions listed (default 5)")
    p.add_argument("--per-sequence", action="store_true", help="also print one row per sequence")
    p.add_argument(
        "--sampled-only",
        action="store_true",
        help="only the sampled tokens' figures: skip the KL and top-k overlap of whole "
        "distributions even where logits or top-k log-probs are given",
    )
    add_common(p, json=ONE_DOCUMENT, format=True, epilog=EPILOG)
    p.set_defaults(func=run_logprobs)


def _add_ladder(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "logprob-ladder",
        help="log-prob mismatch of each run at each training step, against an lr=0 control",
        description="At each training step of each run, compare the two sides' log-probs of "
        "the same tokens (as 'dmlib logprobs' does) and print one row per run and step; "
        "--control names the run whose mismatch is the reference level (an lr=0 run). "
        + _GATE
        + " Exit 5 when any step is not comparable, else 1 when any differs.",
    )
    p.add_argument(
        "steps",
        nargs="+",
        metavar="LABEL:STEP=A,B",
        help="one step of one run: the sampler's and the trainer's log-prob files",
    )
    p.add_argument("--control", metavar="LABEL", help="the control run (lr=0)")
    p.add_argument("--mask", metavar="PATH", help="a mask file applied to every side")
    add_common(p, json=ONE_DOCUMENT, format=True, epilog=EPILOG)
    p.set_defaults(func=run_ladder)


def _positive(n: int, opt: str) -> int:
    if n < 1:
        raise DmlibError(f"{opt} must be at least 1, got {n}")
    return n


def run_logprobs(args: argparse.Namespace) -> int:
    """``dmlib logprobs``: compare, print (or dump) the verdict and the figures."""
    logprob_comparison = _import_comparison()
    rows, v = logprob_comparison(
        args.a,
        args.b,
        control=args.control,
        mask=args.mask,
        top_k=_positive(args.top_k, "--top-k"),
        n_worst=_positive(args.worst, "--worst"),
        labels=(args.a, args.b, args.control or "control"),
        distributions=not args.sampled_only,
    )
    if args.json:
        print_json({"verdict": v.to_dict(), "sequences": rows})
        return exit_code(v)
    print(v)
    if v.status in ("differs", "identical"):
        print()
        print(table(_overall_rows(v), ["figure", "pair", *(["control"] if v.control else [])]))
    if v.worst:
        print()
        print(table(v.worst, ["sequence", "position", "abs_dlogprob", "logprob_a", "logprob_b"]))
    if args.per_sequence and rows:
        print()
        print(table(rows, list(rows[0])))
    return exit_code(v)


def _import_comparison() -> Any:
    """``logprob_comparison``, imported with numpy's BLAS on one thread
    (:func:`_numpy_without_blas_threads`) and the cyclic garbage collector paused while the
    modules load (their tens of thousands of objects are never garbage; its passes over
    them took about 10 ms of CPU in every command), then restored as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        _numpy_without_blas_threads()
        from dmlib.stats.logprobs import logprob_comparison
    finally:
        if was:
            gc.enable()
    return logprob_comparison


def _numpy_without_blas_threads() -> None:
    """Import numpy with one OpenBLAS thread, where this process has not imported it yet and
    the user set no thread count: the comparison makes no BLAS call, and OpenBLAS's threads,
    started by numpy's import, spin for a while on the cores the comparison's own threads
    use (0.05 CPU s of the benchmark's 0.4 on 2 cores). The variable is removed once numpy
    is loaded, so nothing started later inherits it."""
    if "numpy" in sys.modules or "OPENBLAS_NUM_THREADS" in os.environ:
        return
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        import numpy  # noqa: F401
    finally:
        os.environ.pop("OPENBLAS_NUM_THREADS", None)


def _overall_rows(v: Any) -> list[dict[str, Any]]:
    rows = []
    for k, value in v.figures.items():
        row = {"figure": k, "pair": value}
        if v.control is not None:
            row["control"] = v.control.get(k)
        rows.append(row)
    return rows


def parse_steps(items: list[str]) -> dict[str, dict[int, tuple[str, str]]]:
    """``{label: {step: (a, b)}}`` from ``LABEL:STEP=A,B`` items."""
    runs: dict[str, dict[int, tuple[str, str]]] = {}
    for item in items:
        head, sep, paths = item.partition("=")
        label, colon, step = head.rpartition(":")
        a, comma, b = paths.partition(",")
        if not (sep and colon and label and comma and a and b and step.lstrip("-").isdigit()):
            raise DmlibError(
                f"expected LABEL:STEP=A,B (two log-prob files of one step, e.g. "
                f"policy:10=sampler10.jsonl,trainer10.safetensors), got {item!r}"
            )
        steps = runs.setdefault(label, {})
        if int(step) in steps:
            raise DmlibError(f"run {label!r} has step {step} twice")
        steps[int(step)] = (a, b)
    return runs


def run_ladder(args: argparse.Namespace) -> int:
    """``dmlib logprob-ladder``: one row per run and step."""
    from dmlib.stats.logprobs import LADDER_SHOWN, logprob_ladder

    df = logprob_ladder(parse_steps(args.steps), control=args.control, mask=args.mask)
    code = _ladder_code(df)
    if args.json:
        print_json({"control": args.control, "rows": df})
        return code
    print(table(df, [c for c in LADDER_SHOWN if c in df.columns]))
    for r in df[df["status"] == "not comparable"].itertuples(index=False):
        print(f"not comparable: run {fmt(r.run)} step {r.step}: {fmt(r.reason)}")
    return code


def _ladder_code(df: Any) -> int:
    if (df["status"] == "not comparable").any():
        return EXIT_NOT_COMPARABLE
    if (df["status"] == "inconclusive").all():
        from dmlib.cli._common import EXIT_INCONCLUSIVE

        return EXIT_INCONCLUSIVE
    return exit_code(differs=bool((df["status"] != "identical").any()))
