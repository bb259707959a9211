"""The step_growth notebook's sections (dmlib.report.sections_ladder) on a ladder written
by hand: reference ``r``, its repeat ``rep`` (identical at every step) and ``x``, equal
to ``r`` at step 1 and one float32 ULP off in one element of ``w`` at step 2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _support.st_writer import write_f32

from dmlib import report
from dmlib.report import sections_ladder as sections

W = {1: np.array([3.0, 4.0], dtype=np.float32), 2: np.array([6.0, 8.0], dtype=np.float32)}
B = np.array([0.01], dtype=np.float32)  # Frobenius norm 0.01: small-norm below 0.1


def _write(path: Path, tensors: dict[str, np.ndarray], step: int) -> None:
    write_f32(path, tensors, {"step": str(step)})


@pytest.fixture()
def study(tmp_path: Path):
    for run in ("r", "rep", "x"):
        folder = tmp_path / run
        folder.mkdir()
        for step, w in W.items():
            if run == "x" and step == 2:
                w = w.copy()
                w[1] = np.nextafter(w[1], np.float32(100))
            _write(folder / f"ckpt-{step:04d}.safetensors", {"w": w, "b": B}, step)
    (tmp_path / "study.toml").write_text(
        'title = "ladder"\nreference = "r"\n\n[runs]\nr = "r/"\nrep = "rep/"\nx = "x/"\n\n'
        '[repeats]\nrep = "r"\n'
    )
    report.configure(figure_dir=tmp_path / "stage" / "figures", notebook="ladder_test")
    yield report.load_study(tmp_path / "study.toml")
    report.configure(figure_dir=Path("reports") / "figures", notebook="notebook")


def test_ladder_sections_hand_computed(study):
    sg = sections.ladder_runs(study)
    assert list(sg.ladder) == ["r", "rep", "x"] and sg.repeat_of == {"rep": "r"}
    checks = sections.check(sg)
    assert len(checks) == 6 and set(checks["status"]) == {"ok"}
    top = sections.divergence(sg, 0.1)
    assert sg.small == ["b"]
    assert set(top["pair"]) == {"r/rep", "r/x"}
    sections.growth_grid(sg)
    sections.rates(sg)
    last = sections.ladder_finding(sg)
    n = report.load_numbers(report.numbers_path())
    assert n["runs"] == ["r", "rep", "x"] and n["reference"] == "r"
    assert n["n_checkpoints"] == 6 and n["n_flagged"] == 0 and n["max_verified_step"] == 2
    assert n["small_norm"] == ["b"] and n["last_step"] == 2
    assert n["repeat_n_diff"] == {"r/rep": 0}
    # step 2: w = [6, 8] against [6, 8 + ulp(8)], ulp(8) = 2**-20 in float32; ||w|| = 10
    assert n["max_rel_fro_by_pair_and_step"]["r/x@2"] == pytest.approx(2.0**-20 / 10, rel=1e-9)
    assert n["max_rel_fro_by_pair_and_step"]["r/x@1"] == 0.0
    assert n["top_mover_at_last_step"] == {"r/x": "w"}
    assert list(last.loc[last["pair"].eq("r/x"), "name"])[0] == "w"
    assert (report.figure_dir() / "step_growth_rel_fro.png").stat().st_size > 1000
    assert n["max_rel_fro_by_pair_and_step"]["r/rep@2"] == 0.0  # the repeat is bit-identical


def test_one_ladder_is_skipped(study, tmp_path):
    text = (tmp_path / "study.toml").read_text()
    (tmp_path / "study.toml").write_text(
        text.replace('rep = "rep/"\nx = "x/"\n', "").replace('[repeats]\nrep = "r"\n', "")
    )
    sg = sections.ladder_runs(report.load_study(tmp_path / "study.toml"))
    assert sections.divergence(sg) is None and sections.growth_grid(sg) is None
    assert sections.rates(sg) is None and sections.ladder_finding(sg) is None
    sections.conclude(sg)
    skipped = report.load_numbers(report.numbers_path())["skipped"]
    assert skipped == ["only one run has a step ladder: nothing to compare it with"]
