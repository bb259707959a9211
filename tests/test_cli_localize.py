"""``dmlib localize`` in-process: exit codes, table, verdict and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmlib.cli import main

DATA = Path(__file__).resolve().parent.parent / "data" / "packed"


@pytest.fixture
def d():
    if not (DATA / "index.json").is_file():
        pytest.skip(f"{DATA} not present")
    return DATA


def test_divergent_exit_1_with_verdict(d, capsys):
    rc = main(["localize", str(d / "alone"), str(d / "packed"), "--request", "probe",
               "--repeat", str(d / "alone_repeat"), str(d / "packed_repeat"), "--negative", str(d / "different")])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1
    assert "first divergent boundary: encoder.layer.0.attention.self" in out
    assert (
        "repeat control: held" in out and "negative control: passed" in out and "valid: True" in out
    )
    assert out.splitlines()[1].split()[:2] == ["boundary", "role"]


def test_identical_exit_0(d, capsys):
    assert main(["localize", str(d / "alone"), str(d / "packed_unpadded")]) == 0
    assert "identical: all" in capsys.readouterr().out


def test_failed_repeat_control_exit_1(d, capsys):
    assert (
        main(
            [
                "localize",
                str(d / "alone"),
                str(d / "packed_unpadded"),
                "--repeat",
                str(d / "different"),
            ]
        )
        == 1
    )
    assert "repeat control: FAILED" in capsys.readouterr().out


def test_json(d, capsys):
    assert main(["localize", str(d / "alone"), str(d / "padded"), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["attrs"]["first_divergent_boundary"] == "encoder.layer.0.attention.self"
    row = next(r for r in doc["rows"] if r["boundary"] == "encoder.layer.0.attention.self")
    columns = {"identical", "n_diff", "max_abs", "rel_fro", "diff_blocks", "new_blocks", "role"}
    assert columns <= set(row)
    assert row["identical"] is False and row["role"] == "culprit"


def test_bad_input_exit_2(tmp_path, capsys):
    assert main(["localize", str(tmp_path), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(tmp_path) in err and "manifest.json" in err
