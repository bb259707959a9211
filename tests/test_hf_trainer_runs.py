"""Trainer output folders as runs: study init, study.toml, dmlib ladder and dmlib report.

The runs come from the session's real Trainer training (conftest ``hf_runs``); steps are
checked against each checkpoint's ``trainer_state.json`` read with json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dmlib.cli import main
from dmlib.report.study import load_study, resolve_runs
from dmlib.report.studyfile import init_from_folder

pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

pytestmark = pytest.mark.slow


def _global_steps(run: Path) -> dict[int, Path]:
    out = {}
    for ck in sorted(run.glob("checkpoint-*")):
        out[json.loads((ck / "trainer_state.json").read_text())["global_step"]] = ck
    return out


def test_study_init_on_a_folder_of_runs(hf_runs: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    shutil.copytree(hf_runs / "runs", runs)
    text = init_from_folder(runs)
    (runs / "study.toml").write_text(text)
    study = load_study(runs / "study.toml")
    assert sorted(study.runs) == sorted(p.name for p in runs.iterdir() if p.is_dir())
    for label, run in study.runs.items():
        want = _global_steps(runs / label)
        assert {s: p.resolve() for s, p in run.checkpoints.items()} == {
            s: p.resolve() for s, p in want.items()
        }
        assert set(run.step_source.values()) == {"recorded"}
    # the comment lines say what was recognised
    line = next(x for x in text.splitlines() if x.startswith("A = "))
    assert "a Trainer run" in line and "step ladder" in line


def test_one_run_folder_and_one_checkpoint_folder(hf_runs: Path, tmp_path: Path) -> None:
    run = tmp_path / "A"
    shutil.copytree(hf_runs / "runs" / "A", run)
    text = init_from_folder(run)
    assert 'A = "./"' in text and "a Trainer run" in text
    # a checkpoint-N/ folder is one checkpoint: its files never become steps
    ck = run / "checkpoint-4"
    runs = resolve_runs({"x": str(ck)}, tmp_path, tmp_path)
    assert list(runs["x"].checkpoints) == [4]
    text = init_from_folder(ck)
    assert "one checkpoint" in text and text.count(" = ") - text.count("#") < 3


def test_files_inside_checkpoints_take_the_recorded_step(hf_runs: Path) -> None:
    run = hf_runs / "runs" / "A"
    runs = resolve_runs({"m": "checkpoint-*/model.safetensors"}, run, run)
    want = {s: p / "model.safetensors" for s, p in _global_steps(run).items()}
    assert runs["m"].checkpoints == want
    assert set(runs["m"].step_source.values()) == {"trainer_state.json"}
    # a lone optimizer.pt records its step in its own state.*.step
    one = resolve_runs({"o": "checkpoint-6/optimizer.pt"}, run, run)
    assert list(one["o"].checkpoints) == [6]


def test_ladder_takes_run_folders(hf_runs: Path, capsys) -> None:
    runs = hf_runs / "runs"
    code = main(["ladder", f"A={runs / 'A'}", f"B={runs / 'B'}", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert sorted({c["step"] for c in doc["checks"]}) == sorted(_global_steps(runs / "A"))
    assert {c["status"] for c in doc["checks"]} == {"ok"}
    # the oracle: every tensor of every weights file equal between A and its repeat B
    same = all(
        all(
            (safetensors_numpy.load_file(a / "model.safetensors")[k]
             == safetensors_numpy.load_file(b / "model.safetensors")[k]).all()
            for k in safetensors_numpy.load_file(a / "model.safetensors")
        )
        for a, b in zip(_global_steps(runs / "A").values(), _global_steps(runs / "B").values(), strict=True)
    )  # fmt: skip
    weights = [
        r
        for r in doc["rows"]
        if not r["name"].startswith(("optimizer.", "rng.", "trainer.", "scheduler."))
    ]
    assert same == all(r["n_diff"] == 0 for r in weights)
    assert code in (0, 1)


def test_report_on_trainer_run_folders(hf_runs: Path, tmp_path: Path) -> None:
    pytest.importorskip("nbclient")
    runs = hf_runs / "runs"
    out = tmp_path / "report"
    code = main(
        ["report", "--run", f"A={runs / 'A'}", "--run", f"B={runs / 'B'}",
         "--run", f"G={runs / 'G'}", "--repeat", "B=A", "--out", str(out), "--jobs", "1"]
    )  # fmt: skip
    assert code == 0
    assert (out / "index.html").is_file() and (out / "report.html").is_file()
    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    text = json.dumps(summary)
    assert "FAILED" not in text
    resolved = (out / "study.toml").read_text(encoding="utf-8")
    assert "checkpoint-2" in resolved and "checkpoint-6" in resolved
