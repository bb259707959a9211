"""A run saved under other names is never compared as nothing.

The case: a small model's runs saved by safetensors (``fc.weight``...) and a control saved by
``torch.save({"model": state_dict, "step": 3})`` (``model.fc.weight``...). Without a
rename, ``matrix``, ``ladder``, ``report --run`` and the library refuse the pair (exit 2,
naming the rename that pairs them); with ``--rename seed1:model.=`` the numbers equal
numpy's, computed here from the saved arrays.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dmlib.errors import DmlibError
from dmlib.stats.matrix import matrix_records, pair_problem, run_renames
from dmlib.tensor import ArrayTensorSet

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

RENAME = "seed1:model.="


def _state(seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {
        "fc.weight": g.standard_normal((8, 4)).astype(np.float32),
        "fc.bias": g.standard_normal(8).astype(np.float32),
        "out.weight": g.standard_normal((2, 8)).astype(np.float32),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("renamed_runs")
    base = _state(0)
    rep = {k: v.copy() for k, v in base.items()}
    rep["fc.weight"][1, 2] = np.nextafter(rep["fc.weight"][1, 2], np.float32(np.inf))
    seed1 = _state(1)
    safetensors_torch.save_file({k: torch.from_numpy(v) for k, v in base.items()}, d / "base.st")
    safetensors_torch.save_file({k: torch.from_numpy(v) for k, v in rep.items()}, d / "rep.st")
    torch.save({"model": {k: torch.from_numpy(v) for k, v in seed1.items()}, "step": 3}, d / "s.pt")
    return {"base": d / "base.st", "rep": d / "rep.st", "seed1": d / "s.pt"}


def _dmlib(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run(
        [sys.executable, "-m", "dmlib", *args], capture_output=True, text=True, env=env, cwd=cwd
    )


def _rel_fro(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a64 - b64) / np.linalg.norm(a64))


def _args(runs: dict[str, Path]) -> list[str]:
    return [f"{k}={v}" for k, v in runs.items()]


def test_matrix_refuses_a_control_under_other_names(runs):
    r = _dmlib("matrix", *_args(runs), "--control", "seed1")
    assert r.returncode == 2, r.stdout
    assert r.stdout == ""  # no table, no verdict: nothing of a comparison is printed
    assert "share no tensor name" in r.stderr
    assert f"--rename {RENAME}" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_matrix_with_rename_equals_numpy(runs):
    r = _dmlib("matrix", *_args(runs), "--control", "seed1", "--rename", RENAME, "--json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    pairs = {f"{p['a']}/{p['b']}": p for p in doc["verdict"]["pairs"]}
    base, seed1 = _state(0), _state(1)
    rep = {k: v.copy() for k, v in base.items()}
    rep["fc.weight"][1, 2] = np.nextafter(rep["fc.weight"][1, 2], np.float32(np.inf))
    numel = sum(v.size for v in base.values())
    assert pairs["base/seed1"]["numel"] == numel
    assert pairs["base/seed1"]["n_diff"] == sum(int((base[k] != seed1[k]).sum()) for k in base)
    worst = max(_rel_fro(base[k], seed1[k]) for k in base)
    assert pairs["base/seed1"]["worst_rel_fro"] == pytest.approx(worst, rel=1e-12)
    assert pairs["base/rep"]["n_diff"] == 1 and pairs["base/rep"]["max_ulp"] == 1
    same = _rel_fro(base["fc.weight"], rep["fc.weight"])
    # the control's rel_fro is the least over its pairs; rep/seed1 differs from base/seed1
    ctrl = min(worst, max(_rel_fro(rep[k], seed1[k]) for k in base))
    assert doc["verdict"]["separation_orders"] == pytest.approx(np.log10(ctrl / same), rel=1e-9)


def test_library_refuses_and_renames(runs):
    with pytest.raises(DmlibError, match=r"--rename seed1:model\.="):
        matrix_records({k: str(v) for k, v in runs.items()}, control="seed1")
    rows, attrs = matrix_records(
        {k: str(v) for k, v in runs.items()}, control="seed1", rename={"seed1": "model.="}
    )
    assert {r["name"] for r in rows if r["b"] == "seed1"} == set(_state(0))
    assert attrs["verdict"]["control_rel_fro"] is not None


def test_rename_errors():
    with pytest.raises(DmlibError, match="no run is labelled 'other'"):
        run_renames(["other:model.="], ["a", "b"])
    with pytest.raises(DmlibError, match="RUN:OLD=NEW"):
        run_renames(["seed1"], ["seed1"])
    assert str(run_renames({"b": ["model.=", "re:/=."]}, ["a", "b"])["b"][1]) == "a:re:/=."


def test_pair_problems_by_kind():
    a = ArrayTensorSet({"x": np.zeros(3, np.float32), "y": np.zeros(2, np.float32)})
    shape = ArrayTensorSet({"x": np.zeros(4, np.float32)})
    assert pair_problem("a", a, "b", shape)["kind"] == "nothing_comparable"
    empty = ArrayTensorSet({})
    assert pair_problem("a", a, "b", empty)["kind"] == "no_shared_name"
    few = ArrayTensorSet(
        {"x": np.zeros(3, np.float32), "m.x": np.zeros(3, np.float32), "m.y": np.zeros(2, "f4")}
    )
    p = pair_problem("a", a, "b", few)
    assert p["kind"] == "few_shared" and p["rename"] == ["b:m.="]
    assert pair_problem("a", a, "b", a) is None


def _save_ladder(d: Path) -> dict[int, dict[str, np.ndarray]]:
    """A folder of safetensors files a/ and a folder of torch saves b/ (under ``model.``)."""
    (d / "a").mkdir()
    (d / "b").mkdir()
    states = {}
    for step in (10, 20):
        sa = _state(step)
        sb = {k: v.copy() for k, v in sa.items()}
        if step == 20:
            sb["out.weight"][0, 0] += np.float32(0.5)
        t = {k: torch.from_numpy(v) for k, v in sa.items()}
        safetensors_torch.save_file(t, d / "a" / f"model_{step}.safetensors")
        torch.save({"model": {k: torch.from_numpy(v) for k, v in sb.items()}, "step": step},
                   d / "b" / f"ckpt-{step}.pt")  # fmt: skip
        states[step] = {"a": sa, "b": sb}
    return states


def test_ladder_folders_refuse_then_rename(tmp_path):
    states = _save_ladder(tmp_path)
    a, b = f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}"
    r = _dmlib("ladder", a, b)
    assert r.returncode == 2 and "--rename b:model.=" in r.stderr, r.stderr
    r = _dmlib("ladder", a, b, "--rename", "b:model.=", "--json")
    assert r.returncode == 1, r.stderr
    doc = json.loads(r.stdout)
    got = {(row["step"], row["name"]): row for row in doc["rows"]}
    assert {s for s, _ in got} == {10, 20}  # the steps from the file names and records
    for step, st in states.items():
        for name in st["a"]:
            want = _rel_fro(st["a"][name], st["b"][name])
            assert got[(step, name)]["rel_fro"] == pytest.approx(want, rel=1e-12, abs=0)
    assert got[(20, "out.weight")]["n_diff"] == 1 and got[(10, "out.weight")]["n_diff"] == 0


def test_ladder_folder_without_checkpoints_says_what_it_looked_for(tmp_path):
    _save_ladder(tmp_path)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not a checkpoint")
    r = _dmlib("ladder", f"a={tmp_path / 'a'}", f"c={tmp_path / 'empty'}")
    assert r.returncode == 2
    for what in ("checkpoint-N/", "Orbax", "notes.txt"):
        assert what in r.stderr


def test_report_run_refuses_then_renames(runs, tmp_path):
    args = ["report", *[f"--run={x}" for x in _args(runs)], "--control", "seed1"]
    r = _dmlib(*args, "--out", str(tmp_path / "r1"))
    assert r.returncode == 2 and f"--rename {RENAME}" in r.stderr, r.stderr
    assert not (tmp_path / "r1").exists()
    r = _dmlib(
        "report", f"--run=base={runs['base']}", "--rename", RENAME, "--out", str(tmp_path / "r2")
    )
    assert r.returncode == 2 and "no run is labelled 'seed1'" in r.stderr


def test_study_init_writes_the_guessed_names(runs, tmp_path):
    out = tmp_path / "study.toml"
    r = _dmlib("study", "init", *[f"--run={x}" for x in _args(runs)], "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "share no tensor name" in r.stderr  # said aloud
    from dmlib.report.build import check_run_names
    from dmlib.report.study import load_study

    study = load_study(out)
    assert study.names == {"seed1": ["model.="]}
    assert check_run_names(study) == []  # the study now pairs every run


@pytest.mark.slow  # transformers imported in the test and in the command
def test_ladder_folder_of_save_pretrained_folders(tmp_path):
    """A folder of save_pretrained folders (one per step, named stepN) is a run's ladder."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=8)
    for run in ("a", "b"):
        for step in (10, 20):
            torch.manual_seed(step)
            m = transformers.GPT2LMHeadModel(cfg)
            if run == "b" and step == 20:  # one element planted: the only difference
                with torch.no_grad():
                    m.transformer.wte.weight[0, 0] += 1
            m.save_pretrained(tmp_path / run / f"step{step}")
    r = _dmlib("ladder", f"a={tmp_path / 'a'}", f"b={tmp_path / 'b'}", "--json")
    assert r.returncode == 1, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert {row["step"] for row in rows} == {10, 20}
    differing = {(row["step"], row["name"]): row["n_diff"] for row in rows if row["n_diff"]}
    assert differing == {(20, "transformer.wte.weight"): 1}


@pytest.mark.slow  # a notebook kernel
def test_report_run_with_rename_quotes_numpy_numbers(runs, tmp_path):
    pytest.importorskip("nbclient")
    out = tmp_path / "report"
    r = _dmlib("report", *[f"--run={x}" for x in _args(runs)], "--control", "seed1",
               "--rename", RENAME, "--only", "run_matrix", "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    numbers = json.loads((out / "numbers" / "run_matrix.json").read_text())
    base, seed1 = _state(0), _state(1)
    rep = {k: v.copy() for k, v in base.items()}
    rep["fc.weight"][1, 2] = np.nextafter(rep["fc.weight"][1, 2], np.float32(np.inf))
    worst = numbers["worst_rel_fro"]
    assert worst["base/seed1"] == pytest.approx(max(_rel_fro(base[k], seed1[k]) for k in base))
    assert worst["base/rep"] == pytest.approx(_rel_fro(base["fc.weight"], rep["fc.weight"]))
    assert "by at least -" not in numbers["finding"]


def test_matrix_of_lone_npy_files_compares_their_arrays(tmp_path):
    """Each .npy holds one array named after its file: the matrix compares them (as compare
    pairs two), never refuses them as sharing no name, nor passes them as comparing nothing."""
    g = np.random.default_rng(3)
    x = g.standard_normal(50).astype(np.float32)
    y = x.copy()
    y[[3, 7]] += np.float32(1e-3)
    np.save(tmp_path / "first.npy", x)
    np.save(tmp_path / "second.npy", y)
    np.save(tmp_path / "third.npy", x)
    r = _dmlib("matrix", f"a={tmp_path / 'first.npy'}", f"b={tmp_path / 'second.npy'}",
               f"c={tmp_path / 'third.npy'}", "--json")  # fmt: skip
    assert r.returncode == 1, r.stderr
    pairs = {f"{p['a']}/{p['b']}": p for p in json.loads(r.stdout)["verdict"]["pairs"]}
    assert pairs["a/b"]["n_diff"] == int((x != y).sum()) == 2
    assert pairs["a/b"]["worst_rel_fro"] == pytest.approx(_rel_fro(x, y), rel=1e-12)
    assert pairs["a/c"]["identical"] and pairs["a/c"]["numel"] == 50


def test_matrix_says_aloud_when_a_pair_shares_few_names(tmp_path):
    """One name shared of four: the pair compares that one, and the command says which
    rename would pair the other three, before the verdict; never bit-identical."""
    from safetensors.numpy import save_file

    x = {n: np.full(3, float(i), np.float32) + np.arange(3, dtype=np.float32)
         for i, n in enumerate(["a.w", "a.b", "a.c", "x"])}  # fmt: skip
    save_file(x, str(tmp_path / "base.safetensors"))
    save_file({("x" if n == "x" else "m." + n): v for n, v in x.items()},
              str(tmp_path / "other.safetensors"))  # fmt: skip
    r = _dmlib("matrix", f"base={tmp_path / 'base.safetensors'}",
               f"other={tmp_path / 'other.safetensors'}")  # fmt: skip
    assert r.returncode == 1, r.stderr
    warn = [ln for ln in r.stdout.splitlines() if ln.startswith("warning:")]
    assert len(warn) == 1 and "share only 1 tensor name;" in warn[0]
    assert "--rename other:m.=" in warn[0]
    assert "bit-identical pairs: none" in r.stdout
