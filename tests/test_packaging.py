"""The project's own files agree with each other: environment.yml vs pyproject, CLI entry."""

from __future__ import annotations

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
