"""dmlib.report: figure saving, recorded numbers, and the headless notebook runner."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import nbformat
import numpy as np
import pytest

from dmlib import report
from dmlib.errors import DmlibError
from dmlib.report_runner import inject_parameters, main, parse_param


@pytest.fixture(autouse=True)
def _fresh_config(monkeypatch):
    monkeypatch.setattr(report, "_config", {"figure_dir": None, "notebook": None})
    monkeypatch.delenv("DMLIB_FIGURE_DIR", raising=False)
    monkeypatch.delenv("DMLIB_NOTEBOOK", raising=False)


# ---------------------------------------------------------------------------
# save_figure / record


def _figure():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 2])
    return fig


def test_save_figure_writes_png_and_pdf(tmp_path):
    fig = _figure()
    try:
        paths = report.save_figure(fig, "growth", folder=tmp_path / "figs")
    finally:
        plt.close(fig)
    assert paths == [tmp_path / "figs" / "growth.png", tmp_path / "figs" / "growth.pdf"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert paths[1].read_bytes()[:5] == b"%PDF-"
    # nothing but the two figures: no temporary file left behind
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == ["growth.pdf", "growth.png"]


def test_figure_folder_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert report.figure_dir() == report.DEFAULT_FIGURE_DIR
    monkeypatch.setenv("DMLIB_FIGURE_DIR", str(tmp_path / "env"))
    assert report.figure_dir() == tmp_path / "env"
    report.configure(figure_dir=tmp_path / "configured")
    assert report.figure_dir() == tmp_path / "configured"
    assert report.figure_dir(tmp_path / "arg") == tmp_path / "arg"
    fig = _figure()
    try:
        report.save_figure(fig, "f")
    finally:
        plt.close(fig)
    assert (tmp_path / "configured" / "f.png").stat().st_size > 0


@pytest.mark.parametrize("bad", ["", "../up", "a/b", ".."])
def test_bad_figure_name(tmp_path, bad):
    with pytest.raises(DmlibError, match="figure name"):
        report.save_figure(object(), bad, folder=tmp_path)


def test_record_merges_numbers_beside_figures(tmp_path):
    figs = tmp_path / "out" / "figures"
    report.configure(figure_dir=figs, notebook="nb1")
    assert report.record("max_ulp", np.uint64(5)) == 5
    report.record("rel_fro", np.float32(0.5))
    report.record("nan_is_null", float("nan"))
    report.record("cols", np.array([0, 2, 55]))
    path = tmp_path / "out" / "numbers" / "nb1.json"
    assert report.numbers_path() == path
    assert json.loads(path.read_text()) == {
        "max_ulp": 5,
        "rel_fro": 0.5,
        "nan_is_null": None,
        "cols": [0, 2, 55],
    }
    assert report.load_numbers(path)["max_ulp"] == 5


def test_record_refuses_what_json_cannot_hold(tmp_path):
    with pytest.raises(DmlibError, match="cannot store a object"):
        report.record("x", object(), folder=tmp_path)


# ---------------------------------------------------------------------------
# parameter injection


def _notebook(*sources, params_at=None):
    nb = nbformat.v4.new_notebook()
    for i, src in enumerate(sources):
        if src.startswith("#md"):
            nb.cells.append(nbformat.v4.new_markdown_cell(src[3:]))
        else:
            tags = ["parameters"] if i == params_at else []
            nb.cells.append(nbformat.v4.new_code_cell(src, metadata={"tags": tags}))
    return nb


def test_injection_after_first_parameters_cell():
    nb = _notebook("#md title", "import os", "SMALL = False", "SMALL2 = 1", params_at=2)
    at = inject_parameters(nb, {"SMALL": True, "DATA_DIR": "/d"})
    assert at == 3
    assert nb.cells[3].source.splitlines()[1:] == ["SMALL = True", "DATA_DIR = '/d'"]
    assert nb.cells[3].metadata.tags == ["injected-parameters"]
    # a second injection replaces the first instead of stacking
    inject_parameters(nb, {"SMALL": False})
    assert sum("injected-parameters" in c.metadata.get("tags", []) for c in nb.cells) == 1
    assert len(nb.cells) == 5


def test_injection_without_parameters_cell_goes_first():
    nb = _notebook("x = 1")
    assert inject_parameters(nb, {"X": 2}) == 0


def test_injection_refuses_non_literals():
    with pytest.raises(DmlibError, match="not a Python literal"):
        inject_parameters(_notebook("x = 1"), {"X": object()})
    with pytest.raises(DmlibError, match="identifier"):
        inject_parameters(_notebook("x = 1"), {"not valid": 1})


def test_parse_param():
    assert parse_param("N=3") == ("N", 3)
    assert parse_param("NAME=abc") == ("NAME", "abc")
    assert parse_param("L=[1, 2]") == ("L", [1, 2])
    with pytest.raises(DmlibError):
        parse_param("no_equals")


# ---------------------------------------------------------------------------
# the runner, end to end (one kernel per notebook)

GOOD = (
    "#md # A tiny report",
    "DATA_DIR = 'unset'\nFIGURE_DIR = 'unset'\nSMALL = False\nLABEL = 'default'",
    "import sys\nimport matplotlib.pyplot as plt\nfrom dmlib import report\n"
    "print('EXE', sys.executable)\nprint('PARAMS', SMALL, LABEL, DATA_DIR)\n"
    "fig, ax = plt.subplots()\nax.plot([1, 2, 3])\nreport.save_figure(fig, 'tiny_line')\n"
    "report.record('answer', 42)",
)


def test_runner_injects_writes_html_and_names_the_failing_cell(tmp_path, capsys):
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    nbformat.write(_notebook(*GOOD, params_at=1), nbdir / "good.ipynb")
    nbformat.write(
        _notebook(*GOOD, "x = 1", "raise ValueError('planted failure')", params_at=1),
        nbdir / "bad.ipynb",
    )
    out = tmp_path / "reports"
    # a number left by an earlier run must not survive into this one
    (out / "numbers").mkdir(parents=True)
    (out / "numbers" / "good.json").write_text('{"stale": 1}')
    rc = main(
        [
            "--notebooks",
            str(nbdir),
            "--out",
            str(out),
            "--small",
            "--param",
            "LABEL=injected",
            "--data",
            str(tmp_path),
        ]
    )
    captured = capsys.readouterr()
    assert rc == 1
    # the failure names the notebook, the cell (index 4 in the file) and the error
    assert "notebook bad failed at cell 4" in captured.err
    assert "planted failure" in captured.err
    assert "good: ok" in captured.out

    executed = nbformat.read(out / "good.ipynb", as_version=4)
    text = "".join(
        o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs
    )
    # the kernel runs this interpreter, with the injected values overriding the defaults
    assert f"EXE {sys.executable}" in text
    assert f"PARAMS True injected {tmp_path}" in text
    assert (out / "figures" / "tiny_line.png").stat().st_size > 0
    assert (out / "figures" / "tiny_line.pdf").stat().st_size > 0
    assert json.loads((out / "numbers" / "good.json").read_text()) == {"answer": 42}

    for name in ("good", "bad"):
        html = (out / f"{name}.html").read_text()
        assert html.lstrip().lower().startswith("<!doctype html")
    assert "planted failure" in (out / "bad.html").read_text()
    index = (out / "index.html").read_text()
    assert 'href="good.html"' in index and 'href="bad.html"' in index
    assert "FAILED at cell 4" in index


def test_runner_only_unknown_name_is_bad_input(tmp_path, capsys):
    nbdir = tmp_path / "nb"
    nbdir.mkdir()
    nbformat.write(_notebook("x = 1"), nbdir / "one.ipynb")
    assert main(["--notebooks", str(nbdir), "--out", str(tmp_path / "o"), "--only", "two"]) == 2
    assert "no notebook named two" in capsys.readouterr().err
    assert main(["--notebooks", str(tmp_path / "absent"), "--out", str(tmp_path / "o")]) == 2
