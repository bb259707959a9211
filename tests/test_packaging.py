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
    for extra in ("test", "lab"):
        wanted += py["optional-dependencies"][extra]
    yml = (REPO / "environment.yml").read_text()
    pip_section = yml.split("- pip:", 1)[1]
    pip_lines = re.findall(r"^\s+- (?!-e )(.+)$", pip_section, flags=re.M)
    assert _names(pip_lines) == _names(wanted)
    assert "-e .[test,lab]" in yml


def test_torch_is_pinned_to_the_cpu_build_on_disk():
    py = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for extra in ("torch", "lab"):
        torch = [r for r in py["optional-dependencies"][extra] if r.startswith("torch")]
        assert torch == ["torch==2.13.0"]


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    assert "make test" in readme and "make report" in readme
    assert "make test" in (REPO / ".ci" / "run").read_text()
