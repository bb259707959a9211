"""Each notebook's sections on a study without the data the notebook reads: one line saying
what is missing and how to add it, no exception, no finding, and every later cell empty.

The studies are written here: one checkpoint alone (no second run, no step ladder, no
factor groups, no captures), two runs whose factor groups match no tensor, and the lab's
captures-only study (no checkpoint at all)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _support.st_writer import write_f32

from dmlib import report
from dmlib.report import prose, sections, sections_captures, sections_files, sections_ladder

PACKED = Path(__file__).resolve().parents[1] / "data" / "packed" / "study.toml"


@pytest.fixture()
def stage(tmp_path: Path):
    report.configure(figure_dir=tmp_path / "stage" / "figures", notebook="missing_test")
    yield tmp_path
    report.configure(figure_dir=Path("reports") / "figures", notebook="notebook")


def _one_run(root: Path) -> object:
    write_f32(root / "a.safetensors", {"w": np.array([1.0, 2.0], dtype=np.float32)})
    (root / "study.toml").write_text('title = "one run"\n\n[runs]\na = "a.safetensors"\n')
    return report.load_study(root / "study.toml")


def _said(capsys: pytest.CaptureFixture[str]) -> tuple[dict, list[str]]:
    """The numbers recorded and the non-empty lines printed (outside a kernel, say and skip print)."""
    out = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    return report.load_numbers(report.numbers_path()), out


def _one_skip(capsys, expected: str) -> None:
    numbers, out = _said(capsys)
    assert numbers["skipped"] == [expected]
    assert "finding" not in numbers and "figures" not in numbers
    assert out == [f"> *Skipped: {report.md_text(expected)}*"]


def test_capture_sections_without_captures(stage, capsys):
    study = _one_run(stage)
    cb, summary = sections_captures.captures(study)
    assert summary is None and cb.empty
    for cell in (sections_captures.boundary_profile, sections_captures.block_heatmap,
                 sections_captures.culprit, sections_captures.op_level):  # fmt: skip
        assert cell(cb) is None
    sections_captures.conclude(cb)
    _one_skip(capsys, prose.NO_CAPTURES_HERE)
    assert "[captures]" in prose.NO_CAPTURES_HERE and "dmlib.capture" in prose.NO_CAPTURES_HERE


def test_ladder_sections_without_a_ladder(stage, capsys):
    study = _one_run(stage)
    sg = sections_ladder.ladder_runs(study)
    assert sg.empty
    for cell in (sections_ladder.check, sections_ladder.divergence, sections_ladder.growth_grid,
                 sections_ladder.rates, sections_ladder.ladder_finding):  # fmt: skip
        assert cell(sg) is None
    sections_ladder.conclude(sg)
    _one_skip(capsys, prose.NO_LADDER_HERE)


@pytest.mark.parametrize("cells", ["run_matrix", "ulp_distributions"])
def test_matrix_sections_with_one_run(stage, capsys, cells):
    study = _one_run(stage)
    mx = sections.study_matrix(study)
    assert mx.empty
    if cells == "run_matrix":
        chain = (sections.runs_table, sections.worst_rel_fro, sections.matrix_heatmap,
                 sections.matrix_finding, sections.effective_weights)  # fmt: skip
    else:
        chain = (sections.runs_table, sections.pairs_table, sections.ulp_histogram,
                 sections.top_differing)  # fmt: skip
    for cell in chain:
        assert cell(mx) is None
    sections.conclude(mx)
    _one_skip(capsys, prose.FEWER_THAN_TWO_RUNS_HERE)


def test_column_sections_without_factor_groups(stage, capsys):
    study = _one_run(stage)
    qc = sections_files.column_runs(study)
    assert sections_files.first_columns(qc) is None
    assert sections_files.column_histogram(qc) is None
    sections_files.conclude(qc)
    _one_skip(capsys, prose.NO_FACTOR_GROUPS_HERE)


def test_column_sections_when_no_tensor_matches_the_factor_groups(stage, capsys):
    # two runs holding "w" only, factor groups naming "{prefix}.u" etc.: nothing to compare,
    # which must not read as "all 0 factor-tensor pairs are bit-identical"
    for k, v in (("a", 1.0), ("b", 2.0)):
        write_f32(stage / f"{k}.safetensors", {"w": np.array([v], dtype=np.float32)})
    (stage / "study.toml").write_text(
        'title = "t"\n\n[runs]\na = "a.safetensors"\nb = "b.safetensors"\n\n'
        '[[factor_groups]]\nkind = "svd"\nu = "{prefix}.u"\ns = "{prefix}.s"\nv = "{prefix}.v"\n'
    )
    qc = sections_files.column_runs(report.load_study(stage / "study.toml"))
    capsys.readouterr()  # the sentence naming the runs
    assert sections_files.first_columns(qc) is None
    assert sections_files.column_histogram(qc) is None
    sections_files.conclude(qc)
    expected = prose.no_factor_tensors(["*.u", "*.v"], ["a", "b"])
    _one_skip(capsys, expected)
    assert "bit-identical" not in expected and "nothing was compared" in expected


def test_anatomy_sections_without_a_checkpoint(stage, capsys):
    if not PACKED.is_file():
        pytest.skip(f"the lab's captures-only study is absent: {PACKED} not found")
    study = report.load_study(PACKED)
    an = sections_files.anatomy_files(study)
    for cell in (sections_files.census, sections_files.tensors, sections_files.same_names):
        assert cell(an) is None
    sections_files.conclude(an)
    _one_skip(capsys, prose.NO_CHECKPOINT_HERE)
