"""Report plumbing used from inside notebooks: one folder for figures, one for numbers.

Every figure a report notebook draws goes through :func:`save_figure` (PNG and PDF into
one configured folder); every number the prose quotes goes through :func:`record` (a
JSON file per notebook), so tests can check the figures' numbers against dmlib directly.

The folder is, in order of precedence: the ``folder`` argument, :func:`configure`, the
environment variable ``DMLIB_FIGURE_DIR``, then ``reports/figures``. Numbers go beside
it, in ``<figure folder>/../numbers/<notebook>.json``.

Run as ``python -m dmlib.report --notebooks notebooks --out reports`` this module
executes every notebook headless (see :mod:`dmlib.report_runner`).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dmlib._atomic import atomic_write, atomic_write_text
from dmlib.errors import DmlibError

__all__ = [
    "DEFAULT_FIGURE_DIR",
    "configure",
    "figure_dir",
    "load_numbers",
    "main",
    "notebook_name",
    "numbers_path",
    "record",
    "save_figure",
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


def save_figure(fig: Any, name: str, *, folder: str | os.PathLike[str] | None = None) -> list[Path]:
    """Save ``fig`` as ``<folder>/<name>.png`` (150 dpi) and ``<folder>/<name>.pdf``.

    Each file is written under a temporary name and renamed into place, so a figure on
    disk is always complete.

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
    return paths


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


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: execute the report notebooks (see :mod:`dmlib.report_runner`)."""
    from dmlib.report_runner import main as run_main

    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main())
