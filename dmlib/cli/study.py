"""``dmlib study init``: write a study file (study.toml) from a folder it scans or from
``--run LABEL=PATH``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dmlib.cli._common import EXIT_BAD_INPUT, add_common
from dmlib.errors import DmlibError

STUDY_EXIT = """exit status:
  0  success: the study file was written
  2  bad input: one line on stderr (a missing or unreadable checkpoint, an existing file)"""

STUDY_HELP = """A study file (study.toml) says what to analyse: runs (label = a checkpoint, or a folder
or glob of checkpoints forming a step ladder), the control, repeats, factor groups,
parameter groups, captures. Its format is documented in dmlib.report.study
(python -c 'import dmlib.report.study as s; help(s)') and in the README."""


def register(sub: Any) -> None:
    """Add ``study`` and its subcommand ``init``."""
    s = sub.add_parser(
        "study",
        help="write a study file (dmlib study init)",
    )
    add_common(s, epilog=STUDY_EXIT)
    ssub = s.add_subparsers(dest="study_command", metavar="SUBCOMMAND")
    i = ssub.add_parser(
        "init",
        help="write study.toml from a folder it scans or from --run LABEL=PATH",
        description="Write a study.toml. Given FOLDER, scan it: checkpoint files are runs, "
        "subfolders of checkpoints are step ladders, capture folders are captures; every "
        "guess (the control, repeats, the reference capture) is written as a comment to check. "
        "Given --run, write those runs.\n\n" + STUDY_HELP,
    )
    i.add_argument(
        "folder", nargs="?", help="folder to scan (the study file goes into it unless --out)"
    )
    i.add_argument("--run", action="append", default=[], metavar="LABEL=PATH")
    i.add_argument("--control", metavar="LABEL")
    i.add_argument("--capture", action="append", default=[], metavar="LABEL=FOLDER")
    i.add_argument("--request", metavar="ID")
    i.add_argument("--title")
    i.add_argument(
        "--out", metavar="FILE", help="where to write (default: FOLDER/study.toml, or ./study.toml)"
    )
    i.add_argument("--force", action="store_true", help="overwrite an existing file")
    add_common(i, epilog=STUDY_EXIT)
    i.set_defaults(func=run_init)
    s.set_defaults(func=lambda a: _usage(s))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_BAD_INPUT


def flag_pairs(items: list[str], flag: str) -> dict[str, str]:
    """``{label: value}`` from ``LABEL=VALUE`` items of the option ``flag`` (each label once)."""
    out: dict[str, str] = {}
    for item in items:
        label, sep, value = item.partition("=")
        if not sep or not label or not value:
            raise DmlibError(f"{flag} {item!r}: expected LABEL=PATH")
        if label in out:
            raise DmlibError(f"{flag}: label {label!r} given twice")
        out[label] = value
    return out


def run_init(args: argparse.Namespace) -> int:
    """``dmlib study init``: write study.toml from a scanned folder or from --run."""
    from dmlib.report.studyfile import init_from_folder, init_from_runs

    if args.folder and (args.run or args.capture):
        raise DmlibError("give a folder to scan or --run LABEL=PATH, not both")
    if args.folder:
        target = Path(args.out) if args.out else Path(args.folder) / "study.toml"
        if not Path(args.folder).is_dir():
            raise DmlibError("not a folder", path=args.folder)
        text = init_from_folder(Path(args.folder), title=args.title)
        base = Path(args.folder)
        if target.resolve().parent != base.resolve():
            raise DmlibError(
                "a scanned study must be written into the folder it describes (paths are relative to it)",
                path=target,
            )
    elif args.run or args.capture:
        from dmlib.report.study import resolve_runs

        target = Path(args.out or "study.toml")
        # every path must name readable checkpoints (or capture folders) before it is written
        resolve_runs(flag_pairs(args.run, "--run"), Path.cwd(), Path.cwd())
        for label, folder in flag_pairs(args.capture, "--capture").items():
            if not Path(folder).is_dir():
                raise DmlibError(f"capture {label!r}: not a folder", path=folder)
        text = init_from_runs(
            flag_pairs(args.run, "--run"),
            target.resolve().parent,
            control=args.control,
            captures=flag_pairs(args.capture, "--capture"),
            request=args.request,
            title=args.title,
        )
    else:
        raise DmlibError("give a folder to scan, or runs with --run LABEL=PATH")
    if target.exists() and not args.force:
        raise DmlibError("exists; pass --force to overwrite it", path=target)
    text = text + _names_guess(text, target)
    target.write_text(text, encoding="utf-8")
    print(
        f"wrote {target}; check the lines marked 'guessed', then: dmlib report {target} --out report"
    )
    return 0


def _names_guess(text: str, target: Path) -> str:
    """A ``[names]`` section for runs that would compare nothing under their own names (the
    rename that pairs them, marked guessed and said on stderr); refused when no rename
    pairs them. Empty when every pair of runs shares names."""
    import contextlib
    import itertools

    from dmlib.report.study import from_dict, tomllib
    from dmlib.sources import opened
    from dmlib.stats.matrix import pair_problem

    study = from_dict(tomllib.loads(text), root=target.resolve().parent, path=target)
    files = {label: run.last()[1] for label, run in study.runs.items()}
    rules: dict[str, str] = {}
    notes = []
    with contextlib.ExitStack() as stack:
        sets = {k: stack.enter_context(opened(v)) for k, v in files.items()}
        pairs = sorted(itertools.combinations(sets, 2), key=lambda p: study.control not in p)
        for la, lb in pairs:
            if la in rules or lb in rules:
                continue
            p = pair_problem(la, sets[la], lb, sets[lb])
            if p is None or p["kind"] == "few_shared":
                continue
            if p["kind"] != "no_shared_name" or len(p["rename"]) != 1:
                raise DmlibError(p["message"])
            run, _, rule = p["rename"][0].partition(":")
            rules[run] = rule
            notes.append(
                f"# guessed: runs {la} and {lb} share no tensor name; {run}'s rule pairs them"
            )
            print(f"warning: {p['message']}; written to [names] as guessed", file=sys.stderr)
    if not rules:
        return ""
    lines = ["", "[names]  # each run's names mapped before any comparison", *notes]
    lines += [f"{json.dumps(run)} = {json.dumps(rule)}" for run, rule in rules.items()]
    return "\n".join(lines) + "\n"
