"""The global relative L2 of groups of tensors along a step ladder (``--group-l2``).

Ground truth from a generator: per-step gradients built in numpy (the control's step-N
gradients, and a run whose adapter gradients carry a planted difference that doubles at
every step), saved as ``grad_step{N}.safetensors``; every expected figure is computed here
with numpy over the concatenated arrays as read back by safetensors' own reader, never by
dmlib. The lab dataset ``data/lora_steps`` is checked the same way through the README's
command.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

import dmlib
from dmlib.cli import main
from dmlib.errors import DmlibError

safetensors_numpy = pytest.importorskip("safetensors.numpy")

ROOT = Path(__file__).resolve().parent.parent
STEPS = [0, 1, 2, 3, 4]
FACTOR = 2.0  # the planted difference doubles at every step
SHAPES = {
    "m.l0.q.lora_A.weight": (4, 16), "m.l0.q.lora_B.weight": (16, 4),
    "m.l0.v.lora_A.weight": (4, 16), "m.l0.v.lora_B.weight": (16, 4),
    "m.l0.norm.weight": (16,), "m.l1.mlp.weight": (8, 16),
}  # fmt: skip
ADAPTER = [n for n in SHAPES if "lora_" in n]


def _oracle(a: dict[str, np.ndarray], b: dict[str, np.ndarray], names: list[str]) -> float:
    """||a - b|| / ||a|| over the named arrays concatenated, in float64."""
    x = np.concatenate([a[n].astype(np.float64).ravel() for n in names])
    y = np.concatenate([b[n].astype(np.float64).ravel() for n in names])
    return float(np.linalg.norm(x - y) / np.linalg.norm(x))


def _write_runs(root: Path, *, prefix: str = "") -> dict[str, Path]:
    """``ctl/`` and ``run/`` folders of grad_step{N}.safetensors (no recorded step: the
    ladder takes each file's step from its name). The run's adapter gradients differ from
    the control's by 1e-3 * FACTOR**N * D (D fixed); its other tensors are equal."""
    rng = np.random.default_rng(11)
    planted = {n: rng.standard_normal(SHAPES[n]) for n in ADAPTER}
    dirs = {"ctl": root / "ctl", "run": root / "run"}
    for d in dirs.values():
        d.mkdir(parents=True)
    for step in STEPS:
        ctl = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
        run = {
            prefix + n: (v + 1e-3 * FACTOR**step * planted[n]).astype(np.float32)
            if n in planted else v.copy()
            for n, v in ctl.items()
        }  # fmt: skip
        safetensors_numpy.save_file(ctl, dirs["ctl"] / f"grad_step{step}.safetensors")
        safetensors_numpy.save_file(run, dirs["run"] / f"grad_step{step}.safetensors")
    return dirs


def _read(folder: Path, step: int, prefix: str = "") -> dict[str, np.ndarray]:
    got = safetensors_numpy.load_file(folder / f"grad_step{step}.safetensors")
    return {n.removeprefix(prefix): v for n, v in got.items()}


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    return _write_runs(tmp_path)


def _ladder(dirs: dict[str, Path]) -> dict[str, dict[int, str]]:
    return {r: {s: str(d / f"grad_step{s}.safetensors") for s in STEPS} for r, d in dirs.items()}


def _expected(dirs: dict[str, Path], names: list[str], prefix: str = "") -> list[float]:
    return [_oracle(_read(dirs["ctl"], s), _read(dirs["run"], s, prefix), names) for s in STEPS]


def test_python_api_against_numpy_and_the_planted_growth(runs):
    groups = ["all", "adapter", "q=re:\\.q\\.", "mlp=*.mlp.*"]
    df = dmlib.step_ladder(_ladder(runs), group_l2=groups)
    rows = {(r["step"], r["group"]): r for r in df.attrs["group_l2"]}
    assert {g for _, g in rows} == {"all", "adapter", "q", "mlp"}
    q_names = [n for n in ADAPTER if ".q." in n]
    for label, names in (("all", list(SHAPES)), ("adapter", ADAPTER), ("q", q_names)):
        want = _expected(runs, names)
        got = [rows[(s, label)]["rel_l2"] for s in STEPS]
        assert got == pytest.approx(want, rel=1e-12)
        assert all(rows[(s, label)]["n_tensors"] == len(names) for s in STEPS)
        assert all(rows[(s, label)]["pair"] == "ctl/run" for s in STEPS)
        assert math.isnan(rows[(0, label)]["growth"])
        # growth: the ratio to the previous step, the planted factor (the control's
        # gradients are drawn anew each step, so the ratio is the oracle's, not exactly 2)
        for prev, step in zip(STEPS, STEPS[1:], strict=False):
            assert rows[(step, label)]["growth"] == pytest.approx(
                want[STEPS.index(step)] / want[STEPS.index(prev)], rel=1e-12
            )
    # the tensors without a planted difference: exactly 0 at every step, no growth
    assert all(rows[(s, "mlp")]["rel_l2"] == 0.0 for s in STEPS)
    growth = {g["group"]: g for g in df.attrs["group_l2_growth"]}
    want = _expected(runs, ADAPTER)
    fit = np.polyfit(STEPS, np.log10(want), 1)[0]  # least squares, independently of dmlib
    assert growth["adapter"]["slope"] == pytest.approx(fit, rel=1e-9)
    assert growth["adapter"]["factor"] == pytest.approx(want[-1] / want[0], rel=1e-12)
    assert (growth["adapter"]["step_first"], growth["adapter"]["step_last"]) == (0, 4)
    # the planted doubling seen through the control's own norms: about log10(2) a step
    assert growth["adapter"]["slope"] == pytest.approx(math.log10(FACTOR), rel=0.15)
    assert math.isnan(growth["mlp"]["slope"]) and growth["mlp"]["n_steps"] == 0
    assert "group_l2" not in dmlib.step_ladder(_ladder(runs)).attrs  # only when asked


def test_cli_text_is_a_ladder_with_a_column_per_group(runs, capsys):
    argv = ["ladder", f"ctl={runs['ctl']}", f"run={runs['run']}", "--group-l2", "adapter",
            "--group-l2", "q=re:\\.q\\."]  # fmt: skip
    assert main(argv) == 1  # the adapter's gradients differ
    out = capsys.readouterr().out
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["pair", "step"])
    assert lines[head].split() == ["pair", "step", "adapter", "adapter", "growth", "q", "q",
                                   "growth"]  # fmt: skip
    want = _expected(runs, ADAPTER)
    want_q = _expected(runs, [n for n in ADAPTER if ".q." in n])
    for i, step in enumerate(STEPS):
        cells = lines[head + 1 + i].split()
        assert cells[:2] == ["ctl/run", str(step)]
        assert float(cells[2]) == pytest.approx(want[i], rel=1e-3)  # 4 significant digits
        assert float(cells[4]) == pytest.approx(want_q[i], rel=1e-3)
        if i:
            assert float(cells[3]) == pytest.approx(want[i] / want[i - 1], rel=1e-3)
        else:
            assert cells[3] == "-"  # no previous step: no growth
    summary = next(line for line in lines if line.startswith("ctl/run adapter: rel_l2"))
    assert re.search(r"\(x([0-9.e+-]+)\)", summary)
    factor = float(re.search(r"\(x([0-9.e+-]+)\)", summary).group(1))
    assert factor == pytest.approx(want[-1] / want[0], rel=1e-3)


def test_cli_json_against_numpy(runs, capsys):
    argv = ["ladder", f"ctl={runs['ctl']}", f"run={runs['run']}", "--group-l2", "all", "--json"]
    assert main(argv) == 1
    doc = json.loads(capsys.readouterr().out)
    got = [r["rel_l2"] for r in sorted(doc["group_l2"], key=lambda r: r["step"])]
    assert got == pytest.approx(_expected(runs, list(SHAPES)), rel=1e-12)
    (g,) = doc["group_l2_growth"]
    assert (g["pair"], g["group"], g["n_steps"]) == ("ctl/run", "all", len(STEPS))
    assert doc["group_l2"][0]["growth"] is None  # NaN in JSON: null
    # files named by step (LABEL:STEP=PATH) give the same figures
    argv = [f"{r}:{s}={p}" for r, steps in _ladder(runs).items() for s, p in steps.items()]
    assert main(["ladder", *argv, "--group-l2", "all", "--json"]) == 1
    again = json.loads(capsys.readouterr().out)["group_l2"]
    assert [r["rel_l2"] for r in sorted(again, key=lambda r: r["step"])] == got
    # a group is its own selection: --include narrows the tensor table, not the group
    assert main(["ladder", *argv, "--group-l2", "all", "--include", "mlp", "--json"]) == 0
    narrowed = json.loads(capsys.readouterr().out)
    assert {r["name"] for r in narrowed["rows"]} == {"m.l1.mlp.weight"}
    assert [r["rel_l2"] for r in sorted(narrowed["group_l2"], key=lambda r: r["step"])] == got


def test_a_pattern_matching_no_tensor_is_refused(runs, capsys):
    with pytest.raises(DmlibError, match="'no_such_tensor'.*matches no float tensor"):
        dmlib.step_ladder(_ladder(runs), group_l2=["adapter", "no_such_tensor"])
    argv = ["ladder", f"ctl={runs['ctl']}", f"run={runs['run']}", "--group-l2", "x=re:^zz"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "'x'" in err and "'re:^zz'" in err and len(err.strip().splitlines()) == 1
    # compare and matrix refuse it the same way (never a relative L2 of 0 over nothing)
    a, b = (str(runs[r] / "grad_step0.safetensors") for r in ("ctl", "run"))
    assert main(["compare", a, b, "--group-l2", "re:^zz"]) == 2
    assert "'re:^zz'" in capsys.readouterr().err
    assert main(["matrix", f"ctl={a}", f"run={b}", "--group-l2", "re:^zz"]) == 2
    assert "'re:^zz'" in capsys.readouterr().err


def test_a_group_missing_at_one_step_is_refused_naming_the_step(runs):
    ladder = _ladder(runs)
    # step 3 of the run: its adapter gradients are not saved
    kept = {n: v for n, v in _read(runs["run"], 3).items() if "lora_" not in n}
    lone = runs["run"].parent / "no_adapter_step3.safetensors"
    safetensors_numpy.save_file(kept, lone)
    ladder["run"][3] = str(lone)
    with pytest.raises(DmlibError, match="'adapter'.*at step 3"):
        dmlib.step_ladder(ladder, group_l2="adapter")


def test_rename_together_with_group_l2(tmp_path, capsys):
    dirs = _write_runs(tmp_path, prefix="model.")  # the run saved under other names
    base = ["ladder", f"ctl={dirs['ctl']}", f"run={dirs['run']}", "--group-l2", "adapter"]
    assert main(base) == 2  # no shared name: refused with the rename that pairs them
    capsys.readouterr()
    # the pattern matches the names as compared, after the rename (the control's)
    argv = [*base, "--group-l2", "l0q=re:^m\\.l0\\.q\\.", "--rename", "run:model.=", "--json"]
    assert main(argv) == 1
    rows = json.loads(capsys.readouterr().out)["group_l2"]
    by = {(r["step"], r["group"]): r["rel_l2"] for r in rows}
    want = _expected(dirs, ADAPTER, prefix="model.")
    want_q = _expected(dirs, [n for n in ADAPTER if n.startswith("m.l0.q.")], prefix="model.")
    assert [by[(s, "adapter")] for s in STEPS] == pytest.approx(want, rel=1e-12)
    assert [by[(s, "l0q")] for s in STEPS] == pytest.approx(want_q, rel=1e-12)
    df = dmlib.step_ladder(_ladder(dirs), group_l2="adapter", rename={"run": "model.="})
    assert [r["rel_l2"] for r in df.attrs["group_l2"]] == pytest.approx(want, rel=1e-12)


def test_identical_runs_give_zero_and_no_rate(runs, capsys):
    argv = ["ladder", f"a={runs['ctl']}", f"b={runs['ctl']}", "--group-l2", "adapter"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "a/b adapter: rel_l2 0 at step 0, 0 at step 4" in out
    assert "no rate (rel_l2 > 0 at 0 steps)" in out


# -- the lab dataset: the README's command over data/lora_steps ---------------------------


def _readme_command() -> list[str]:
    text = (ROOT / "README.md").read_text()
    (line,) = [ln for ln in text.splitlines()
               if ln.startswith("dmlib ladder ") and "lora_steps" in ln and "--group-l2" in ln]  # fmt: skip
    return shlex.split(line)[1:]


def test_lora_steps_gradient_ladder_against_numpy(capsys, monkeypatch):
    data = ROOT / "data" / "lora_steps"
    if not (data / "base" / "grads" / "step_0.safetensors").is_file():
        pytest.skip("data/lora_steps is not here")
    monkeypatch.chdir(ROOT)
    argv = _readme_command()
    assert "adapter" in argv and "--reference" in argv
    assert main([*argv, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    rows = {(r["pair"], r["step"]): r for r in doc["group_l2"]}
    runs = [a.partition("=")[0] for a in argv if "=" in a and "lora_steps" in a]
    steps = json.loads((data / "index.json").read_text())["steps"]
    assert runs[0] == "base" and len(runs) >= 2
    for run in runs[1:]:
        for step in steps:
            a = safetensors_numpy.load_file(data / "base" / "grads" / f"step_{step}.safetensors")
            b = safetensors_numpy.load_file(data / run / "grads" / f"step_{step}.safetensors")
            names = [n for n in a if "lora_" in n]
            assert len(names) == 16 and set(names) == {n for n in b if "lora_" in n}
            row = rows[(f"base/{run}", step)]
            assert row["n_tensors"] == len(names)
            assert row["rel_l2"] == pytest.approx(_oracle(a, b, names), rel=1e-12)
    # the same command's text: the ladder's table
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "pair" in out and "adapter growth" in out
