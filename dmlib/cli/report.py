"""``dmlib report``: run the report notebooks on a study and write the report folder."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from dmlib.cli._common import add_common
from dmlib.cli.compare import add_run_rename
from dmlib.cli.study import STUDY_HELP, flag_pairs
from dmlib.errors import DmlibError

REPORT_EXIT = """exit status:
  0  success: every notebook ran (those the study has no data for are skipped, and say so)
  1  a notebook failed: named with its cell number and error; the report is still written
  2  bad input: one line on stderr (a missing file, a bad study, an --out dmlib may not
     replace); nothing is written or deleted
  130  interrupted (Ctrl-C): one line; temporary folders removed, nothing left half-written
  143  terminated (SIGTERM): the same"""


NOTEBOOKS_EXIT = """exit status:
  0  success: the notebooks were written
  2  bad input: one line on stderr (a study that cannot be read, a notebook that exists
     without --force); nothing is written"""


def register(sub: Any) -> None:
    """Add ``report`` and ``notebooks``."""
    _add_report(sub)
    _add_notebooks(sub)


def _add_notebooks(sub: Any) -> None:
    n = sub.add_parser(
        "notebooks",
        help="copy the report notebooks into a folder, pointed at a study, to open in JupyterLab",
        description="Copy the notebook collection shipped with dmlib into DIR (created if "
        "needed), each notebook's parameters cell pointed at the study (STUDY, relative to DIR) "
        "and its figures at DIR/figures; then open them with `jupyter lab DIR`. A notebook "
        "that already exists in DIR is not overwritten without --force; no other file is "
        "touched.",
    )
    n.add_argument("dir", metavar="DIR", help="the folder to copy the notebooks into")
    n.add_argument(
        "--study", required=True, metavar="PATH", help="study.toml (or a folder holding one)"
    )
    n.add_argument("--force", action="store_true", help="overwrite notebooks of the same name")
    add_common(n, epilog=NOTEBOOKS_EXIT)
    n.set_defaults(func=run_notebooks_copy)


def run_notebooks_copy(args: argparse.Namespace) -> int:
    """``dmlib notebooks DIR --study PATH``: the collection copied, pointed at the study."""
    from dmlib.report.runner import copy_notebooks
    from dmlib.report.study import load_study

    study = load_study(args.study)  # a study that cannot be read is refused before writing
    written = copy_notebooks(args.dir, study.path or args.study, force=args.force)
    print(f"wrote {len(written)} notebooks into {args.dir} (STUDY = {study.path})")
    print(f"open them: jupyter lab {args.dir}")
    return 0


def _add_report(sub: Any) -> None:
    p = sub.add_parser(
        "report",
        help="run the report notebooks on a study; write HTML, figures, numbers, one shareable file",
        description="Run the notebook collection on a study (study.toml, or runs given with --run) "
        "and write DIR/index.html, one HTML per notebook, figures (PNG + PDF), the numbers each "
        "notebook quotes (JSON), DIR/report.html (everything in one self-contained file), "
        "provenance.json and the resolved DIR/study.toml.\n\n" + STUDY_HELP,
    )
    p.add_argument("study", nargs="*", help="study.toml file(s) or folder(s) holding one")
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="report folder: new, empty, or an earlier report dmlib wrote (replaced); never "
        "a folder of the study's inputs",
    )
    p.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="a run: checkpoint file, folder or glob (instead of a study file)",
    )
    _add_flag_study(p)
    p.add_argument("--only", nargs="+", metavar="NOTEBOOK", help="run only these notebooks")
    p.add_argument(
        "--small", action="store_true", help="SMALL=True: a quick run on a subset of the runs"
    )
    p.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set a notebook parameter (must exist in a parameters cell)",
    )
    p.add_argument(
        "--notebooks",
        metavar="FOLDER",
        help="a folder of notebooks (default: the collection shipped with dmlib)",
    )
    p.add_argument(
        "--jobs", type=int, default=None, help="kernels run at once (default: min(4, CPUs))"
    )
    p.add_argument("--timeout", type=int, default=600, help="seconds per cell (default 600)")
    add_common(p, epilog=REPORT_EXIT)
    p.set_defaults(func=run_report)


def _add_flag_study(p: argparse.ArgumentParser) -> None:
    """What a study file would say, given as options with ``--run``."""
    p.add_argument(
        "--control", metavar="LABEL", help="with --run: the run expected to differ (another seed)"
    )
    p.add_argument(
        "--repeat",
        action="append",
        default=[],
        metavar="LABEL=OF",
        help="with --run: run LABEL repeats run OF",
    )
    p.add_argument(
        "--capture",
        action="append",
        default=[],
        metavar="LABEL=FOLDER",
        help="with --run: a capture folder (the first is the reference)",
    )
    p.add_argument("--request", metavar="ID", help="with --capture: the request to compare")
    p.add_argument("--title", help="with --run: the report's title")
    add_run_rename(p)


def _flag_study(args: argparse.Namespace) -> Any:
    from dmlib.report.study import from_dict

    data: dict[str, Any] = {
        "title": args.title or "dmlib report",
        "runs": flag_pairs(args.run, "--run"),
    }
    if args.control:
        data["control"] = args.control
    if args.rename:  # RUN:OLD=NEW, as study.toml's [names] says it
        from dmlib.stats.matrix import run_renames

        run_renames(args.rename, list(data["runs"]))  # checked: a known run, a valid rule
        names: dict[str, list[str]] = {}
        for item in args.rename:
            label, _, rule = item.partition(":")
            names.setdefault(label, []).append(rule)
        data["names"] = names
    if args.repeat:
        data["repeats"] = flag_pairs(args.repeat, "--repeat")
    if args.capture:
        data["captures"] = {"folders": flag_pairs(args.capture, "--capture")}
        if args.request:
            data["captures"]["request"] = args.request
    return from_dict(data, root=Path.cwd())


def run_report(args: argparse.Namespace) -> int:
    """``dmlib report``: check every study and --out first, then build each report."""
    from dmlib.report.build import build_report, check_out
    from dmlib.report.runner import parse_param
    from dmlib.report.study import load_study

    flags = args.run or args.capture
    if flags and args.study:
        raise DmlibError("give a study file or --run/--capture, not both")
    if not flags and not args.study:
        raise DmlibError("nothing to report: give a study.toml, or runs with --run LABEL=PATH")
    if not flags and (args.control or args.repeat or args.request or args.title or args.rename):
        raise DmlibError(
            "--control, --repeat, --request, --title and --rename go with --run; a study file "
            "says them itself ([names] for --rename)"
        )
    params = dict(parse_param(p) for p in args.param)
    for reserved in ("STUDY", "FIGURE_DIR"):
        if reserved in params:
            raise DmlibError(
                f"--param {reserved}: set by dmlib report itself (the study, the report folder)"
            )
    # every study is read and checked before anything is written
    studies = [_flag_study(args)] if flags else [load_study(s) for s in args.study]
    out = Path(args.out)
    targets = [out] if len(studies) == 1 else [out / _name(s, studies) for s in studies]
    fresh = False
    if len(studies) > 1:
        from dmlib.report.build import study_inputs
        from dmlib.report.outdir import check_collection, check_inputs

        check_collection(out)
        fresh = not os.path.lexists(out) or not any(out.iterdir())
        for study in studies:  # the collection's folder must not be or hold any input
            check_inputs(out, *study_inputs(study))
    for study, t in zip(studies, targets, strict=True):
        check_out(t, study)
    progress = sys.stderr
    worst = 0
    done = []
    for study, target in zip(studies, targets, strict=True):
        if len(studies) > 1:
            print(f"== {study.title} -> {target}", file=progress, flush=True)
        results = build_report(
            study,
            target,
            notebooks=args.notebooks,
            only=args.only,
            small=args.small,
            params=params,
            jobs=args.jobs,
            timeout=args.timeout,
            log=progress,
        )
        failed = [r for r in results if r.status == "FAILED"]
        for r in failed:
            where = f"{target}: " if len(studies) > 1 else ""
            print(f"dmlib report: {where}notebook {r.describe()}", file=sys.stderr)
        worst = max(worst, 1 if failed else 0)
        done.append((study, target, results))
    if len(studies) > 1:
        _write_collection(out, done, fresh=fresh)
    return worst


def _name(study: Any, studies: list[Any]) -> str:
    base = study.path.parent.name if study.path is not None else "study"
    names = [s.path.parent.name if s.path is not None else "study" for s in studies]
    if names.count(base) > 1:
        base = f"{base}-{studies.index(study) + 1}"
    return base


def _write_collection(out: Path, done: list[tuple[Any, Path, list[Any]]], *, fresh: bool) -> None:
    """``OUT/index.html`` linking every study's report, then the collection's marker.

    ``fresh``: the folder was new or empty when the run began (dmlib filled it); else it
    must still hold the marker of an earlier collection.
    """
    from dmlib.report.htmlsafe import esc, href, md_inline_html
    from dmlib.report.outdir import check_collection, write_marker
    from dmlib.report.pages import page

    rows = []
    for study, target, results in done:
        rel = os.path.relpath(target, out).replace(os.sep, "/")
        ran = [r for r in results if r.status != "skipped"]
        ok = sum(r.status == "ok" for r in ran)
        findings = "".join(
            f"<li><b>{esc(r.name)}</b>: "
            + (md_inline_html(r.numbers["finding"]) if r.numbers.get("finding") else esc(r.status))
            + "</li>"
            for r in ran
        )
        rows.append(
            f'<h2><a href="{href(rel + "/index.html")}">{esc(study.title)}</a></h2>'
            f'<p>{ok} of {len(ran)} notebooks ran; one file: <a href="{href(rel + "/report.html")}">'
            f"{esc(rel)}/report.html</a></p><ul>{findings}</ul>"
        )
    if not fresh:
        check_collection(out)  # again: the folder may have changed while the notebooks ran
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.html").write_text(
        page("dmlib reports", "<h1>dmlib reports</h1>" + "".join(rows)), encoding="utf-8"
    )
    write_marker(out, "collection", {"reports": [t.name for _, t, _ in done]})
