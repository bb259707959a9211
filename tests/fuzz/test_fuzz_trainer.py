"""Hugging Face Trainer folders: a mutated or generated ``trainer_state.json``, and run
folders of ``checkpoint-N`` entries of every kind: read exactly or refused, never another
exception or a hang.

Expected values come from ``json`` (the curve of each logged key, worked out here from the
parsed document) and from how the folders were built (which entries hold a checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from _support import fuzzlib
from _support.fuzzlib import no_hang, read_or_refuse
from hypothesis import given
from hypothesis import strategies as st

from dmlib.errors import DmlibError
from dmlib.io import hf_trainer

safetensors_numpy = pytest.importorskip("safetensors.numpy")

STATE = {
    "global_step": 6,
    "epoch": 1.5,
    "best_metric": None,
    "is_world_process_zero": True,
    "log_history": [
        {"step": 2, "loss": 2.5, "grad_norm": 1.25, "learning_rate": 5e-05},
        {"step": 4, "loss": 2.0, "grad_norm": 0.75, "learning_rate": 4e-05},
        {"step": 6, "eval_loss": 1.9, "epoch": 1.5},
    ],
    "trial_params": {"lr": [1, 2, {"x": "y"}]},
}


def _curves(state: object) -> dict[str, list[tuple[int, float]]] | None:
    """Each logged numeric key's (step, value) points, by the format's rule; None when the
    document is not a trainer state (then it must be refused)."""
    if not isinstance(state, dict):
        return None
    history = state.get("log_history", [])
    if not isinstance(history, list) or not all(isinstance(e, dict) for e in history):
        return None
    out: dict[str, list[tuple[int, float]]] = {}
    for e in history:
        step = e.get("step")
        if type(step) is not int:
            continue
        for k, v in e.items():
            if k != "step" and type(v) in (int, float):
                out.setdefault(k, []).append((step, float(v)))
    return out


def _folder(root: Path, text: bytes) -> Path:
    d = root / "checkpoint-6"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    safetensors_numpy.save_file({"w": np.arange(3, dtype=np.float32)}, str(d / "model.safetensors"))
    (d / "trainer_state.json").write_bytes(text)
    return d


def _check(d: Path, text: bytes) -> None:
    got = read_or_refuse(d, "hf-trainer state")
    if got is None:
        return
    state = json.loads(text)  # dmlib read it: so does json, to the same document
    curves = _curves(state)
    assert curves is not None, "a document that is not a trainer state was read"
    for key, pts in curves.items():
        values = np.frombuffer(got[f"trainer.log_history.{key}"][0], np.float64)
        steps = np.frombuffer(got[f"trainer.log_history.{key}.steps"][0], np.int64)
        want = np.array([v for _, v in pts])
        assert steps.tolist() == [s for s, _ in pts]
        assert np.array_equal(values, want, equal_nan=True) or all(
            math.isnan(a) and math.isnan(b) for a, b in zip(values, want, strict=True)
        )


@fuzzlib.fuzz()
@given(data=st.data())
def test_trainer_state_mutated(tmp_path_factory: pytest.TempPathFactory, data) -> None:
    text = bytearray(json.dumps(STATE).encode())
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        pos = data.draw(st.integers(0, len(text)), label="pos")
        kind = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]), label="kind")
        if kind == "flip" and pos < len(text):
            text[pos] ^= data.draw(st.integers(1, 255), label="mask")
        elif kind == "cut":
            del text[pos:]
        elif kind == "insert":
            piece = data.draw(st.sampled_from([b"[", b"{", b'"a":', b"1e999", b"NaN", b",",
                                               b'"\\ud800"', b"-", b"[[[[", b'{"step":1}']))  # fmt: skip
            text[pos:pos] = piece
        else:
            del text[pos : pos + data.draw(st.integers(1, 8))]
    d = _folder(tmp_path_factory.mktemp("state"), bytes(text))
    _check(d, bytes(text))


_keys = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
_leaves = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
_json = st.recursive(
    _leaves,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_keys, kids, max_size=4),
    max_leaves=30,
)
_entry = st.dictionaries(
    _keys | st.just("step") | st.just("loss"),
    st.integers(-5, 5) | st.floats(allow_nan=True) | st.booleans() | st.text(max_size=3),
    max_size=5,
)


@fuzzlib.fuzz()
@given(top=st.dictionaries(_keys, _json, max_size=5), history=st.lists(_entry, max_size=6))
def test_trainer_state_generated(tmp_path_factory: pytest.TempPathFactory, top, history) -> None:
    state = {**top, "log_history": history}
    text = json.dumps(state).encode()
    d = _folder(tmp_path_factory.mktemp("gen"), text)
    _check(d, text)


# -- run folders: checkpoint-N entries of every kind ------------------------------------------

_ENTRY = st.sampled_from(
    ["checkpoint", "empty", "file", "link_inside", "link_outside", "fifo", "weights_only"]
)


@fuzzlib.fuzz()
@given(kinds=st.lists(_ENTRY, max_size=8), steps=st.lists(st.integers(0, 10**6), max_size=8))
def test_run_folder_layouts(tmp_path_factory: pytest.TempPathFactory, kinds, steps) -> None:
    root = tmp_path_factory.mktemp("run")
    run = root / "run"
    run.mkdir()
    outside = root / "outside"
    outside.mkdir()
    (outside / "trainer_state.json").write_text('{"global_step": 1}')
    (run / "kept").mkdir()
    (run / "kept" / "trainer_state.json").write_text('{"global_step": 2}')
    want: set[int] = set()
    leaves_run = False
    for i, kind in enumerate(kinds):
        step = steps[i] if i < len(steps) else i
        p = run / f"checkpoint-{step}"
        if os.path.lexists(p):
            continue
        if kind == "checkpoint":
            p.mkdir()
            (p / "trainer_state.json").write_text(json.dumps({"global_step": step}))
            want.add(step)
        elif kind == "empty":
            p.mkdir()
        elif kind == "file":
            p.write_text("not a folder")
        elif kind == "link_inside":
            p.symlink_to("kept")
            want.add(step)
        elif kind == "link_outside":
            p.symlink_to(outside)
            leaves_run = True
        elif kind == "fifo":
            os.mkfifo(p)
        else:  # weights without an optimizer, scheduler or RNG file: not a checkpoint
            p.mkdir()
            safetensors_numpy.save_file(
                {"w": np.zeros(1, np.float32)}, str(p / "model.safetensors")
            )
    try:
        with no_hang():
            found = hf_trainer.checkpoints_of(run)
    except DmlibError as err:
        assert leaves_run and "outside the run folder" in str(err)
        fuzzlib.COUNTS["hf-trainer run folder"]["refused"] += 1
        return
    assert not leaves_run, "a checkpoint-N linking out of the run folder was followed"
    assert set(found) == want and list(found) == sorted(found)
    assert hf_trainer.is_run_folder(run) == bool(want)
    fuzzlib.COUNTS["hf-trainer run folder"]["read"] += 1
