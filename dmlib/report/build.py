"""``dmlib report``: run the notebook collection on a study and write the report folder.

The report folder holds ``index.html``, one ``<notebook>.html`` (and executed
``.ipynb``) per notebook, ``figures/`` (PNG + PDF), ``numbers/<notebook>.json``,
``report.html`` (everything in one file, figures embedded), ``provenance.json`` and the
resolved ``study.toml``. It is built in a hidden sibling folder and renamed into place
at the end, so an interrupted or refused run never leaves a folder that looks complete.

The folder's marker (``.dmlib-report.json``, written last) names the study and lists the
report's files: an existing ``--out`` is replaced only when it holds that marker and
nothing else, and never when it is, holds or lies inside one of the study's inputs
(:mod:`dmlib.report.outdir`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dmlib._json import jsonable
from dmlib.errors import DmlibError
from dmlib.report import notebook as nbhelp
from dmlib.report import outdir, pages, provenance
from dmlib.report.runner import (
    NotebookResult,
    find_notebooks,
    read_notebook,
    run_notebooks,
    scrub,
    scrub_text,
)
from dmlib.report.study import Study
from dmlib.report.studyfile import resolved_toml

__all__ = ["NEEDS", "build_report", "check_out", "missing"]

# what a notebook needs from a study (notebook metadata "dmlib": {"needs": [...]}), and
# the note the index shows when the study has none of it
NEEDS: dict[str, Callable[[Study], str | None]] = {
    "checkpoint": lambda s: (
        None if s.runs or s.anatomy else "the study names no checkpoint ([runs] or [anatomy])"
    ),
    "two_runs": lambda s: (
        None if len(s.runs) >= 2 else "the study has fewer than two runs: nothing to compare"
    ),
    "ladder": lambda s: (
        None if s.ladders() else "no run has checkpoints at two or more steps (a step ladder)"
    ),
    "factor_groups": lambda s: (
        None if s.factor_groups else "the study declares no factor groups ([[factor_groups]])"
    ),
    "captures": lambda s: (
        None if s.captures is not None else "the study declares no captures ([captures])"
    ),
    "logprobs": lambda s: (
        None
        if s.logprobs is not None
        else "the study declares no log-prob runs ([logprobs]: per-step log-prob files of "
        "the sampler and the trainer, docs/logprobs.md)"
    ),
    "adapters": lambda s: (
        None
        if s.adapters is not None or _adapter_runs(s)
        else "the study has no LoRA adapter runs ([runs] of PEFT adapter folders) and no "
        "[adapters] gradients (docs/adapters.md)"
    ),
}


def _adapter_runs(study: Study) -> list[str]:
    from dmlib.report.sections_adapters import adapter_run_labels

    return adapter_run_labels(study)


def missing(nb: Any, study: Study) -> str | None:
    """Why ``study`` cannot feed notebook ``nb`` (its declared needs), or None."""
    needs = nb.metadata.get("dmlib", {}).get("needs", [])
    for need in needs:
        if need not in NEEDS:
            raise DmlibError(
                f"notebook needs {need!r}, which dmlib does not know; known: {', '.join(NEEDS)}"
            )
        reason = NEEDS[need](study)
        if reason:
            return reason
    return None


def study_inputs(study: Study) -> tuple[list[Path], list[Path]]:
    """(paths a report folder must not be or hold, folders it must not lie inside).

    The first: the study file and its folder, the study's root, every file it reads and
    every run and capture folder. The second: the capture folders and the folders of
    step ladders (read as a whole), but not the study's own folder, where a report may
    sit beside the study file.
    """
    holds: list[Path] = [study.root]
    if study.path is not None:
        holds += [Path(study.path), Path(study.path).parent]
    holds += study.input_files()
    contains: list[Path] = []
    for run in study.runs.values():
        paths = list(run.checkpoints.values())
        holds += [p.parent for p in paths]
        if len(paths) > 1:
            contains += [p.parent for p in paths]
    c = study.captures
    if c is not None:
        folders = [*c.folders.values(), *c.repeats.values(), *c.ops.values()]
        folders += [c.negative] if c.negative is not None else []
        holds += folders
        contains += folders
    roots = {outdir._resolved(study.root)}
    if study.path is not None:
        roots.add(outdir._resolved(Path(study.path).parent))
    contains = [f for f in dict.fromkeys(contains) if outdir._resolved(f) not in roots]
    return list(dict.fromkeys(holds)), contains


def check_out(out: str | os.PathLike[str], study: Study | None = None) -> None:
    """Refuse a report folder dmlib may not replace: one that is not new, empty or an
    earlier report dmlib wrote (its marker, nothing else), or one that is, holds or lies
    inside an input of ``study``."""
    holds, contains = study_inputs(study) if study is not None else ([], [])
    outdir.check_out(out, holds, contains)


def build_report(
    study: Study,
    out: str | os.PathLike[str],
    *,
    notebooks: str | os.PathLike[str] | None = None,
    only: Sequence[str] | None = None,
    small: bool = False,
    params: Mapping[str, Any] | None = None,
    jobs: int | None = None,
    timeout: int = 600,
    log: Any = None,
) -> list[NotebookResult]:
    """Run the notebooks on ``study`` and write the report folder ``out`` (replaced if present)."""
    t0 = time.perf_counter()
    out = Path(out).resolve()
    check_out(out, study)
    for warning in check_run_names(study):  # a pair comparing nothing is refused here
        if log is not None:
            print(f"warning: {warning}", file=log, flush=True)
    paths = find_notebooks(notebooks, only)
    nbs = {p: read_notebook(p) for p in paths}
    skipped = {p: missing(nbs[p], study) for p in paths}
    stage = _new_stage(out)
    try:
        outdir.write_owner(stage)
        (stage / "study.toml").write_text(resolved_toml(study, out), encoding="utf-8")
        # torch's ISA is asked in a child process while the notebooks run
        torch_box: dict[str, Any] = {}
        probe = threading.Thread(
            target=lambda: torch_box.update(v=provenance.torch_facts()), daemon=True
        )
        probe.start()
        all_params = {
            "STUDY": "study.toml",
            "FIGURE_DIR": "figures",
            "SMALL": bool(small),
            **dict(params or {}),
        }
        ordered = _run_all(study, paths, skipped, stage, all_params, jobs, timeout, log)
        probe.join()
        shutil.rmtree(stage / "cache", ignore_errors=True)  # the matrix shared by notebooks
        prov = provenance.collect(study.input_files(), study.root, torch=torch_box.get("v"))
        _write_outputs(study, stage, out, ordered, prov)
        _seal_stage(study, stage, prov)
        _replace(stage, out, study)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if log is not None:
        n_run = sum(skipped[p] is None for p in paths)
        failed = sum(r.status == "FAILED" for r in ordered)
        print(
            f"{n_run - failed}/{n_run} notebooks ok in {time.perf_counter() - t0:.1f} s; "
            f"open {os.path.relpath(out / 'index.html')} (or the one file {os.path.relpath(out / 'report.html')})",
            file=log,
            flush=True,
        )
    return ordered


def check_run_names(study: Study) -> list[str]:
    """Refuse a study two of whose runs would compare nothing (no tensor name shared after
    ``[names]`` and the mappings, or none of the same dtype and shape), naming the
    ``[names]`` rule that pairs them, the control's pairs first; the warnings for pairs
    that share few names. Each run's last checkpoint is opened (its header read)."""
    import contextlib

    from dmlib.sources import opened
    from dmlib.stats.matrix import check_pairs

    if len(study.runs) < 2:
        return []
    files = {label: run.last()[1] for label, run in study.runs.items()}
    with contextlib.ExitStack() as stack:
        sets = {k: stack.enter_context(opened(v)) for k, v in study.sources(files).items()}
        try:
            hints = check_pairs(sets, None, None, control=study.control)
        except DmlibError as err:
            raise DmlibError(err.message, path=study.path) from None
    return [h["message"] for h in hints.values()]


def _new_stage(out: Path) -> Path:
    """A fresh staging folder beside ``out``, after removing those a killed run left."""
    out.parent.mkdir(parents=True, exist_ok=True)
    for pattern in (f".{out.name}.partial-*", f".{out.name}.old-*"):
        outdir.clean_stale(out.parent, pattern)  # left by a killed run
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))


def _run_all(
    study: Study,
    paths: list[Path],
    skipped: Mapping[Path, str | None],
    stage: Path,
    all_params: Mapping[str, Any],
    jobs: int | None,
    timeout: int,
    log: Any,
) -> list[NotebookResult]:
    """Run the notebooks not skipped into ``stage``; one result per notebook, in order."""
    to_run = [p for p in paths if skipped[p] is None]
    done = [0]

    def progress(res: NotebookResult) -> None:
        done[0] += 1
        if log is not None:
            print(f"[{done[0]}/{len(to_run)}] {res.describe()}", file=log, flush=True)

    if log is not None:
        for p in paths:
            if skipped[p]:
                print(f"{p.stem}: skipped ({skipped[p]})", file=log, flush=True)
        print(f"running {len(to_run)} notebooks on {study.title!r} ...", file=log, flush=True)
    results = (
        run_notebooks(
            to_run, stage, dict(all_params), jobs=jobs, timeout=timeout, progress=progress
        )
        if to_run
        else []
    )
    by_path = dict(zip(to_run, results, strict=True))
    return [
        by_path.get(p) or NotebookResult(name=p.stem, ok=True, seconds=0.0, skipped=skipped[p])
        for p in paths
    ]


def _seal_stage(study: Study, stage: Path, prov: Mapping[str, Any]) -> None:
    """Mark the staged folder as a finished report (its owner file replaced by the marker)."""
    (stage / outdir.OWNER).unlink()
    outdir.write_marker(
        stage,
        "report",
        {
            "title": study.title,
            "study": Path(study.path).name if study.path is not None else None,
            "version": prov["versions"].get("dmlib"),
        },
    )


def _machine_paths(study: Study, stage: Path, out: Path) -> list[tuple[str, str]]:
    """Absolute paths that must not appear in a shared report, and what replaces them."""
    pairs = [
        (str(stage) + os.sep, ""),
        (str(stage), "."),
        (str(out) + os.sep, ""),
        (str(study.root) + os.sep, "<study>/"),
        (str(Path(nbhelp.__file__).resolve().parents[2]) + os.sep, "<dmlib>/"),
        (sys.prefix + os.sep, "<python>/"),
        (sys.base_prefix + os.sep, "<python>/"),
        (str(Path.home()) + os.sep, "~/"),
        (tempfile.gettempdir() + os.sep, "<tmp>/"),
        (os.getcwd() + os.sep, ""),
    ]
    return [(a, b) for a, b in pairs if len(a) > 1]


def _write_outputs(
    study: Study, stage: Path, out: Path, results: list[NotebookResult], prov: dict[str, Any]
) -> None:
    import nbformat

    figures = stage / "figures"
    machine = _machine_paths(study, stage, out)
    bodies: dict[str, str] = {}
    rows = []
    for r in results:
        numbers_file = nbhelp.numbers_path(figures, r.name)
        r.numbers = nbhelp.load_numbers(numbers_file) if numbers_file.is_file() else {}
        if r.nb is not None:
            scrub(r.nb, machine)
            (stage / f"{r.name}.ipynb").write_text(nbformat.writes(r.nb), encoding="utf-8")
            body = pages.notebook_body(r.nb)
            bodies[r.name] = body
            (stage / f"{r.name}.html").write_text(
                pages.notebook_page(r.name, body), encoding="utf-8"
            )
        if r.error is not None:  # quoted in the index and summary.json: no path of this machine
            r.error = scrub_text(r.error, machine)
        rows.append(
            {
                "name": r.name,
                "status": r.status,
                "skipped": r.skipped,
                "seconds": round(r.seconds, 2),
                "failed_cell": r.failed_cell,
                "error": r.error,
                "finding": r.numbers.get("finding"),
                "figures": list(r.numbers.get("figures") or []),
                "skipped_sections": list(r.numbers.get("skipped") or []),
            }
        )
    summary = {
        "title": study.title,
        "made_on": study.made_on,
        "dmlib": prov["versions"].get("dmlib"),
        "control": study.control,
        "runs": [_run_row(study, k) for k in study.runs],
        "captures": _captures_row(study),
        "results": rows,
        "provenance": prov,
    }
    (stage / "provenance.json").write_text(
        json.dumps(jsonable(prov), indent=2) + "\n", encoding="utf-8"
    )
    brief = {k: v for k, v in summary.items() if k != "provenance"}
    (stage / "summary.json").write_text(
        json.dumps(jsonable(brief), indent=2) + "\n", encoding="utf-8"
    )
    (stage / "index.html").write_text(pages.index_page(summary, figures), encoding="utf-8")
    (stage / "report.html").write_text(
        pages.single_page(summary, bodies, figures), encoding="utf-8"
    )


def _run_row(study: Study, label: str) -> dict[str, Any]:
    run = study.runs[label]
    roles = []
    if label == study.control:
        roles.append("control")
    if label == study.reference and study.ladders():
        roles.append("reference")
    if label in study.repeats:
        roles.append(f"repeat of {study.repeats[label]}")
    steps = run.steps
    shown = (
        "not recorded"
        if not steps
        else str(steps[0])
        if len(steps) == 1
        else f"{', '.join(map(str, steps))}"
        if len(steps) <= 8
        else f"{steps[0]}..{steps[-1]} ({len(steps)})"
    )
    paths = list(run.checkpoints.values())
    where = study.rel(paths[0]) if len(paths) == 1 else study.rel(paths[0].parent) + "/"
    return {
        "label": label,
        "roles": roles,
        "n_checkpoints": len(paths),
        "steps": shown,
        "path": where,
    }


def _captures_row(study: Study) -> dict[str, Any] | None:
    c = study.captures
    if c is None:
        return None
    return {
        "request": c.request or "(every request)",
        "reference": c.reference,
        "folders": {k: study.rel(v) for k, v in c.folders.items()},
        "ops": {k: study.rel(v) for k, v in c.ops.items()},
    }


def _replace(stage: Path, out: Path, study: Study) -> None:
    """Move the finished report into place; an older report there goes only once it is done.

    The folder is checked again (it may have changed while the notebooks ran); an empty
    one is removed with ``rmdir``, which cannot delete anything in it.
    """
    check_out(out, study)
    old = None
    if os.path.lexists(out):
        if not any(out.iterdir()):
            out.rmdir()
        else:
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            outdir.write_owner(old)
    try:
        stage.rename(out)
    except BaseException:
        if old is not None:
            old.rename(out)
            (out / outdir.OWNER).unlink(missing_ok=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
