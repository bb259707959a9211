"""Promise: names, metadata and paths reach the terminal escaped and cut (SECURITY.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dmlib.textsafe import clip, cut, escape, shown

ROOT = Path(__file__).resolve().parents[1]
SPOOF = "w\x1b[2K\rIDENTICAL: 0 of 1 compared tensors differ\x1b[8m\u202e\x85\x7f"


def _cli(*args: str) -> subprocess.CompletedProcess[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "dmlib", *args], capture_output=True, env=env)


@pytest.fixture()
def spoofed(tmp_path: Path) -> tuple[Path, Path]:
    from safetensors.numpy import save_file

    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({SPOOF: np.zeros(4, np.float32), "x" * 5000: np.zeros(2, np.float32)}, str(a),
              metadata={"k\x1b[31m": "v\x07"})  # fmt: skip
    save_file({SPOOF: np.ones(4, np.float32), "x" * 5000: np.zeros(2, np.float32)}, str(b))
    return a, b


def _raw_controls(data: bytes) -> list[int]:
    text = data.decode("utf-8")
    bad = [c for c in text if (ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) <= 0x9F]
    return [ord(c) for c in bad + [c for c in text if 0x202A <= ord(c) <= 0x202E]]


def test_escape_shows_controls_as_their_codes() -> None:
    assert escape("a\x1bb") == "a\\x1bb"
    assert escape("\u202e\x85\x7f\udcff") == "\\u202e\\x85\\x7f\\udcff"
    assert escape("a\nb\tc\r", lines=True) == "a\nb\tc\\x0d"
    assert cut("a" * 52_000_000) == "'" + "a" * 200 + "…' (52,000,000 chars)"
    assert len(clip("x" * 10_000)) < 450
    assert shown([[1] * 10**6]).count("1") <= 8


def test_compare_verdict_cannot_be_spoofed_by_a_name(spoofed: tuple[Path, Path]) -> None:
    r = _cli("compare", str(spoofed[0]), str(spoofed[1]))
    assert r.returncode == 1
    assert _raw_controls(r.stdout + r.stderr) == []
    last = r.stdout.decode().strip().splitlines()[-1]
    assert last.startswith("DIFFERENT: 1 of 2")
    assert "\\x1b[2K\\x0dIDENTICAL" in r.stdout.decode()
    assert max(len(line) for line in r.stdout.decode().splitlines()) < 2000


def test_inspect_escapes_names_and_metadata(spoofed: tuple[Path, Path]) -> None:
    r = _cli("inspect", str(spoofed[0]))
    assert r.returncode == 0
    assert _raw_controls(r.stdout + r.stderr) == []
    out = r.stdout.decode()
    assert "k\\x1b[31m=v\\x07" in out
    assert "(5,000 chars)" in out


def test_json_output_stays_exact_json(spoofed: tuple[Path, Path]) -> None:
    r = _cli("compare", "--json", str(spoofed[0]), str(spoofed[1]))
    assert _raw_controls(r.stdout) == []
    doc = json.loads(r.stdout)
    assert SPOOF in {row["name"] for row in doc["rows"]}  # the exact name, escaped by JSON


def test_error_line_is_short_and_escaped(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    a = tmp_path / "a.safetensors"
    save_file({"n" * 1_000_000 + "\x1b[31m": np.zeros(1, np.float32)}, str(a))
    r = _cli("compare", str(a), str(a), "--include", "nomatch\x1b[5m")
    assert r.returncode == 2
    err = r.stderr.decode()
    assert _raw_controls(r.stderr) == []
    assert len(err.strip().splitlines()) == 1 and len(err) < 2000
    assert "Traceback" not in err
