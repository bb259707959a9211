"""``dmlib inspect`` says what each file of a real Trainer checkpoint is: the model weights,
the optimizer state, the scheduler, the RNG state (python, numpy, torch CPU), the training
arguments; what it says is checked against torch.load of the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmlib.cli import main
from dmlib.inspect_ import describe, file_role

torch = pytest.importorskip("torch")

# the generators of a Trainer's rng_state.pth, as inspect names them
WORDS = {"python": "python", "numpy": "numpy", "cpu": "torch CPU", "cuda": "CUDA"}


def _ckpt(hf_runs: Path) -> Path:
    return hf_runs / "runs" / "A" / "checkpoint-2"


def _inspect(path: Path, capsys) -> tuple[int, str]:
    rc = main(["inspect", str(path), "--no-hash"])
    return rc, capsys.readouterr().out


@pytest.mark.slow  # the hf_runs fixture trains real Trainer runs (~30 s once)
def test_rng_state(hf_runs, capsys):
    f = _ckpt(hf_runs) / "rng_state.pth"
    oracle = torch.load(f, weights_only=False)  # the test's own file, written by Trainer
    want = ", ".join(WORDS[k] for k in WORDS if k in oracle)
    assert set(oracle) <= set(WORDS)
    rc, out = _inspect(f, capsys)
    assert rc == 0
    assert f"what it is: a Trainer RNG state ({want})" in out.splitlines()[1]


@pytest.mark.slow  # the hf_runs fixture trains real Trainer runs (~30 s once)
def test_optimizer_and_scheduler(hf_runs, capsys):
    ck = _ckpt(hf_runs)
    opt = torch.load(ck / "optimizer.pt", weights_only=False)
    keys = sorted({k for st in opt["state"].values() for k in st})
    lrs = sorted({g["lr"] for g in opt["param_groups"]})
    n_groups = len(opt["param_groups"])
    rc, out = _inspect(ck / "optimizer.pt", capsys)
    assert rc == 0
    assert (
        f"what it is: an optimizer state: {len(opt['state'])} parameters ({', '.join(keys)}), "
        f"{n_groups} parameter group{'s' * (n_groups != 1)} (lr {', '.join(map(str, lrs))})"
    ) in out
    sched = torch.load(ck / "scheduler.pt", weights_only=False)
    rc, out = _inspect(ck / "scheduler.pt", capsys)
    assert rc == 0
    assert (
        f"a learning-rate scheduler state (step {sched['last_epoch']}, learning rate "
        f"{sched['_last_lr'][0]})"
    ) in out


@pytest.mark.slow  # the hf_runs fixture trains real Trainer runs (~30 s once)
def test_training_args_are_named_never_unpickled(hf_runs, capsys, monkeypatch):
    import pickle

    def refuse(*a, **k):
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    rc, out = _inspect(_ckpt(hf_runs) / "training_args.bin", capsys)
    assert rc == 0
    assert "training arguments" in out and "TrainingArguments" in out
    assert describe(_ckpt(hf_runs) / "training_args.bin")["role"]["kind"] == "training_args"


@pytest.mark.slow  # the hf_runs fixture trains real Trainer runs (~30 s once)
def test_the_folder_names_every_file(hf_runs, capsys):
    ck = _ckpt(hf_runs)
    rc, out = _inspect(ck, capsys)
    assert rc == 0
    lines = {ln.split(": ", 1)[0].strip(): ln for ln in out.splitlines() if ln.startswith("  ")}
    on_disk = {p.name for p in ck.iterdir()} - {"config.json", "generation_config.json"}
    assert set(lines) == on_disk
    assert "model weights" in lines["model.safetensors"]
    assert "optimizer state" in lines["optimizer.pt"]
    assert "scheduler state" in lines["scheduler.pt"]
    assert "Trainer RNG state" in lines["rng_state.pth"]
    assert "training arguments" in lines["training_args.bin"]
    state = json.loads((ck / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and "Trainer's state" in lines["trainer_state.json"]


@pytest.mark.slow  # the hf_runs fixture trains real Trainer runs (~30 s once)
def test_accelerate_state(hf_runs, capsys):
    rc, out = _inspect(hf_runs / "accelerate" / "random_states_0.pkl", capsys)
    assert rc == 0 and "an Accelerate RNG state (python, numpy, torch CPU" in out


def test_roles_by_hand():
    assert file_role(["numpy.1", "cpu", "cuda"], {"python.0": 3})["text"] == (
        "a Trainer RNG state (python, numpy, torch CPU, CUDA)"
    )
    assert file_role(["w", "b"], {}, name="weights.safetensors") is None  # not a Trainer's name
    assert file_role(["cpu"], {}) is None  # a tensor named cpu alone is no RNG state
    opt = file_role(["state.3.momentum_buffer"], {"param_groups.0.lr": 0.1})
    assert (
        opt["text"]
        == "an optimizer state: 1 parameter (momentum_buffer), 1 parameter group (lr 0.1)"
    )
