"""Hugging Face training folders read by dmlib, checked against the files' own readers.

The runs are real ``transformers.Trainer`` trainings of a tiny Llama (tests/_support/hf_train.py),
made once per session in a subprocess. Every expected value comes from safetensors.numpy,
torch.load, json or the Trainer's own grouping, never from dmlib.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dmlib
from dmlib.errors import FormatError
from dmlib.stats.compare import compare_records, summarize_records
from dmlib.stats.components import compare_runs, components

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
torch = pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

pytestmark = pytest.mark.slow  # the session's training takes ~30 CPU seconds

# -- oracles on the files themselves ----------------------------------------------------


def _rng_oracle(path: Path) -> dict:
    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), np._core.multiarray._reconstruct]
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, weights_only=True)


def _same_tree(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def _oracle_components(a: Path, b: Path) -> dict[str, bool]:
    """component -> differs, read with safetensors / torch.load / json."""
    wa = safetensors_numpy.load_file(a / "model.safetensors")
    wb = safetensors_numpy.load_file(b / "model.safetensors")
    opt = [torch.load(p / "optimizer.pt", weights_only=True) for p in (a, b)]
    sch = [torch.load(p / "scheduler.pt", weights_only=True) for p in (a, b)]
    st = [json.loads((p / "trainer_state.json").read_text()) for p in (a, b)]
    return {
        "weights": not _same_tree(wa, wb),
        "optimizer": not _same_tree(opt[0], opt[1]),
        "scheduler": not _same_tree(sch[0], sch[1]),
        "rng": not _same_tree(_rng_oracle(a / "rng_state.pth"), _rng_oracle(b / "rng_state.pth")),
        "trainer": st[0] != st[1],
    }


def _ckpt(root: Path, run: str, step: int) -> Path:
    return root / "runs" / run / f"checkpoint-{step}"


# -- one checkpoint folder ----------------------------------------------------------------


def test_checkpoint_folder_holds_every_component(hf_runs: Path) -> None:
    ck = _ckpt(hf_runs, "A", 4)
    weights = safetensors_numpy.load_file(ck / "model.safetensors")
    sched = torch.load(ck / "scheduler.pt", weights_only=True)
    state = json.loads((ck / "trainer_state.json").read_text())
    rng = _rng_oracle(ck / "rng_state.pth")
    with dmlib.open_tensors(ck) as ts:
        assert ts.format == "hf-trainer"
        for name, arr in weights.items():
            np.testing.assert_array_equal(ts[name].load(), arr)
        assert ts.scalars["scheduler.last_epoch"] == sched["last_epoch"]
        assert ts.scalars["scheduler._last_lr.0"] == sched["_last_lr"][0]
        assert ts.scalars["step"] == state["global_step"] == 4
        assert ts.scalars["trainer.epoch"] == state["epoch"]
        logged = [e for e in state["log_history"] if "loss" in e]
        np.testing.assert_array_equal(
            ts["trainer.log_history.loss"].load(), [e["loss"] for e in logged]
        )
        np.testing.assert_array_equal(
            ts["trainer.log_history.loss.steps"].load(), [e["step"] for e in logged]
        )
        np.testing.assert_array_equal(ts["rng.cpu"].load(), rng["cpu"].numpy())
        np.testing.assert_array_equal(ts["rng.numpy.1"].load(), rng["numpy"][1])
        assert ts.scalars["rng.python.1.0"] == rng["python"][1][0]
        # training_args.bin: named as what it is, never unpickled, not an error
        assert "TrainingArguments" in ts.metadata["not_tensors"]
        assert not ts.metadata.get("not_read")


def test_optimizer_moments_named_by_the_trainers_grouping(hf_runs: Path) -> None:
    grouping = json.loads((hf_runs / "grouping.json").read_text())
    ck = _ckpt(hf_runs, "A", 6)
    opt = torch.load(ck / "optimizer.pt", weights_only=True)
    order = [n for g in grouping["groups"] for n in g]  # state ids run over the groups in order
    # the Trainer's rule: decay parameters first, the others second
    assert grouping["groups"][0] == [n for n in order if n in set(grouping["decay"])]
    with dmlib.open_tensors(ck) as ts:
        assert "named after parameters" in ts.metadata["optimizer.optimizer_state_names"]
        assert not [n for n in ts if n.startswith("optimizer.state.") and n.split(".")[2].isdigit()]
        for i, name in enumerate(order):
            for key in ("exp_avg", "exp_avg_sq"):
                got = ts[f"optimizer.state.{name}.{key}"].load()
                np.testing.assert_array_equal(got, opt["state"][i][key].numpy())


def test_accelerate_state_folder(hf_runs: Path) -> None:
    folder = hf_runs / "accelerate"
    weights = safetensors_numpy.load_file(folder / "model.safetensors")
    opt = torch.load(folder / "optimizer.bin", weights_only=True)
    rng = _rng_oracle(folder / "random_states_0.pkl")
    with dmlib.open_tensors(folder) as ts:
        assert ts.layout["kind"] == "accelerate"
        assert set(weights) <= set(ts)
        # no config.json and sorted safetensors: the ids stay, and the note says why
        note = ts.metadata["optimizer.optimizer_state_names"]
        assert "numeric parameter ids" in note and "order" in note
        np.testing.assert_array_equal(
            ts["optimizer.state.0.exp_avg"].load(), opt["state"][0]["exp_avg"].numpy()
        )
        np.testing.assert_array_equal(
            ts["rng.torch_manual_seed"].load(), rng["torch_manual_seed"].numpy()
        )
        assert ts.scalars["rng.step"] == rng["step"]


# -- comparisons against the oracle -------------------------------------------------------


@pytest.mark.parametrize("other", ["B", "G", "S"])
def test_components_of_a_pair_match_the_files(hf_runs: Path, other: str) -> None:
    a, b = _ckpt(hf_runs, "A", 4), _ckpt(hf_runs, other, 4)
    want = _oracle_components(a, b)
    rows, attrs = compare_records(a, b)
    got = {c["component"]: c["status"] for c in components(rows, attrs)}
    assert got == {k: "differs" if v else "identical" for k, v in want.items()}
    s = summarize_records(rows, attrs)
    assert s["identical"] == (not any(want.values()))


def test_resumed_runs_against_the_continuous_one(hf_runs: Path) -> None:
    """R resumes A from checkpoint-2; D does the same with another data seed."""
    a = hf_runs / "runs" / "A"
    for resumed in ("R", "D"):
        got = compare_runs(a, hf_runs / "runs" / resumed)
        assert got["steps"] == [4, 6] and got["only_in_a"] == [2]
        oracle = {
            s: _oracle_components(_ckpt(hf_runs, "A", s), _ckpt(hf_runs, resumed, s))
            for s in (4, 6)
        }
        first = {}
        for s in (4, 6):
            for comp, differs in oracle[s].items():
                if differs:
                    first.setdefault(comp, s)
        assert got["first_diff"] == first
        assert got["bit_exact"] == (not first)
        if first:
            step = min(first.values())
            assert got["first_step"] == step
            assert sorted(got["first_components"]) == sorted(
                k for k, v in first.items() if v == step
            )
            # the loss curve: the first logged step whose loss differs, from the json
            la = json.loads((_ckpt(hf_runs, "A", 6) / "trainer_state.json").read_text())
            lb = json.loads((_ckpt(hf_runs, resumed, 6) / "trainer_state.json").read_text())
            parts = [
                x["step"]
                for x, y in zip(la["log_history"], lb["log_history"], strict=True)
                if "loss" in x and x["loss"] != y["loss"]
            ]
            assert got["loss_parts_at"] == (parts[0] if parts else None)


def test_cli_compare_of_run_folders_and_checkpoints(hf_runs: Path, capsys) -> None:
    from dmlib.cli import main

    runs = hf_runs / "runs"
    want = _oracle_components(_ckpt(hf_runs, "A", 2), _ckpt(hf_runs, "G", 2))
    assert (
        main(["compare", str(runs / "A" / "checkpoint-2"), str(runs / "G" / "checkpoint-2")]) == 1
    )
    out = capsys.readouterr().out
    for comp, differs in want.items():
        assert f"{comp}: {'DIFFERS' if differs else 'IDENTICAL'}" in out
    code = main(["compare", str(runs / "A"), str(runs / "R")])
    out = capsys.readouterr().out
    bit_exact = not any(
        any(_oracle_components(_ckpt(hf_runs, "A", s), _ckpt(hf_runs, "R", s)).values())
        for s in (4, 6)
    )
    assert code == (0 if bit_exact else 1)
    assert ("BIT-EXACT" in out) == bit_exact
    assert "steps only in A (not compared): 2" in out


def test_a_run_folder_is_not_one_checkpoint(hf_runs: Path) -> None:
    with pytest.raises(FormatError, match="run's output folder"):
        dmlib.open_tensors(hf_runs / "runs" / "A")


_OPEN_CHILD = """
import json, sys
import dmlib
with dmlib.open_tensors(sys.argv[1]) as ts:
    names = [n for n in ts if n.startswith("optimizer.state.") and n.endswith(".exp_avg")]
    note = ts.metadata["optimizer.optimizer_state_names"]
print(json.dumps({"names": names, "note": note, "transformers": "transformers" in sys.modules}))
"""


def _open_in_child(ck: Path, cache: Path) -> dict:
    import os
    import subprocess
    import sys

    env = {**os.environ, "DMLIB_CACHE_DIR": str(cache), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", _OPEN_CHILD, str(ck)], capture_output=True,
                          text=True, env=env, timeout=300, check=True)  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def test_the_rebuilt_parameter_order_is_kept_between_processes(hf_runs: Path, tmp_path) -> None:
    grouping = json.loads((hf_runs / "grouping.json").read_text())
    order = [n for g in grouping["groups"] for n in g]  # the Trainer's own grouping
    expected = sorted(f"optimizer.state.{n}.exp_avg" for n in order)
    ck = _ckpt(hf_runs, "A", 6)
    cache = tmp_path / "cache"
    first = _open_in_child(ck, cache)
    assert first["transformers"] and sorted(first["names"]) == expected
    files = list((cache / "hf-param-order").glob("*.json"))
    assert len(files) == 1
    second = _open_in_child(ck, cache)  # from the cache: transformers is not even imported
    assert not second["transformers"] and second["names"] == first["names"]
    assert second["note"] == first["note"]
    files[0].write_text('{"format": "dmlib-hf-param-order-v1", "params": [["x", [-1]]]}')
    third = _open_in_child(ck, cache)  # a damaged file: rebuilt (and rewritten), never used
    assert third["transformers"] and third["names"] == first["names"]
    assert _open_in_child(ck, cache)["transformers"] is False
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")  # a cache that cannot be written: opened all the same
    assert _open_in_child(ck, blocked)["names"] == first["names"]
    assert blocked.read_text() == "not a folder"
    off = _open_in_child(ck, Path("off"))  # DMLIB_CACHE_DIR=off: nothing kept
    assert off["transformers"] and off["names"] == first["names"]
