"""Hugging Face training checkpoints: a ``transformers.Trainer`` ``checkpoint-N/`` folder, or
an Accelerate ``save_state`` folder, read as one TensorSet.

The files of one checkpoint become one set, each under its own prefix:

- the weights, unprefixed: ``model.safetensors``, its shard index, ``pytorch_model.bin``
  (or its index), ``adapter_model.safetensors`` (a PEFT adapter);
- ``optimizer.``: ``optimizer.pt`` (Trainer) or ``optimizer.bin`` (Accelerate), its moments
  named after their parameters where the files allow it (:mod:`dmlib.io._hf_names`);
- ``scheduler.``: ``scheduler.pt`` / ``scheduler.bin`` (scalars: ``last_epoch``, ``_last_lr``...);
- ``rng.``: ``rng_state.pth`` (Trainer: ``python``, ``numpy``, ``cpu``, ``cuda`` generators) or
  ``random_states_0.pkl`` (Accelerate); several processes' files as ``rng.<i>.``;
- ``trainer.``: ``trainer_state.json``'s values as scalars (``trainer.global_step``,
  ``trainer.epoch``...), and ``log_history``'s per-step values as tensors:
  ``trainer.log_history.<key>`` (float64, one value per logged step that has ``key``) with
  ``trainer.log_history.<key>.steps`` (int64, those steps), for ``loss``, ``grad_norm``,
  ``learning_rate`` and every other numeric key. ``scalars["step"]`` is ``global_step``
  (the step the checkpoint records, which step ladders check).

``training_args.bin`` (a pickled ``TrainingArguments``, no tensors) is never unpickled:
``metadata["not_tensors"]`` says so. A state file the torch reader refuses is not read:
``metadata["not_read"]`` names it and why, one note per file, and a comparison of the
folder is then not complete (:func:`dmlib.summarize`). ``metadata["components"]`` lists the files read, component by component.
"""

from __future__ import annotations

import copy
import math
import os
import re
from collections.abc import Callable
from typing import Any

from dmlib.errors import FormatError, UnsupportedError
from dmlib.io._folderfiles import json_member
from dmlib.io._folderfiles import member as _member
from dmlib.safepaths import contained
from dmlib.tensor import ArrayTensorSet, Tensor, TensorSet

__all__ = [
    "CHECKPOINT_DIR",
    "MAX_CHECKPOINTS",
    "can_open",
    "checkpoints_of",
    "is_run_folder",
    "open_trainer",
]

TRAINER_STATE = "trainer_state.json"
TRAINING_ARGS = "training_args.bin"
#: weights files in the order they are looked for (the first present is read)
WEIGHTS = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
    "adapter_model.safetensors",
    "adapter_model.bin",
)
OPTIMIZER = ("optimizer.pt", "optimizer.bin")
SCHEDULER = ("scheduler.pt", "scheduler.bin")
_RNG = re.compile(r"^(?:rng_state(?:_(\d+))?\.pth|random_states_(\d+)\.pkl)$")
#: a Trainer checkpoint folder's name: ``checkpoint-<global step>``
CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")
_MARKERS = (TRAINER_STATE, *OPTIMIZER, *SCHEDULER)
#: the most ``checkpoint-N`` entries a run folder may hold (a Trainer keeps
#: ``save_total_limit`` of them; each one holds at least the weights)
MAX_CHECKPOINTS = 10_000


def can_open(path: str) -> bool:
    """True for a folder holding a Trainer checkpoint or an Accelerate state.

    That is ``trainer_state.json``, or weights beside an optimizer, scheduler or RNG file.
    """
    if not os.path.isdir(path):
        return False
    try:
        names = set(os.listdir(path))
    except OSError:
        return False
    if TRAINER_STATE in names:
        return True
    has_weights = any(w in names for w in WEIGHTS)
    return has_weights and (any(m in names for m in _MARKERS) or any(map(_RNG.match, names)))


def kind(path: str) -> str:
    """``"trainer"`` (a Trainer checkpoint) or ``"accelerate"`` (an Accelerate state folder)."""
    names = set(os.listdir(path))
    trainer = TRAINER_STATE in names or "optimizer.pt" in names or "rng_state.pth" in names
    return "trainer" if trainer else "accelerate"


def checkpoints_of(folder: str | os.PathLike[str]) -> dict[int, str]:
    """``{folder number: path}`` of a run folder's ``checkpoint-N/`` subfolders that hold a
    checkpoint (:func:`can_open`), in step order; empty for any other folder.

    The folder is listed once (``os.scandir``: no stat per entry); only subfolders named
    ``checkpoint-N`` are looked into, at most :data:`MAX_CHECKPOINTS` of them (more is
    refused before any is opened). A ``checkpoint-N`` that is a symbolic link is followed
    only when it stays inside the run folder: one that leads out is refused, naming it (a
    shared study would otherwise compare, and report, a folder outside it).
    """
    return dict(sorted(_checkpoints(os.fspath(folder), first_only=False).items()))


def is_run_folder(folder: str | os.PathLike[str]) -> bool:
    """True for a Trainer output folder: one holding ``checkpoint-N/`` checkpoints."""
    return bool(_checkpoints(os.fspath(folder), first_only=True))


def _checkpoints(folder: str, *, first_only: bool) -> dict[int, str]:
    try:
        with os.scandir(folder) as it:
            named = [e for e in it if CHECKPOINT_DIR.match(e.name)]
    except OSError:
        return {}
    if len(named) > MAX_CHECKPOINTS:
        raise FormatError(
            f"holds {len(named):,} checkpoint-N entries, more than the {MAX_CHECKPOINTS:,} "
            "one training run's folder may hold; not read",
            path=folder,
        )
    found: dict[int, str] = {}
    for e in named:
        if e.is_symlink() and not contained(folder, e.path):
            raise FormatError(
                f"{e.name!r} is a symbolic link to {os.path.realpath(e.path)!r}, outside the "
                "run folder; only checkpoints inside it are read",
                path=folder,
            )
        if e.is_dir() and can_open(e.path):
            found[int(e.name[len("checkpoint-") :])] = e.path
            if first_only:
                break
    return found


# -- reading ------------------------------------------------------------------------------


class _Parts:
    """What the components of one folder add up to: tensors, scalars, notes, open sets."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.tensors: dict[str, Tensor] = {}
        self.scalars: dict[str, Any] = {}
        self.metadata: dict[str, str] = {}
        self.components: list[str] = []
        self.not_read: list[str] = []
        self.opened: list[TensorSet] = []

    def add(self, prefix: str, ts: TensorSet, what: str) -> None:
        self.opened.append(ts)
        self.components.append(what)
        for name, t in ts.items():
            full = prefix + name
            if full in self.tensors:
                raise FormatError(
                    f"two files of the folder hold the tensor {full!r}", path=self.path
                )
            if full != t.name:
                t = copy.copy(t)
                t.name = full
            self.tensors[full] = t
        for k, v in ts.scalars.items():
            self.scalars[prefix + k] = v
        for k, v in ts.metadata.items():
            self.metadata[prefix + k if prefix else k] = v

    def close(self) -> None:
        for ts in self.opened:
            ts.close()


def open_trainer(path: str | os.PathLike[str]) -> TensorSet:
    """Open a Trainer ``checkpoint-N/`` folder or an Accelerate state folder (module docstring)."""
    path = os.fspath(path)
    if not can_open(path):
        raise FormatError(
            "not a Hugging Face training checkpoint folder (no trainer_state.json, and no "
            "weights beside an optimizer, scheduler or RNG file)",
            path=path,
        )
    names = set(os.listdir(path))
    parts = _Parts(path)
    try:
        weights = next((w for w in WEIGHTS if w in names), None)
        model = None
        if weights is not None:
            model = _open(_member(path, weights))
            parts.add("", model, f"weights: {weights}")
        for fname in (n for n in OPTIMIZER if n in names):
            ts = _optional(_open, _member(path, fname), parts)
            if ts is not None:
                from dmlib.io._hf_names import name_optimizer_state

                ts, note = name_optimizer_state(ts, model, path)
                parts.add("optimizer.", ts, f"optimizer: {fname}")
                parts.metadata["optimizer.optimizer_state_names"] = note
        for fname in (n for n in SCHEDULER if n in names):
            ts = _optional(_open, _member(path, fname), parts)
            if ts is not None:
                parts.add("scheduler.", ts, f"scheduler: {fname}")
        _add_rng(path, names, parts)
        if TRAINER_STATE in names:
            parts.add(
                "trainer.",
                _trainer_state(path),
                "trainer: " + TRAINER_STATE,
            )
            step = parts.scalars.get("trainer.global_step")
            if isinstance(step, int) and not isinstance(step, bool):
                parts.scalars["step"] = step
        if TRAINING_ARGS in names:
            parts.metadata["not_tensors"] = (
                f"{TRAINING_ARGS}: the run's TrainingArguments (a pickled Python object, no "
                "tensors): not read"
            )
    except BaseException:
        parts.close()
        raise
    parts.metadata["components"] = "; ".join(parts.components)
    if parts.not_read:
        parts.metadata["not_read"] = "; ".join(parts.not_read)
    return TensorSet(
        parts.tensors,
        path=path,
        format="hf-trainer",
        metadata=parts.metadata,
        scalars=parts.scalars,
        layout={"kind": kind(path), "components": list(parts.components)},
        closer=parts.close,
    )


def _open(fpath: str) -> TensorSet:
    """One file of the folder, by its own format (whatever format the caller assumes)."""
    from dmlib.io import detect_format, open_tensors

    return open_tensors(fpath, format=detect_format(fpath))


def _optional(opener: Callable[[str], TensorSet], fpath: str, parts: _Parts) -> TensorSet | None:
    """The file's set, or None with a one-line note when the torch reader refuses it."""
    try:
        return opener(fpath)
    except (FormatError, UnsupportedError) as err:
        parts.not_read.append(f"{os.path.basename(fpath)}: {err.message}")
        return None


def _add_rng(path: str, names: set[str], parts: _Parts) -> None:
    from dmlib.io import open_tensors

    files = sorted((n for n in names if _RNG.match(n)), key=_rng_index)
    for fname in files:
        prefix = "rng." if len(files) == 1 else f"rng.{_rng_index(fname)}."
        fpath = _member(path, fname)
        try:
            ts = open_tensors(fpath, format="torch")
        except FormatError as err:
            from dmlib.io._hf_names import read_rng_states

            fallback = read_rng_states(fpath)  # None when torch cannot read it either
            if fallback is None:
                parts.not_read.append(f"{fname}: {err.message}")
                continue
            ts = fallback
        parts.add(prefix, ts, f"rng: {fname}")


def _rng_index(fname: str) -> int:
    m = _RNG.match(fname)
    return int(next((g for g in m.groups() if g is not None), 0)) if m else 0


# -- trainer_state.json -------------------------------------------------------------------


def _trainer_state(folder: str) -> TensorSet:
    """``trainer_state.json``: plain values as scalars, ``log_history`` as per-step tensors.

    Bounded before any tensor is made (:mod:`dmlib._limits`): the file's size, nesting,
    keys per object, the length of every joined name, the number of values and their
    names' characters together; each refusal names the file.
    """
    import numpy as np

    from dmlib import _limits

    fpath = os.path.join(folder, TRAINER_STATE)
    state, _ = json_member(folder, TRAINER_STATE, "trainer state")
    if not isinstance(state, dict):
        raise FormatError(
            f"trainer state is a JSON {type(state).__name__}, not an object", path=fpath
        )
    history = state.pop("log_history", [])
    if not isinstance(history, list):
        raise FormatError("trainer state's log_history is not a list", path=fpath)
    flat = _limits.Flattening(fpath, "trainer state")
    scalars: dict[str, Any] = {}
    _flat_json(state, None, scalars, flat)
    arrays = {}
    for key, pts in _series(history, fpath, flat).items():
        arrays[f"log_history.{key}"] = np.array([v for _, v in pts], dtype=np.float64)
        arrays[f"log_history.{key}.steps"] = np.array([s for s, _ in pts], dtype=np.int64)
    return ArrayTensorSet(arrays, path=fpath, format="json", scalars=scalars)


def _series(history: list[Any], fpath: str, flat: Any) -> dict[str, list[tuple[int, float]]]:
    """``log_history``'s numeric values, key by key, with their steps (two tensors a key)."""
    series: dict[str, list[tuple[int, float]]] = {}
    names: dict[str, str] = {}
    for i, entry in enumerate(history):
        if not isinstance(entry, dict):
            raise FormatError(f"log_history[{i}] is not an object", path=fpath)
        step = entry.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue  # an entry without its step cannot be placed on the curve
        for key, value in entry.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if key not in names:
                names[key] = flat.name(flat.name("log_history", key), "steps")
            flat.leaf(names[key])
            flat.leaf(names[key])
            series.setdefault(key, []).append((step, float(value)))
    return series


def _flat_json(obj: Any, prefix: str | None, out: dict[str, Any], flat: Any) -> None:
    """``obj``'s plain values into ``out`` under their key paths (``prefix``: the parent's,
    None at the top)."""
    if isinstance(obj, (dict, list)):
        flat.container()
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            _flat_json(v, flat.name(prefix, k), out, flat)
    elif prefix is None:
        return  # a plain value at the top: refused by the caller (not an object)
    elif obj is None or isinstance(obj, (bool, int, str)):
        flat.leaf(prefix)
        out[prefix] = obj
    elif isinstance(obj, float):
        flat.leaf(prefix)
        out[prefix] = obj if math.isfinite(obj) else repr(obj)
