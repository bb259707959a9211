"""Help and tables fit ``COLUMNS``: every subcommand's ``--help`` at 80 columns has no line
longer than 80 (one paragraph was 1,085 characters on one line); a table wider than
``COLUMNS`` is split into blocks, each led by the row's name, every cell kept."""

from __future__ import annotations

import re

import pytest

from dmlib.cli import build_parser, main
from dmlib.cli._table import column_blocks, table
from tests._support.cli_argv import subcommands


def _nested() -> list[list[str]]:
    """Every command and sub-subcommand (``study init``, ``map suggest``...)."""
    import argparse

    out: list[list[str]] = [[]]
    for name, p in sorted(subcommands().items()):
        out.append([name])
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                out += [[name, sub] for sub in action.choices]
    return out


@pytest.mark.parametrize("argv", _nested(), ids=lambda a: " ".join(a) or "dmlib")
def test_help_fits_80_columns(argv, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as info:
        main([*argv, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    long = [line for line in out.splitlines() if len(line) > 80]
    assert not long, long[0]
    assert "exit status:" in out


def test_help_keeps_every_word(monkeypatch, capsys):
    """Wrapping moves words, it does not lose them: the description's words in order."""
    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    sub = subcommands()["compare"]
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    out = capsys.readouterr().out
    words = sub.description.split()
    got = out.split()
    start = got.index(words[0])
    assert got[start : start + len(words)] == words
    assert parser.prog == "dmlib"


def test_exit_status_rows_wrap_under_their_text(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "60")
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    out = capsys.readouterr().out
    tail = out[out.index("exit status:") :].splitlines()
    assert all(len(line) <= 60 for line in tail)
    # a continuation line starts under the text of its row, not under its code
    rows = [i for i, line in enumerate(tail) if re.match(r"  \d+  ", line)]
    for i in rows:
        code = re.match(r"  (\d+)  ", tail[i])
        assert code is not None
        if i + 1 < len(tail) and not re.match(r"  \d+  ", tail[i + 1]) and tail[i + 1].strip():
            assert tail[i + 1].startswith(" " * (4 + len(code.group(1))))


ROWS = [
    {"name": f"layers.{i}.attention.weight", **{f"col{j}": f"{i * j:012d}" for j in range(9)}}
    for i in range(4)
]
COLS = ["name", *(f"col{j}" for j in range(9))]


def test_table_is_one_block_without_a_width(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)  # stdout is captured here, not a terminal
    text = table(ROWS, COLS)
    assert len(text.splitlines()) == 1 + len(ROWS)
    assert max(map(len, text.splitlines())) > 80


def test_table_wraps_at_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    text = table(ROWS, COLS)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    blocks = [b.splitlines() for b in text.split("\n\n")]
    assert len(blocks) > 1
    seen: dict[str, dict[str, str]] = {}
    for block in blocks:
        header = block[0].split()
        assert header[0] == "name"  # every block led by the row's name
        for line in block[1:]:
            cells = line.split()
            seen.setdefault(cells[0], {}).update(zip(header[1:], cells[1:], strict=True))
    for r in ROWS:  # every cell once, in its row, under its column
        assert seen[r["name"]] == {c: r[c] for c in COLS[1:]}


def test_column_blocks_by_hand():
    assert column_blocks([4, 3, 3, 3], None) == [[0, 1, 2, 3]]
    assert column_blocks([4, 3, 3, 3], 16) == [[0, 1, 2], [0, 3]]  # 4+2+3+2+3 = 14
    assert column_blocks([4, 50, 3], 20) == [[0, 1], [0, 2]]  # too wide alone: still shown
    assert column_blocks([2, 2, 9, 9], 16, key=2) == [[0, 1, 2], [0, 1, 3]]
