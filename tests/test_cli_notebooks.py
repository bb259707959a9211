"""``dmlib notebooks DIR --study PATH`` (the collection for an installed user) and ``make lab``
as root."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dmlib.cli import main
from dmlib.report.runner import PACKAGE_NOTEBOOKS

REPO = Path(__file__).resolve().parents[1]
STUDY = REPO / "data" / "qr_init" / "study.toml"


def _parameters(doc: dict) -> dict[str, object]:
    """The parameters cell's assignments, read as Python literals."""
    for cell in doc["cells"]:
        if cell["cell_type"] == "code" and "parameters" in cell["metadata"].get("tags", []):
            tree = ast.parse("".join(cell["source"]))
            return {
                n.targets[0].id: ast.literal_eval(n.value)
                for n in tree.body
                if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
            }
    raise AssertionError("no parameters cell")


def test_copies_every_notebook_pointed_at_the_study(tmp_path, capsys):
    dest = tmp_path / "lab" / "nbs"
    assert main(["notebooks", str(dest), "--study", str(STUDY.parent)]) == 0
    shipped = sorted(p.name for p in PACKAGE_NOTEBOOKS.glob("*.ipynb"))
    assert sorted(p.name for p in dest.iterdir()) == shipped
    nbformat = pytest.importorskip("nbformat")
    for name in shipped:
        doc = json.loads((dest / name).read_text(encoding="utf-8"))
        nbformat.validate(nbformat.from_dict(doc))
        params = _parameters(doc)
        # JupyterLab runs a notebook in its folder: STUDY relative to it names the study
        assert (dest / str(params["STUDY"])).resolve() == STUDY.resolve()
        assert params["FIGURE_DIR"] == "figures"
        original = json.loads((PACKAGE_NOTEBOOKS / name).read_text(encoding="utf-8"))
        assert _parameters(original)["SMALL"] == params["SMALL"]
        changed = [i for i, (a, b) in enumerate(zip(original["cells"], doc["cells"])) if a != b]
        assert len(doc["cells"]) == len(original["cells"]) and len(changed) == 1
    assert "jupyter lab" in capsys.readouterr().out


def test_never_overwrites_without_force(tmp_path, capsys):
    dest = tmp_path / "nbs"
    dest.mkdir()
    mine = dest / "run_matrix.ipynb"
    mine.write_text("my own edits", encoding="utf-8")
    other = dest / "notes.txt"
    other.write_text("kept", encoding="utf-8")
    assert main(["notebooks", str(dest), "--study", str(STUDY)]) == 2
    err = capsys.readouterr().err
    assert "run_matrix.ipynb" in err and "--force" in err
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt", "run_matrix.ipynb"]
    assert mine.read_text(encoding="utf-8") == "my own edits"
    assert main(["notebooks", str(dest), "--study", str(STUDY), "--force"]) == 0
    assert _parameters(json.loads(mine.read_text(encoding="utf-8")))["FIGURE_DIR"] == "figures"
    assert other.read_text(encoding="utf-8") == "kept"


def test_refuses_a_bad_study_before_writing(tmp_path, capsys):
    bad = tmp_path / "study.toml"
    bad.write_text("[runs]\nx = 'missing.safetensors'\n", encoding="utf-8")
    assert main(["notebooks", str(tmp_path / "nbs"), "--study", str(bad)]) == 2
    assert not (tmp_path / "nbs").exists()
    assert "missing.safetensors" in capsys.readouterr().err


def _lab_recipe() -> str:
    text = (REPO / "Makefile").read_text(encoding="utf-8")
    m = re.search(r"^lab:.*\n\t(.+)$", text, re.M)
    assert m, "no lab recipe"
    return m.group(1)


def test_make_lab_passes_allow_root_exactly_as_root():
    # the recipe's jupyter call, run by the shell as make would, with jupyter replaced by echo
    line = _lab_recipe().replace("$(VENV)/bin/jupyter", "echo").replace("$(LAB_ARGS)", "")
    line = line.replace("$$", "$")
    got = subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True).stdout
    assert ("--allow-root" in got.split()) == (os.getuid() == 0)
    assert got.split()[-1] == "notebooks"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_lab_starts_jupyter(tmp_path):
    """The recipe itself starts JupyterLab (as root too); stopped once it serves."""
    pytest.importorskip("jupyterlab")
    jupyter = Path(sys.executable).parent / "jupyter"
    if not jupyter.exists() or Path(sys.executable).parent != REPO / ".venv" / "bin":
        pytest.skip("make lab runs the repository's .venv")
    # -o: the environment is taken as built (make lab would install it when missing)
    cmd = ["make", "-s", "-o", ".venv/.report", "-o", ".venv/.core", "lab"]
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path), "BROWSER": "true",
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}  # fmt: skip
    env["LAB_ARGS"] = "--no-browser --port=0 --ServerApp.open_browser=False"
    p = subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True,
                         stdout=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    seen = []
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line:
                break
            seen.append(line)
            if "http://" in line:  # the line after "is running at:"
                break
        assert any("http://" in s for s in seen), "".join(seen)[-2000:]
        assert not any("Use --allow-root" in s for s in seen)  # Jupyter's refusal as root
    finally:
        os.killpg(p.pid, 15)
        p.wait(timeout=30)
        p.stderr.close()
