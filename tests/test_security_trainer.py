"""Hostile Hugging Face Trainer folders: bounded, confined, regular files only.

A ``trainer_state.json`` that is a FIFO, a link to ``/dev/zero``, a link out of the
checkpoint, a 300 KB file whose keys join into names of megabytes, or one log entry of
200,000 keys is refused in one line (exit 2) in seconds; a ``checkpoint-N`` that is a
symbolic link leading out of the run folder is refused naming it, one leading inside is
read; a folder of 100,000 ``checkpoint-N`` entries is refused after one listing. Expected
values come from the files as written here (``json`` and ``safetensors`` write them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dmlib
from dmlib import _limits
from dmlib.errors import DmlibError, FormatError
from dmlib.io import hf_trainer

safetensors_numpy = pytest.importorskip("safetensors.numpy")

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "DMLIB_CACHE_DIR": "off"}


def _cli(*args: str, timeout: float = 60) -> tuple[int, str, float]:
    """(exit status, stderr, seconds) of ``dmlib ARGS`` in a child process."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "dmlib", *args], capture_output=True, text=True,
                       env=ENV, timeout=timeout, check=False)  # fmt: skip
    return r.returncode, r.stderr.strip(), time.monotonic() - t0


def _checkpoint(folder: Path, step: int, w: np.ndarray, state: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    safetensors_numpy.save_file({"w": w}, str(folder / "model.safetensors"))
    doc = {"global_step": step, "log_history": [{"step": step, "loss": float(step)}]}
    (folder / "trainer_state.json").write_text(json.dumps(state or doc))
    return folder


def _with_state(tmp_path: Path, text: str | None = None) -> Path:
    d = tmp_path / "checkpoint-3"
    d.mkdir()
    safetensors_numpy.save_file({"w": np.zeros(2, np.float32)}, str(d / "model.safetensors"))
    if text is not None:
        (d / "trainer_state.json").write_text(text)
    return d


def _one_line(err: str, *words: str) -> None:
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


# -- trainer_state.json: a regular file inside the checkpoint ------------------------------


def test_a_fifo_trainer_state_is_refused_without_waiting(tmp_path: Path) -> None:
    d = _with_state(tmp_path)
    os.mkfifo(d / "trainer_state.json")
    rc, err, seconds = _cli("inspect", str(d))
    assert rc == 2 and seconds < 20
    _one_line(err, str(d / "trainer_state.json"), "not a regular file")


def test_a_trainer_state_linked_to_dev_zero_is_never_read(tmp_path: Path) -> None:
    d = _with_state(tmp_path)
    os.symlink("/dev/zero", d / "trainer_state.json")
    rc, err, seconds = _cli("inspect", str(d))
    assert rc == 2 and seconds < 20
    _one_line(err, "trainer_state.json", "/dev/zero", "outside the checkpoint")


def test_a_device_inside_the_folder_is_refused(tmp_path: Path) -> None:
    # a device node cannot be made without privileges: the same check, reached through a
    # link that stays in the folder and names a FIFO
    d = _with_state(tmp_path)
    os.mkfifo(d / "pipe")
    os.symlink("pipe", d / "trainer_state.json")
    with pytest.raises(FormatError, match="not a regular file"):
        dmlib.open_tensors(d)


def test_links_inside_the_checkpoint_are_read_and_links_out_refused(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"global_step": 99}))
    d = _with_state(tmp_path)
    os.symlink(outside, d / "trainer_state.json")
    with pytest.raises(FormatError, match="outside the checkpoint folder") as info:
        dmlib.open_tensors(d)
    assert str(outside) in str(info.value)
    os.unlink(d / "trainer_state.json")
    (d / "real").mkdir()
    (d / "real" / "state.json").write_text(json.dumps({"global_step": 7}))
    os.symlink("real/state.json", d / "trainer_state.json")
    with dmlib.open_tensors(d) as ts:
        assert ts.scalars["step"] == 7


def test_a_weights_file_linking_out_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.safetensors"
    safetensors_numpy.save_file({"w": np.ones(2, np.float32)}, str(secret))
    d = tmp_path / "checkpoint-1"
    d.mkdir()
    (d / "trainer_state.json").write_text('{"global_step": 1}')
    os.symlink(secret, d / "model.safetensors")
    with pytest.raises(FormatError, match="outside the checkpoint folder") as info:
        dmlib.open_tensors(d)
    assert "model.safetensors" in str(info.value)


def test_a_trainer_state_over_the_size_limit_is_refused_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = _with_state(tmp_path, json.dumps({"global_step": 1, "pad": "x" * 5000}))
    monkeypatch.setattr(_limits, "MAX_TEXT_BYTES", 4096)
    with pytest.raises(FormatError, match="more than the 4.0 KiB"):
        dmlib.open_tensors(d)


# -- trainer_state.json: bounded JSON -----------------------------------------------------


def test_keys_joined_into_long_names_are_refused_small(tmp_path: Path) -> None:
    """300 KB: 20 levels of a 10 KB key over 50,000 values (names of 200 KB each: 10 GB)."""
    key = "k" * 10_000
    doc = "[" + ",".join(["0"] * 50_000) + "]"
    for _ in range(20):
        doc = '{"' + key + '":' + doc + "}"
    d = _with_state(tmp_path, '{"global_step": 1, "x": ' + doc + "}")
    assert (d / "trainer_state.json").stat().st_size < 310_000
    rc, err, seconds = _cli("inspect", str(d))
    assert rc == 2 and seconds < 20
    _one_line(err, "trainer_state.json", "10,002 characters", "longer than the 4,096")


def test_names_adding_up_past_the_limit_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each name short enough, together too many characters (a 2,000-character key over 600
    values: 1.2 M characters against a limit lowered to 1 M)."""
    state = {"global_step": 1, "k" * 2000: list(range(600))}
    d = _with_state(tmp_path, json.dumps(state))
    monkeypatch.setattr(_limits, "max_name_chars_total", lambda: 1_000_000)
    with pytest.raises(FormatError, match="characters together"):
        dmlib.open_tensors(d)
    monkeypatch.setattr(_limits, "max_name_chars_total", lambda: 2_000_000)
    with dmlib.open_tensors(d) as ts:  # under the limit: every value, named by its path
        assert ts.scalars["trainer." + "k" * 2000 + ".599"] == 599


def test_a_log_entry_of_200k_keys_is_refused_quickly(tmp_path: Path) -> None:
    entry = {"step": 1, **{f"m{i}": float(i) for i in range(200_000)}}
    d = _with_state(tmp_path, json.dumps({"global_step": 1, "log_history": [entry]}))
    rc, err, seconds = _cli("inspect", str(d))
    assert rc == 2 and seconds < 20, (rc, err, seconds)
    _one_line(err, "trainer_state.json", "200,001 keys", "100,000")


def test_many_values_past_the_entries_limit_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    history = [{"step": s, "loss": 1.0, "lr": 0.1} for s in range(100)]  # 400 tensors' values
    d = _with_state(tmp_path, json.dumps({"global_step": 1, "log_history": history}))
    monkeypatch.setattr(_limits, "max_entries", lambda: 300)
    with pytest.raises(FormatError, match="more than 300 entries"):
        dmlib.open_tensors(d)


def test_a_deeply_nested_trainer_state_is_refused(tmp_path: Path) -> None:
    d = _with_state(tmp_path, '{"a": ' + "[" * 5000 + "]" * 5000 + "}")
    with pytest.raises(DmlibError, match="nests too deeply"):
        dmlib.open_tensors(d)


def test_a_bounded_trainer_state_reads_every_value(tmp_path: Path) -> None:
    history = [{"step": s, "loss": 1.0 / s, "grad_norm": float(s)} for s in range(1, 6)]
    state = {"global_step": 5, "best": None, "nested": {"a": [1, 2.5]}, "log_history": history}
    d = _with_state(tmp_path, json.dumps(state))
    with dmlib.open_tensors(d) as ts:
        assert ts.scalars["step"] == 5
        assert ts.scalars["trainer.nested.a.1"] == 2.5 and ts.scalars["trainer.best"] is None
        np.testing.assert_array_equal(ts["trainer.log_history.loss"].load(),
                                      [1.0 / s for s in range(1, 6)])  # fmt: skip
        assert ts["trainer.log_history.grad_norm.steps"].load().tolist() == [1, 2, 3, 4, 5]


# -- checkpoint-N folders of a run ----------------------------------------------------------


def _runs(tmp_path: Path) -> tuple[Path, Path, Path]:
    outside = _checkpoint(tmp_path / "elsewhere" / "checkpoint-9", 9, np.full(2, 9, np.float32))
    runs = []
    for name in ("run_a", "run_b"):
        _checkpoint(tmp_path / name / "checkpoint-1", 1, np.zeros(2, np.float32))
        runs.append(tmp_path / name)
    return runs[0], runs[1], outside


def test_a_checkpoint_folder_linking_out_of_the_run_is_refused(tmp_path: Path) -> None:
    a, b, outside = _runs(tmp_path)
    for run in (a, b):
        os.symlink(outside, run / "checkpoint-2")
    rc, err, _ = _cli("compare", str(a), str(b))
    assert rc == 2
    _one_line(err, str(a), "'checkpoint-2'", str(outside), "outside the run folder")
    with pytest.raises(FormatError, match="checkpoint-2"):
        hf_trainer.checkpoints_of(a)


def test_a_checkpoint_folder_linking_inside_the_run_is_read(tmp_path: Path) -> None:
    a, b, _ = _runs(tmp_path)
    for run, value in ((a, 2.0), (b, 3.0)):
        _checkpoint(run / "kept" / "step2", 2, np.full(2, value, np.float32))
        os.symlink("kept/step2", run / "checkpoint-2")
    assert list(hf_trainer.checkpoints_of(a)) == [1, 2]
    from dmlib.stats.components import compare_runs

    r = compare_runs(a, b)
    assert r["steps"] == [1, 2] and r["first_step"] == 2  # 2.0 vs 3.0: the weights differ there
    assert r["first_diff"]["weights"] == 2


def test_more_checkpoint_entries_than_the_limit_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    for i in range(3):
        _checkpoint(run / f"checkpoint-{i}", i, np.zeros(2, np.float32))
    monkeypatch.setattr(hf_trainer, "MAX_CHECKPOINTS", 3)
    assert list(hf_trainer.checkpoints_of(run)) == [0, 1, 2]
    (run / "checkpoint-3").mkdir()  # empty: not a checkpoint, but an entry looked into
    with pytest.raises(FormatError, match="4 checkpoint-N entries, more than the 3"):
        hf_trainer.checkpoints_of(run)


@pytest.mark.slow  # making 100,000 folders takes ~30 s here
def test_a_folder_of_100k_checkpoint_entries_is_refused_after_one_listing(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for i in range(100_000):
        os.mkdir(run / f"checkpoint-{i}")
    t0 = time.monotonic()
    with pytest.raises(FormatError, match="100,000 checkpoint-N entries"):
        hf_trainer.checkpoints_of(run)
    assert time.monotonic() - t0 < 5
    rc, err, seconds = _cli("compare", str(run), str(run))
    assert rc == 2 and seconds < 20
    _one_line(err, "100,000 checkpoint-N entries")


def test_a_fifo_or_device_config_json_is_not_waited_on(tmp_path: Path) -> None:
    """config.json (read to name optimizer moments) gets the same checks: not read, said why."""
    from dmlib.io import _hf_names

    d = _with_state(tmp_path, '{"global_step": 1}')
    os.mkfifo(d / "config.json")
    assert _hf_names._architecture(str(d), 10) == (
        None, "there is no readable config.json naming the architecture"
    )  # fmt: skip
    os.unlink(d / "config.json")
    os.symlink("/dev/zero", d / "config.json")
    assert _hf_names._architecture(str(d), 10)[0] is None


def test_a_config_declaring_a_million_layers_is_not_rebuilt(tmp_path: Path) -> None:
    """Rebuilding a config's model costs time per layer (2,000 layers: 24 s): a config
    declaring more layers than the optimizer holds parameters is not built."""
    from dmlib.io import _hf_names

    d = _with_state(tmp_path, '{"global_step": 1}')
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "text_config": {"num_hidden_layers": 1_000_000}, "num_hidden_layers": 2}  # fmt: skip
    (d / "config.json").write_text(json.dumps(cfg))
    t0 = time.monotonic()
    order, why = _hf_names._architecture(str(d), 20)
    assert order is None and time.monotonic() - t0 < 5
    assert why == (
        "config.json declares 1,000,000 layers, more than the 20 parameters the optimizer "
        "holds: not rebuilt"
    )
    assert _hf_names._declared_layers({"a": [{"n_layer": 7}], "encoder_layers": 3}) == 7
