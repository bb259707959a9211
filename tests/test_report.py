"""dmlib.report: figure saving, recorded numbers, and the headless notebook runner."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import nbformat
import numpy as np
import pytest

from dmlib import report
from dmlib.cli import main as cli
from dmlib.errors import DmlibError
from dmlib.report import notebook as report_notebook
from dmlib.report.runner import inject_parameters, notebook_parameters, parse_param


@pytest.fixture(autouse=True)
def _fresh_config(monkeypatch):
    monkeypatch.setattr(report_notebook, "_config", {"figure_dir": None, "notebook": None})
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


def test_notebook_parameters_reads_the_parameters_cell():
    nb = _notebook("#md t", "import os", "A = 1\nB: int = 2\nC, D = 3, 4", params_at=2)
    assert notebook_parameters(nb) == ["A", "B"]
    assert notebook_parameters(_notebook("x = 1")) == []


# ---------------------------------------------------------------------------
# the runner, end to end (one kernel per notebook)

GOOD = (
    "#md # A tiny report",
    "STUDY = 'unset'\nFIGURE_DIR = 'unset'\nSMALL = False\nLABEL = 'default'",
    "import os, sys\nimport matplotlib.pyplot as plt\nfrom dmlib import report\n"
    "study = report.load_study(STUDY)\n"
    "print('EXE', sys.executable)\nprint('PARAMS', SMALL, LABEL, STUDY, list(study.runs))\n"
    "print('MPL', os.environ.get('MPLBACKEND'))\n"
    "fig, ax = plt.subplots()\nax.plot([1, 2, 3])\nreport.save_figure(fig, 'tiny_line')\n"
    "report.record('answer', 42)\nreport.finding('the answer is 42')",
)


def _tiny_study(tmp_path):
    np.save(tmp_path / "one.npy", np.arange(6, dtype=np.float32))
    (tmp_path / "study.toml").write_text('title = "tiny"\n[runs]\nonly = "one.npy"\n')
    return tmp_path / "study.toml"


def test_runner_injects_writes_html_and_names_the_failing_cell(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")  # as `make` used to set it: figures must still show
    nbdir = tmp_path / "notebooks"
    nbdir.mkdir()
    nbformat.write(_notebook(*GOOD, params_at=1), nbdir / "good.ipynb")
    nbformat.write(
        _notebook(*GOOD, "x = 1", "raise ValueError('planted failure')", params_at=1),
        nbdir / "bad.ipynb",
    )
    out = tmp_path / "reports"
    rc = cli(
        [
            "report",
            str(_tiny_study(tmp_path)),
            "--out",
            str(out),
            "--notebooks",
            str(nbdir),
            "--small",
            "--param",
            "LABEL=injected",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 1
    # the failure names the notebook, the cell (the 5th of 5 in the file) and the error
    assert "bad: FAILED in cell 5 of 5: ValueError: planted failure" in captured.err
    assert "good: ok" in captured.err

    executed = nbformat.read(out / "good.ipynb", as_version=4)
    text = "".join(
        o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs
    )
    # the kernel runs this interpreter (paths of this machine are replaced in what is kept),
    # with the injected values overriding the defaults, relative to the report folder
    assert "EXE <python>/" in text
    assert "PARAMS True injected study.toml ['only']" in text
    assert "MPL module://matplotlib_inline.backend_inline" in text
    assert (out / "figures" / "tiny_line.png").stat().st_size > 0
    assert (out / "figures" / "tiny_line.pdf").stat().st_size > 0
    numbers = json.loads((out / "numbers" / "good.json").read_text())
    assert numbers == {"answer": 42, "figures": ["tiny_line"], "finding": "the answer is 42"}
    # the figure is shown where the cell made it: the very PNG that was saved
    shown = [
        o
        for c in executed.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert len(shown) == 1
    import base64

    assert (
        base64.b64decode(shown[0]["data"]["image/png"])
        == (out / "figures" / "tiny_line.png").read_bytes()
    )

    for name in ("good", "bad"):
        html = (out / f"{name}.html").read_text()
        assert html.lstrip().lower().startswith("<!doctype html")
    assert "planted failure" in (out / "bad.html").read_text()
    index = (out / "index.html").read_text()
    assert 'href="good.html"' in index and 'href="bad.html"' in index
    assert "cell 5: ValueError: planted failure" in index
    assert "the answer is 42" in index


def test_runner_bad_input(tmp_path, capsys):
    nbdir = tmp_path / "nb"
    nbdir.mkdir()
    nbformat.write(_notebook("x = 1"), nbdir / "one.ipynb")
    study = str(_tiny_study(tmp_path))
    out = str(tmp_path / "o")
    assert cli(["report", study, "--out", out, "--notebooks", str(nbdir), "--only", "two"]) == 2
    assert "no notebook named two" in capsys.readouterr().err
    assert cli(["report", study, "--out", out, "--notebooks", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert f"looked in {tmp_path / 'absent'}" in err and "pass --notebooks FOLDER" in err
    assert len(err.strip().splitlines()) == 1
    # an existing folder that is not a report is never replaced
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "precious.txt").write_text("x")
    assert cli(["report", study, "--out", str(tmp_path / "keep"), "--notebooks", str(nbdir)]) == 2
    assert (tmp_path / "keep" / "precious.txt").read_text() == "x"
