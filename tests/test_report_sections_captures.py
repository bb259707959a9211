"""The capture_boundaries notebook's sections (dmlib.report.sections_captures) on the
lab's packed study, checked against dmlib.compare_captures called directly."""

from __future__ import annotations

from pathlib import Path

import pytest

from dmlib import report
from dmlib.localize.boundaries import compare_captures
from dmlib.report import sections_captures as sections

STUDY = Path(__file__).resolve().parents[1] / "data" / "packed" / "study.toml"


@pytest.fixture()
def study(tmp_path: Path):
    if not STUDY.is_file():
        pytest.skip("the lab's packed captures are not in this checkout")
    report.configure(figure_dir=tmp_path / "stage" / "figures", notebook="captures_test")
    yield report.load_study(STUDY)
    report.configure(figure_dir=Path("reports") / "figures", notebook="notebook")


def test_capture_sections_match_compare_captures(study):
    cap = study.captures
    other = next(k for k in cap.folders if k != cap.reference)
    reps = tuple(cap.repeats[x] for x in (cap.reference, other) if x in cap.repeats)
    direct = compare_captures(
        cap.folders[cap.reference], cap.folders[other], request=cap.request,
        repeat=reps if cap.reference in cap.repeats else None, negative=cap.negative,
    )  # fmt: skip
    cb, summary = sections.captures(study)
    assert cb.main_label == f"{cap.reference} vs {other}"
    for key in sections.SUMMARY_KEYS:
        assert summary.loc[cb.main_label, key] == direct.attrs[key], key
    table = sections.culprit(cb)
    n = report.load_numbers(report.numbers_path())
    assert n["reference"] == cap.reference
    assert n["culprit"] == direct.attrs["culprit"]
    assert n["n_divergent"] == direct.attrs["n_divergent"]
    assert n["negative_control_passed"] == direct.attrs["negative_control"]["passed"]
    assert direct.attrs["culprit"] in set(table["boundary"])
    assert set(table["role"]) >= {"culprit"}
    sections.block_heatmap(cb)
    assert (report.figure_dir() / "captures_block_heatmap.png").stat().st_size > 1000
    assert cb.lines and n["finding"]
