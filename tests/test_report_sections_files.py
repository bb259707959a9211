"""The anatomy and column notebooks' sections (dmlib.report.sections_files) on small
studies written by hand; every expected value follows from the arrays written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _support.st_writer import write_f32

from dmlib import report
from dmlib.io.burnpack import write_burnpack
from dmlib.report import sections_files as sections


def _write(path: Path, tensors: dict[str, np.ndarray], meta: dict[str, str] | None = None) -> None:
    write_f32(path, tensors, meta)


@pytest.fixture()
def stage(tmp_path: Path) -> Path:
    report.configure(figure_dir=tmp_path / "stage" / "figures", notebook="sections_files_test")
    yield tmp_path
    report.configure(figure_dir=Path("reports") / "figures", notebook="notebook")


def _numbers() -> dict:
    return report.load_numbers(report.numbers_path())


# ---------------------------------------------------------------------------
# qr_first_divergent_column


U = np.arange(12, dtype=np.float32).reshape(4, 3) + 1
V = np.arange(12, dtype=np.float32).reshape(4, 3) + 20
S = np.array([3.0, 2.0, 1.0], dtype=np.float32)


def _columns_lab(root: Path) -> Path:
    u2 = U.copy()
    u2[0, 2] = np.nextafter(u2[0, 2], np.float32(100))  # column 2 moves one ULP
    v3 = V.copy()
    v3[:, 1] = -v3[:, 1]  # column 1 negated
    runs = {
        "p1": {"l.u": U, "l.s": S, "l.v": V},
        "p2": {"l.u": u2, "l.s": S, "l.v": V},
        "p3": {"l.u": U, "l.s": S, "l.v": v3},
        "ctrl": {"l.u": U * 2, "l.s": S, "l.v": V * 2},
    }
    for k, t in runs.items():
        _write(root / f"{k}.safetensors", t)
    (root / "study.toml").write_text(
        'title = "columns"\ncontrol = "ctrl"\n\n[runs]\n'
        + "".join(f'{k} = "{k}.safetensors"\n' for k in runs)
        + '\n[[factor_groups]]\nkind = "svd"\nu = "{prefix}.u"\ns = "{prefix}.s"\nv = "{prefix}.v"\n'
    )
    return root / "study.toml"


def test_columns_sections_hand_computed(stage):
    study = report.load_study(_columns_lab(stage))
    qc = sections.column_runs(study)
    assert qc.runs == ["p1", "p2", "p3"] and qc.patterns == ["*.u", "*.v"]
    summary = sections.first_columns(qc)
    # p1/p2: u first differs at column 2, v identical; p1/p3: u identical, v at column 1;
    # p2/p3: u at 2, v at 1 -> 6 tensor pairs, 2 identical, columns [2, 1, 2, 1]
    assert summary["n_pairs"] == 6 and summary["n_identical"] == 2
    assert summary["first_col_min"] == 1 and summary["first_col_max"] == 2
    assert summary["first_col_median"] == 1.5
    table = sections.column_histogram(qc)
    assert table.loc["p1/p2", "earliest_col"] == 2 and table.loc["p2/p3", "earliest_col"] == 1
    assert list(table["identical"]) == [1, 1, 0]
    n = _numbers()
    assert n["runs"] == ["p1", "p2", "p3"] and n["factor_patterns"] == ["*.u", "*.v"]
    # the negated column of v in p1/p3 and p2/p3: two flips among four changed columns
    assert n["n_flipped"] == 2 and n["n_changed_columns"] == 4
    assert "1..2" in n["finding"]
    assert (report.figure_dir() / "first_divergent_column.png").stat().st_size > 1000


def test_columns_skipped_with_one_run(stage):
    path = _columns_lab(stage)
    text = path.read_text()
    path.write_text(text.replace('p2 = "p2.safetensors"\np3 = "p3.safetensors"\n', ""))
    qc = sections.column_runs(report.load_study(path))
    assert sections.first_columns(qc) is None and sections.column_histogram(qc) is None
    assert _numbers()["skipped"] == [
        "fewer than two runs besides the control: no pair to compare column by column; "
        "add a run to [runs] in the study.toml"
    ]
    sections.conclude(qc)  # no lines: says nothing, raises nothing


# ---------------------------------------------------------------------------
# checkpoint_anatomy


def test_anatomy_same_names_in_different_files(stage):
    t = {"w": np.array([1.0, 2.0, 3.0], dtype=np.float32)}
    _write(stage / "a.safetensors", t, {"writer": "one"})
    _write(stage / "b.safetensors", t, {"writer": "two"})
    (stage / "study.toml").write_text(
        'title = "anatomy"\n\n[runs]\na = "a.safetensors"\n\n'
        '[anatomy]\nfiles = ["a.safetensors", "b.safetensors"]\n'
    )
    an = sections.anatomy_files(report.load_study(stage / "study.toml"))
    table = sections.census(an)
    assert list(table["file"]) == ["a.safetensors", "b.safetensors"]
    assert list(table["format"]) == ["safetensors"] * 2 and list(table["tensors"]) == [1, 1]
    assert list(table["bytes"]) == [
        (stage / f).stat().st_size for f in ("a.safetensors", "b.safetensors")
    ]
    shown = sections.tensors(an)
    assert shown.to_dict("records") == [
        {"file": f, "name": "w", "dtype": "float32", "shape": [3], "nbytes": 12}
        for f in ("a.safetensors", "b.safetensors")
    ]
    facts = sections.same_names(an)
    assert facts.to_dict("records") == [
        {"a": "a.safetensors", "b": "b.safetensors", "tensors": 1,
         "identical_tensors": True, "file_sha256_equal": False}
    ]  # fmt: skip
    n = _numbers()
    assert n["files"] == ["a.safetensors", "b.safetensors"] and n["slots"] == {}
    assert len(n["skipped"]) == 2 and all("safetensors file" in s for s in n["skipped"])
    assert n["finding"] == (
        "2 file(s) listed, none burnpack; 1 pair(s) hold identical tensors in different files."
    )


def test_anatomy_burnpack_padding(stage):
    tensors = {
        "a": np.array([1.0, 2.0, 3.0], dtype=np.float32),
        "b": np.array([4.0, 5.0], dtype=np.float32),
    }
    write_burnpack(stage / "m.bpk", tensors, pad_fill=lambda off, n: b"\xff" * n)
    (stage / "study.toml").write_text('title = "bpk"\n\n[runs]\nm = "m.bpk"\n')
    an = sections.anatomy_files(report.load_study(stage / "study.toml"))
    row = sections.census(an).iloc[0]
    assert row["format"] == "burnpack" and row["tensors"] == 2 and row["records"] == 1
    assert row["nonzero_gaps"] >= 1  # the gap after "a" is filled with 0xff
    (rec,) = _numbers()["slots"]["m.bpk"]
    assert rec["named_slots"] == 5  # 3 + 2 float32 elements
    # every 4-byte slot of 0xff bytes reads as a NaN
    assert rec["padding_nonzero_slots"] > 0 and rec["nan"] == rec["padding_nonzero_slots"]
    assert rec["flat_slots"] == rec["named_slots"] + rec["padding_slots"]
    for name in ("anatomy_layout_0", "anatomy_slots_0"):
        assert (report.figure_dir() / f"{name}.png").stat().st_size > 1000
    sections.same_names(an)
    assert _numbers()["finding"].startswith("1 burnpack file(s) mapped; 1 with non-zero padding")
