"""Reports: run the notebook collection on a study and write a report to share.

Inside a notebook, ``from dmlib import report`` gives the helpers of
:mod:`dmlib.report.notebook` (:func:`setup`, :func:`save_figure`, :func:`record`, :func:`finding`,
:func:`skip`, :func:`say`, :func:`load_study`, and :func:`md_code` / :func:`md_text`
for names from the data in Markdown). The rest of the package:
:mod:`~dmlib.report.study` (the ``study.toml`` format), :mod:`~dmlib.report.runner`
(headless execution), :mod:`~dmlib.report.build` (``dmlib report``: the report folder),
:mod:`~dmlib.report.pages` (HTML) and :mod:`~dmlib.report.provenance`.
"""

from __future__ import annotations

from dmlib.report.notebook import (
    DEFAULT_FIGURE_DIR,
    compare_study_captures,
    configure,
    figure_dir,
    finding,
    load_numbers,
    load_study,
    md_code,
    md_text,
    notebook_name,
    numbers_path,
    record,
    runs_at_last_step,
    save_figure,
    say,
    setup,
    skip,
)

__all__ = [
    "DEFAULT_FIGURE_DIR",
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
