"""The rooms of dmlib import only downwards: every import in ``dmlib/`` parsed and checked
against the allowed edges written once, in docs/architecture.md (the ``layering`` block)."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "dmlib"
BASE = {
    "errors", "dtypes", "hashing", "tensor", "names", "textsafe", "safepaths", "machine",
    "_limits", "_atomic", "_json", "_blas", "numfmt",
}  # fmt: skip


def allowed_edges() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"```layering\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```layering block"
    edges: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        if line.strip():
            room, _, targets = line.partition(":")
            edges[room.strip()] = set(targets.split())
    return edges


def room_of(module: str) -> str:
    """The room of a dotted module name under dmlib (``dmlib`` itself is ``api``)."""
    parts = module.split(".")
    assert parts[0] == "dmlib", module
    if parts[-1] == "__main__":
        return "entry"
    if len(parts) == 1:
        return "api"
    return "base" if parts[1] in BASE else parts[1]


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split("."))
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every absolute dmlib import in ``path``."""
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.startswith("dmlib")]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            if node.module and node.module.split(".")[0] == "dmlib":
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    out.append((sub, None, node.lineno) if _is_module(sub) else
                               (node.module, a.name, node.lineno))  # fmt: skip
    return out


def edges_in_tree() -> list[tuple[str, str, str, str]]:
    """(importing room, imported room, where, what) for every cross-room import."""
    found = []
    for path in sorted(PKG.rglob("*.py")):
        src = room_of(_module_of(path))
        for module, name, line in imports(path):
            dst = room_of(module)
            if dst != src:
                what = module + (f".{name}" if name else "")
                found.append((src, dst, f"{path.relative_to(ROOT)}:{line}", what))
    return found


def test_every_room_is_described() -> None:
    edges = allowed_edges()
    rooms = {room_of(_module_of(p)) for p in PKG.rglob("*.py")}
    assert rooms <= set(edges), f"rooms missing from docs/architecture.md: {rooms - set(edges)}"
    for room, targets in edges.items():
        assert targets <= set(edges), f"{room} names unknown rooms {targets - set(edges)}"


def test_imports_follow_the_allowed_edges() -> None:
    edges = allowed_edges()
    bad = [f"{where}: {src} -> {dst} ({what})" for src, dst, where, what in edges_in_tree()
           if dst not in edges.get(src, set())]  # fmt: skip
    assert not bad, "imports the architecture does not allow:\n" + "\n".join(bad)


def test_the_allowed_edges_have_no_cycle() -> None:
    edges = allowed_edges()
    state: dict[str, int] = defaultdict(int)  # 0 new, 1 on the path, 2 done

    def visit(room: str, path: list[str]) -> None:
        if state[room] == 1:
            pytest.fail("cycle in the allowed edges: " + " -> ".join([*path, room]))
        if state[room] == 0:
            state[room] = 1
            for nxt in sorted(edges.get(room, ())):
                visit(nxt, [*path, room])
            state[room] = 2

    for room in sorted(edges):
        visit(room, [])


def test_no_private_name_crosses_a_room() -> None:
    bad = []
    for src, dst, where, what in edges_in_tree():
        segments = what.split(".")[1:]
        if dst == "base":
            segments = segments[1:]  # dmlib._atomic & co. are the base room's own modules
        if any(s.startswith("_") and not s.startswith("__") for s in segments):
            bad.append(f"{where}: {src} takes {what} from {dst}")
    assert not bad, "private names taken across rooms:\n" + "\n".join(bad)


def test_the_checker_sees_a_bad_edge(tmp_path: Path) -> None:
    """The parser finds a function-level upward import and a private cross-room name."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from dmlib.report.pages import _esc\n    import dmlib.cli\n")
    got = imports(probe)
    assert ("dmlib.report.pages", "_esc", 2) in got and ("dmlib.cli", None, 3) in got
    assert room_of("dmlib.report.pages") == "report" and room_of("dmlib._atomic") == "base"
    assert "cli" not in allowed_edges()["stats"]


def _body_lines(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines, its docstring not counted (documentation is not length)."""
    n = fn.end_lineno - fn.lineno + 1  # type: ignore[operator]
    if ast.get_docstring(fn, clean=False) is not None:
        doc = fn.body[0]
        n -= doc.end_lineno - doc.lineno + 1  # type: ignore[operator]
    return n


def test_no_function_over_80_lines() -> None:
    """Long functions are split into named steps (docs/architecture.md)."""
    long = []
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if (n := _body_lines(node)) > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "functions over 80 lines (docstrings not counted):\n" + "\n".join(long)


def test_the_length_rule_counts_code_not_docstrings() -> None:
    doc = '    """' + "\n" * 100 + '    """\n'
    src = "def f():\n" + doc + "    x = 1\n" * 5 + "def g():\n" + "    y = 2\n" * 81
    fns = {n.name: _body_lines(n) for n in ast.parse(src).body}
    assert fns == {"f": 6, "g": 82}


def _module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module in ``graph`` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


#: pairs allowed to import each other: none (a cycle is broken by moving what both need
#: below them, as io/_folderfiles.py holds what hf_trainer and _hf_names both read with)
KNOWN_CYCLES: set[frozenset[str]] = set()


def test_no_two_modules_import_each_other() -> None:
    """Imports between modules go one way, inside a room too (module level or inside a
    function alike): ``stats/compare`` reaches ``stats/mapped``, never the reverse."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted(PKG.rglob("*.py")):
        src = _module_of(path)
        for module, _name, _line in imports(path):
            if module != src:
                graph[src].add(module)
    cycles = [c for c in _module_cycles(graph) if frozenset(c) not in KNOWN_CYCLES]
    assert not cycles, "modules that import each other:\n" + "\n".join(map(str, cycles))
    assert _module_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: what the capture's rooms (dmlib/localize/capture/) may import besides each other and
#: base: the readers and writers of io, localize/ops.py (the op recorder and quiet()) and
#: localize/experts.py (the per-expert row recorder expertrows.py writes into a capture)
CAPTURE_MAY_IMPORT = ("dmlib.io", "dmlib.localize.ops", "dmlib.localize.experts")


def test_the_capture_imports_none_of_the_comparison() -> None:
    """Recording and reading a capture stand below comparing captures (boundaries,
    culprits, controls...): docs/architecture.md, "The capture's rooms"."""
    bad = []
    for path in sorted((PKG / "localize" / "capture").rglob("*.py")):
        for module, name, line in imports(path):
            if (
                room_of(module) == "base"
                or module.startswith("dmlib.localize.capture")
                or module.startswith(CAPTURE_MAY_IMPORT)
            ):
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: {module}" + (f".{name}" if name else ""))
    assert not bad, "the capture imports above itself:\n" + "\n".join(bad)
