"""The README's capture example runs as written, and says what it claims."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

README = Path(__file__).resolve().parent.parent / "README.md"


def test_capture_example_runs(tmp_path, monkeypatch, capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    # the runnable example: captures two layouts and compares them (other blocks are fragments)
    (code,) = [b for b in blocks if "dmlib.capture(" in b and "compare_captures(" in b]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1] in ("identical", "different", "inconclusive")
    assert (tmp_path / "captures" / "packed" / "manifest.json").is_file()
    import dmlib

    df = dmlib.compare_captures(
        tmp_path / "captures/alone", tmp_path / "captures/packed", request="probe"
    )
    rows = df.set_index("boundary")
    # the head's rows are attributed per sequence (batch row 0 alone, row 1 packed)
    assert "batch row 0 vs 1" in rows.loc["head", "note"] and df.attrs["unjudged"] == []
