"""Helpers called from inside report notebooks: figures, numbers, findings, notes.

Every figure a report notebook draws goes through :func:`save_figure` (PNG and PDF into
one configured folder, and shown inline where the notebook makes it); every number the
prose quotes goes through :func:`record` (a JSON file per notebook), so tests can check
the figures' numbers against dmlib directly. :func:`finding` states the notebook's
one-line result (shown in the report's index), :func:`skip` a section the study has no
data for, :func:`say` computed prose; :func:`setup` is a notebook's first call.

:func:`finding` and :func:`say` take Markdown: a name or label from the data goes into
it through :func:`md_code` (a code span it cannot break out of) or :func:`md_text`
(escaped text), never raw, so a report opened by someone else runs no script from a
tensor name. :func:`skip` takes plain text and escapes it itself.

The figure folder, the one rule: the ``folder`` argument, else :func:`configure`, else
the environment variable ``DMLIB_FIGURE_DIR``, else ``reports/figures``. Numbers go
beside it, in ``<figure folder>/../numbers/<notebook>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from dmlib._atomic import atomic_write, atomic_write_text
from dmlib.errors import DmlibError
from dmlib.report.htmlsafe import md_code, md_text

__all__ = [
    "DEFAULT_FIGURE_DIR",
    "StudyNotOpened",
    "compare_study_captures",
    "configure",
    "figure_dir",
    "finding",
    "load_numbers",
    "load_study",
    "md_code",
    "md_text",
    "notebook_name",
    "numbers_path",
    "record",
    "runs_at_last_step",
    "save_figure",
    "say",
    "setup",
    "skip",
]

DEFAULT_FIGURE_DIR = Path("reports") / "figures"
FIGURE_FORMATS = ("png", "pdf")
PNG_DPI = 150

_config: dict[str, Any] = {"figure_dir": None, "notebook": None}


def configure(
    *, figure_dir: str | os.PathLike[str] | None = None, notebook: str | None = None
) -> None:
    """Set the figure folder and the notebook name for this process (a notebook's kernel).

    Passing None leaves a setting as it was.
    """
    if figure_dir is not None:
        _config["figure_dir"] = Path(figure_dir)
    if notebook is not None:
        _check_name(notebook, "notebook name")
        _config["notebook"] = notebook


def figure_dir(folder: str | os.PathLike[str] | None = None) -> Path:
    """The folder figures are saved to (see the module docstring for the precedence)."""
    if folder is not None:
        return Path(folder)
    if _config["figure_dir"] is not None:
        return _config["figure_dir"]
    env = os.environ.get("DMLIB_FIGURE_DIR")
    return Path(env) if env else DEFAULT_FIGURE_DIR


def notebook_name() -> str:
    """The name numbers are recorded under: :func:`configure`, ``DMLIB_NOTEBOOK``, or "notebook"."""
    return _config["notebook"] or os.environ.get("DMLIB_NOTEBOOK") or "notebook"


def _check_name(name: str, what: str) -> None:
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or any(c in name for c in "/\\\0")
    ):
        raise DmlibError(
            f"invalid {what} {name!r}: use a non-empty file name without path separators"
        )


def save_figure(
    fig: Any,
    name: str,
    *,
    folder: str | os.PathLike[str] | None = None,
    show: bool | None = None,
) -> list[Path]:
    """Save ``fig`` as ``<folder>/<name>.png`` (150 dpi) and ``<folder>/<name>.pdf``.

    Each file is written under a temporary name and renamed into place, so a figure on
    disk is always complete. Inside a notebook (``show=None``: an IPython kernel is
    running) the saved PNG itself is displayed where the cell makes the figure and the
    figure is closed, so the notebook shows exactly the file on disk whatever matplotlib
    backend the kernel has, and the notebook's numbers list the figure under
    ``"figures"``.

    Returns
    -------
    list of Path
        The files written, PNG first.
    """
    _check_name(name, "figure name")
    out = figure_dir(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in FIGURE_FORMATS:
        path = out / f"{name}.{ext}"
        with atomic_write(path, "wb") as f:
            fig.savefig(f, format=ext, dpi=PNG_DPI if ext == "png" else None, bbox_inches="tight")
        paths.append(path)
    ipython = _ipython()
    if show if show is not None else ipython is not None:
        _show_png(paths[0], fig)
        _append(folder, "figures", name)
        import matplotlib.pyplot as plt

        plt.close(fig)
    return paths


def _ipython() -> Any:
    """The running IPython kernel's shell, or None outside a kernel."""
    mod = sys.modules.get("IPython")
    shell = mod.get_ipython() if mod is not None else None
    return shell if shell is not None and hasattr(shell, "kernel") else None


def _show_png(path: Path, fig: Any) -> None:
    from IPython.display import Image, display

    # shown at the figure's own size in inches at 100 px per inch, not at the 150 dpi of the file
    width = int(round(fig.get_size_inches()[0] * 100))
    display(Image(data=path.read_bytes(), format="png", width=width))


def _display_markdown(text: str) -> None:
    if _ipython() is not None:
        from IPython.display import Markdown, display

        display(Markdown(text))
    else:
        print(text)


def _append(folder: str | os.PathLike[str] | None, key: str, value: Any) -> None:
    path = numbers_path(folder)
    numbers = load_numbers(path) if path.exists() else {}
    items = list(numbers.get(key) or [])
    if value not in items:
        items.append(value)
    record(key, items, folder=folder)


def finding(text: str, *, folder: str | os.PathLike[str] | None = None) -> str:
    """The notebook's one-line result, computed from the data (shown in the report's index).

    ``text`` is Markdown whose data-derived parts went through :func:`md_code` /
    :func:`md_text`; the index renders its code spans and escapes everything else.
    """
    text = " ".join(str(text).split())
    record("finding", text, folder=folder)
    _display_markdown(f"**Finding:** {text}")
    return text


def skip(reason: str, *, folder: str | os.PathLike[str] | None = None) -> None:
    """Say, visibly and in one line, that a section is skipped and why (recorded under "skipped").

    ``reason`` is plain text (it may quote names from the data): it is escaped for Markdown.
    """
    reason = " ".join(str(reason).split())
    _append(folder, "skipped", reason)
    _display_markdown(f"> *Skipped: {md_text(reason)}*")


def say(*lines: str) -> None:
    """Computed prose (Markdown): one paragraph, or a bulleted list when given several lines.

    Data-derived names and labels in ``lines`` must come through :func:`md_code` /
    :func:`md_text`; newlines inside a line are shown as spaces (one line, one bullet).
    """
    flat = [" ".join(str(ln).split()) for ln in lines]
    text = flat[0] if len(flat) == 1 else "\n".join(f"* {ln}" for ln in flat)
    _display_markdown(text)


def setup(
    study: str | os.PathLike[str],
    figure_folder: str | os.PathLike[str],
    notebook: str,
) -> Any:
    """A report notebook's first call: figures into ``figure_folder``, numbers recorded under
    ``notebook``, pandas' display widened for the tables; returns the study ``study`` names."""
    configure(figure_dir=figure_folder, notebook=notebook)
    import pandas as pd

    pd.set_option("display.width", 160)
    pd.set_option("display.max_columns", 20)
    try:
        return load_study(study)
    except DmlibError as err:
        if _ipython() is None:
            raise
        # in a notebook: one Markdown line saying what to do, and "Run all" stops there
        # on a one-line error instead of a traceback (and a NameError in every cell after)
        _display_markdown(
            f"**The study cannot be opened:** {md_text(str(err))}. Set `STUDY` in the "
            "parameters cell to your study.toml (`dmlib study init FOLDER` writes one)."
        )
        raise StudyNotOpened(str(err)) from None


class StudyNotOpened(DmlibError):
    """:func:`setup` could not open the study, in a notebook (said above in Markdown):
    shown as one line, not a traceback."""

    def _render_traceback_(self) -> list[str]:  # IPython's hook for how an error is shown
        return [f"Stopped: the study could not be opened ({self})."]


def runs_at_last_step(study: Any, small: bool = False) -> tuple[list[str], dict[str, Path], str]:
    """The runs a matrix notebook compares: ``(labels, files, when)``.

    ``labels`` are the study's runs besides the control (the first three when ``small``),
    then the control if one is declared; ``files`` and ``when`` are
    :meth:`~dmlib.report.study.Study.at_last_step` of those runs.
    """
    control = study.control
    labels = [k for k in study.runs if k != control]
    if small:  # a quick run: three runs and the control
        labels = labels[:3]
    labels += [control] if control else []
    files, when = study.at_last_step(labels)
    return labels, files, when


def compare_study_captures(study: Any) -> dict[str, Any]:
    """Each capture of ``study`` compared with the reference capture, and the reference
    with its own repeat: ``{"REF vs LABEL": dmlib.compare_captures frame}``, reference
    comparisons first.

    A comparison gets the repeat control when the reference has a repeat (with the other
    capture's repeat as well when it has one), and the study's negative control.
    """
    from dmlib.localize.boundaries import compare_captures

    cap = study.captures
    ref = cap.reference
    results = {}
    for k in (k for k in cap.folders if k != ref):
        reps = (
            tuple(cap.repeats[x] for x in (ref, k) if x in cap.repeats)
            if ref in cap.repeats
            else None
        )
        results[f"{ref} vs {k}"] = compare_captures(
            cap.folders[ref], cap.folders[k], request=cap.request, repeat=reps or None,
            negative=cap.negative,
        )  # fmt: skip
    for k, folder in cap.repeats.items():
        if k == ref:
            results[f"{ref} vs its repeat"] = compare_captures(
                cap.folders[ref], folder, request=cap.request
            )
    return results


def load_study(path: str | os.PathLike[str]) -> Any:
    """The :class:`~dmlib.report.study.Study` a notebook's ``STUDY`` parameter names."""
    from dmlib.report.study import load_study as _load

    return _load(path)


def numbers_path(folder: str | os.PathLike[str] | None = None, notebook: str | None = None) -> Path:
    """``<figure folder>/../numbers/<notebook>.json``."""
    name = notebook or notebook_name()
    _check_name(name, "notebook name")
    return figure_dir(folder).parent / "numbers" / f"{name}.json"


def record(
    name: str,
    value: Any,
    *,
    folder: str | os.PathLike[str] | None = None,
    notebook: str | None = None,
) -> Any:
    """Record a number the report quotes, for tests to compare with dmlib directly.

    The value is merged into ``numbers_path(folder, notebook)`` (JSON object, key
    ``name``) and returned unchanged, so a cell can display it too.
    """
    if not isinstance(name, str) or not name:
        raise DmlibError(f"record: the name must be a non-empty string, got {name!r}")
    path = numbers_path(folder, notebook)
    path.parent.mkdir(parents=True, exist_ok=True)
    numbers = load_numbers(path) if path.exists() else {}
    from dmlib._json import jsonable  # numpy and pandas only when a number is recorded

    numbers[name] = jsonable(value, what=f"record({name!r})")
    atomic_write_text(path, json.dumps(numbers, indent=2, sort_keys=True) + "\n")
    return value


def load_numbers(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The numbers recorded in one JSON file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise DmlibError("no numbers recorded: the file does not exist", path=path) from None
    except json.JSONDecodeError as err:
        raise DmlibError(f"not a JSON file of recorded numbers: {err}", path=path) from None
    if not isinstance(data, dict):
        raise DmlibError("recorded numbers must be a JSON object", path=path)
    return data
