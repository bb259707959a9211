"""The project's own files agree with each other: environment.yml vs pyproject, CLI entry."""

from __future__ import annotations

import os
import re
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parent.parent


def _names(reqs: list[str]) -> dict[str, str]:
    out = {}
    for r in reqs:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*(.*)$", r)
        assert m, r
        out[m.group(1).lower().replace("_", "-")] = m.group(2).strip()
    return out


def test_environment_yml_lists_the_same_packages_as_pyproject():
    py = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = list(py["dependencies"])
    for extra in ("test", "lab", "formats", "report", "dask"):
        wanted += py["optional-dependencies"][extra]
    yml = (REPO / "environment.yml").read_text()
    pip_section = yml.split("- pip:", 1)[1]
    pip_lines = re.findall(r"^\s+- (?!-e )(.+)$", pip_section, flags=re.M)
    assert _names(pip_lines) == _names(wanted)
    assert "-e .[test,lab,formats,report,dask]" in yml


def test_torch_is_pinned_to_the_cpu_build_on_disk():
    py = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for extra in ("torch", "lab"):
        torch = [r for r in py["optional-dependencies"][extra] if r.startswith("torch")]
        assert torch == ["torch==2.13.0"]


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    assert "make test" in readme and "make report" in readme
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_every_lazy_name_is_visible_to_type_checkers():
    """The TYPE_CHECKING imports of dmlib/__init__.py name exactly the lazy table's names."""
    import ast

    import dmlib

    tree = ast.parse((REPO / "dmlib" / "__init__.py").read_text())
    guarded = [
        n
        for n in tree.body
        if isinstance(n, ast.If) and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING"
    ]
    assert len(guarded) == 1
    seen = {
        alias.name: imp.module
        for imp in guarded[0].body
        if isinstance(imp, ast.ImportFrom)
        for alias in imp.names
    }
    assert seen == dmlib._LAZY
    assert set(dmlib.__all__) >= set(dmlib._LAZY)
    for name in dmlib._LAZY:  # each resolves to the object its module defines
        assert getattr(dmlib, name) is getattr(__import__(seen[name], fromlist=[name]), name)


def test_version_is_written_once():
    import importlib.metadata

    import dmlib

    py = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in py["project"] and "version" in py["project"]["dynamic"]
    assert py["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "dmlib.__version__"}
    assert importlib.metadata.version("dmlib") == dmlib.__version__
    assert (REPO / "dmlib" / "py.typed").is_file()


def test_the_notebook_collection_is_top_level_and_points_at_the_lab():
    """What a newcomer opens: notebooks/ beside dmlib/ and data/, each parameters cell naming a
    lab study by a path that exists from that folder."""
    import json

    from dmlib.report.runner import PACKAGE_NOTEBOOKS

    found = sorted((REPO / "notebooks").glob("*.ipynb"))
    assert found, "no notebooks in notebooks/"
    assert not (REPO / "dmlib" / "report" / "notebooks").exists()
    assert PACKAGE_NOTEBOOKS.resolve() == (REPO / "notebooks").resolve()
    for nb in found:
        cells = json.loads(nb.read_text())["cells"]
        params = [c for c in cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(params) == 1, nb.name
        study = re.search(r'^STUDY = "([^"]+)"', "".join(params[0]["source"]), flags=re.M)
        assert study, nb.name
        assert (REPO / "notebooks" / study.group(1)).resolve().is_file(), (nb.name, study.group(1))


def test_the_wheel_ships_the_notebooks_and_the_report_finds_them(tmp_path):
    """A plain `pip install` of the wheel carries dmlib/notebooks/*.ipynb, and dmlib imported
    from the unpacked wheel (not this checkout) runs the report on those."""
    import subprocess
    import sys
    import zipfile

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "wheel"), str(REPO)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = (tmp_path / "wheel").glob("dmlib-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shipped = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("dmlib/notebooks/"))
    assert shipped == sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb"))
    assert not [n for n in names if n.startswith("notebooks/")]  # not a top-level package
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    out = subprocess.run(
        [sys.executable, "-c",
         "import dmlib.report.runner as r; print(r.PACKAGE_NOTEBOOKS); "
         "print(len(r.find_notebooks()))"],
        check=True, capture_output=True, text=True, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(site)},
    )  # fmt: skip
    where, count = out.stdout.split()
    assert Path(where) == site / "dmlib" / "notebooks"
    assert int(count) == len(shipped)


def test_the_slow_list_names_test_modules_that_exist():
    """conftest's SLOW_MODULES would silently mark nothing after a rename."""
    import importlib.util

    # by path: `import conftest` can find tests/fuzz/conftest.py first on sys.path
    spec = importlib.util.spec_from_file_location("tests_conftest", REPO / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    assert conftest.SLOW_MODULES
    for name in conftest.SLOW_MODULES:
        assert (REPO / "tests" / name).is_file(), name
