"""What a report page shows a reader: each notebook's parameters once, as the report ran
them, and no empty table (the pages' HTML of dmlib.report.pages)."""

from __future__ import annotations

import nbformat

from dmlib.report import pages
from dmlib.report.runner import INJECTED_TAG, inject_parameters

DEFAULTS = (
    "# Parameters (the papermill convention: this cell is tagged `parameters`).\n"
    "# STUDY names a study file (study.toml): point it at your own.\n"
    'STUDY = "../data/qr_init/study.toml"\n'
    'FIGURE_DIR = "../reports/lab/figures"\n'
    "SMALL = False  # a quick run\n"
    "# parameters whose norm is below this are small-norm\n"
    "SMALL_NORM = 0.1"
)


def _notebook():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# Title"),
        nbformat.v4.new_code_cell(DEFAULTS, metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("x = 1"),
    ]
    inject_parameters(nb, {"STUDY": "study.toml", "FIGURE_DIR": "figures", "SMALL": True})
    return nb


def test_parameters_shown_once_as_run():
    nb = pages.parameters_as_run(_notebook())
    assert not [c for c in nb.cells if INJECTED_TAG in c.metadata.get("tags", [])]
    (cell,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert cell.source.split("\n") == [
        pages.PARAMETERS_HEADER,
        "STUDY = 'study.toml'",
        "FIGURE_DIR = 'figures'",
        "SMALL = True",
        "# parameters whose norm is below this are small-norm",
        "SMALL_NORM = 0.1",  # not injected: the default is what ran
    ]
    assert [c.source for c in nb.cells[-1:]] == ["x = 1"]


def test_notebook_page_has_no_default_study_path():
    body = pages.notebook_body(_notebook())
    assert "../data/qr_init" not in body and "Parameters injected" not in body
    assert body.count("STUDY") == 1 and "study.toml" in body


def test_a_notebook_without_injected_parameters_is_shown_as_it_is():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(DEFAULTS, metadata={"tags": ["parameters"]})]
    assert pages.parameters_as_run(nb).cells[0].source == DEFAULTS


def _summary(runs):
    return {
        "runs": runs,
        "captures": {"request": "probe", "reference": "alone", "folders": {"alone": "a"}},
    }


def test_captures_only_study_prints_no_empty_runs_table():
    html = pages._study_html(_summary([]))
    assert "<h2>Runs</h2>" not in html and "<table" not in html
    assert "<h2>Captures</h2>" in html and "probe" in html
    run = {
        "label": "base",
        "roles": ["reference"],
        "n_checkpoints": 2,
        "steps": "1, 2",
        "path": "b/",
    }
    html = pages._study_html(_summary([run]))
    assert "<h2>Runs</h2>" in html and html.count("<tr>") == 2
