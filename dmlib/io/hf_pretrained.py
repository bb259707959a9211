"""Folders written by ``save_pretrained``: a transformers model folder and a PEFT adapter
folder, each read as one TensorSet.

- **A model folder** (``hf-model``): ``config.json`` beside the weights, the first present of
  ``model.safetensors.index.json`` (shards read by :mod:`dmlib.io.sharded`),
  ``model.safetensors``, ``pytorch_model.bin.index.json``, ``pytorch_model.bin`` (read by
  dmlib's restricted torch reader: no code runs from the file). Tensor names are the
  file's; ``config.json`` (a JSON object) is kept as compact JSON text in
  ``metadata["config.json"]`` (a difference there is a note, not a differing tensor).
- **A PEFT adapter folder** (``peft-adapter``): ``adapter_config.json`` beside
  ``adapter_model.safetensors`` or ``adapter_model.bin``. Tensor names are the file's
  (``base_model.model.<module>.lora_A.weight``...). The whole config is kept in
  ``metadata["adapter_config.json"]``; the values that change the weight the adapter adds
  are scalars (``adapter_config.r``, ``.lora_alpha``, ``.use_rslora``, ``.fan_in_fan_out``,
  ``.use_dora``, ``.peft_type``, ``.rank_pattern.<key>``, ``.alpha_pattern.<key>``), so two
  adapters whose scaling differs are never reported identical, even with equal factors.
  :mod:`dmlib.forensics.lora` reads the config as a structure.

A folder neither format takes gets a message naming the files each looked for
(:func:`near_miss`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from dmlib.errors import FormatError
from dmlib.tensor import TensorSet

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "MODEL_CONFIG",
    "MODEL_WEIGHTS",
    "adapter_config",
    "can_open_adapter",
    "can_open_model",
    "is_adapter",
    "looked_for",
    "near_miss",
    "open_adapter",
    "open_model",
]

MODEL_CONFIG = "config.json"
#: a model folder's weights files, in the order they are looked for (the first present is read)
MODEL_WEIGHTS = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)
ADAPTER_CONFIG = "adapter_config.json"
#: an adapter folder's weights files, in the order they are looked for
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# adapter_config.json keys that change the weight an adapter adds (scalars of the set)
_WEIGHT_KEYS = ("peft_type", "r", "lora_alpha", "use_rslora", "fan_in_fan_out", "use_dora")
_PATTERN_KEYS = ("rank_pattern", "alpha_pattern")
# config files are small; a larger one is not a config
# the names these formats look for in a folder: each is looked up by name (one lstat), so
# a folder of 100,000 entries costs what a folder of three does
_WANTED = (MODEL_CONFIG, *MODEL_WEIGHTS, ADAPTER_CONFIG, *ADAPTER_WEIGHTS)


def _names(path: str, wanted: tuple[str, ...] = _WANTED) -> set[str]:
    """Those of ``wanted`` that are entries of the folder ``path`` (none for a non-folder)."""
    if not os.path.isdir(path):
        return set()
    return {w for w in wanted if os.path.lexists(os.path.join(path, w))}


def _first(names: set[str], wanted: tuple[str, ...]) -> str | None:
    return next((w for w in wanted if w in names), None)


def can_open_model(path: str) -> bool:
    """True for a folder holding ``config.json`` and a model weights file."""
    names = _names(path, (MODEL_CONFIG, *MODEL_WEIGHTS))
    return MODEL_CONFIG in names and _first(names, MODEL_WEIGHTS) is not None


def can_open_adapter(path: str) -> bool:
    """True for a folder holding ``adapter_config.json`` and an adapter weights file."""
    names = _names(path, (ADAPTER_CONFIG, *ADAPTER_WEIGHTS))
    return ADAPTER_CONFIG in names and _first(names, ADAPTER_WEIGHTS) is not None


def is_adapter(path: str | os.PathLike[str]) -> bool:
    """True for a PEFT adapter folder, or an adapter weights file (``adapter_model.*``) with
    its ``adapter_config.json`` beside it."""
    path = os.fspath(path)
    if os.path.isdir(path):  # a Trainer checkpoint holding an adapter stays a Trainer's
        from dmlib.io import detect_format, is_folder_checkpoint

        return is_folder_checkpoint(path) and detect_format(path) == "peft-adapter"
    folder = os.path.dirname(path) or "."
    return os.path.basename(path) in ADAPTER_WEIGHTS and os.path.isfile(
        os.path.join(folder, ADAPTER_CONFIG)
    )


def looked_for() -> str:
    """What these formats look for in a folder, in words (for messages)."""
    return (
        f"{MODEL_CONFIG} + model.safetensors[.index.json] or pytorch_model.bin[.index.json] "
        f"(transformers), {ADAPTER_CONFIG} + adapter_model.safetensors or .bin (PEFT)"
    )


def near_miss(path: str) -> str | None:
    """Why a folder holding one half of a save_pretrained folder is not one, or None."""
    names = _names(path)
    pairs = ((MODEL_CONFIG, MODEL_WEIGHTS, "a transformers model folder"),
             (ADAPTER_CONFIG, ADAPTER_WEIGHTS, "a PEFT adapter folder"))  # fmt: skip
    for config, weights, what in pairs:
        if config in names and _first(names, weights) is None:
            return f"holds {config} but none of {', '.join(weights)}: not {what}"
        if config not in names and _first(names, weights) is not None:
            found = _first(names, weights)
            return f"holds {found} but no {config}: not {what} (name the file itself to read it)"
    return None


def _config(path: str, fname: str) -> dict[str, Any]:
    """A folder's JSON config file: an object, or a one-line error naming the file.

    Read as the Trainer folder's JSON is (:func:`dmlib.io._folderfiles.read_member`): a
    regular file inside the folder (a symlink leading out, a FIFO or a device refused,
    never waited on), of bounded size, keys per object and nesting."""
    from dmlib.io._folderfiles import json_member

    value, _ = json_member(path, fname, "config")
    if not isinstance(value, dict):
        raise FormatError(
            f"a JSON {type(value).__name__}, not an object", path=os.path.join(path, fname)
        )
    return value


def adapter_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``adapter_config.json`` of an adapter folder, as a dict."""
    return _config(os.fspath(path), ADAPTER_CONFIG)


def _weights(path: str, wanted: tuple[str, ...], what: str) -> TensorSet:
    from dmlib.io import open_tensors

    fname = _first(_names(path), wanted)
    if fname is None:
        raise FormatError(f"not {what}: none of {', '.join(wanted)} in it", path=path)
    fpath = os.path.join(path, fname)
    if fname.endswith(".index.json"):
        return open_tensors(fpath)  # the shard index (dmlib.io.sharded)
    return open_tensors(fpath, format="torch" if fname.endswith(".bin") else "safetensors")


def _folder_set(path: str, inner: TensorSet, fmt: str, extra: dict[str, Any]) -> TensorSet:
    """The weights file's set, as the folder's (its tensors, metadata and scalars kept)."""
    weights = os.path.basename(inner.path or "")
    metadata = {**inner.metadata, **extra.get("metadata", {})}
    scalars = {**inner.scalars, **extra.get("scalars", {})}
    layout = {**inner.layout, "weights": weights, "weights_format": inner.format}
    return TensorSet(
        dict(inner.items()), path=path, format=fmt, metadata=metadata, scalars=scalars,
        layout=layout, closer=inner.close,
    )  # fmt: skip


def open_model(path: str | os.PathLike[str]) -> TensorSet:
    """Open a transformers ``save_pretrained`` folder (module docstring)."""
    path = os.fspath(path)
    if MODEL_CONFIG not in _names(path):
        raise FormatError(f"not a transformers model folder: no {MODEL_CONFIG} in it", path=path)
    config = _config(path, MODEL_CONFIG)
    inner = _weights(path, MODEL_WEIGHTS, "a transformers model folder")
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return _folder_set(path, inner, "hf-model", {"metadata": {MODEL_CONFIG: text}})


def open_adapter(path: str | os.PathLike[str]) -> TensorSet:
    """Open a PEFT ``save_pretrained`` adapter folder (module docstring)."""
    path = os.fspath(path)
    if ADAPTER_CONFIG not in _names(path):
        raise FormatError(f"not a PEFT adapter folder: no {ADAPTER_CONFIG} in it", path=path)
    config = _config(path, ADAPTER_CONFIG)
    inner = _weights(path, ADAPTER_WEIGHTS, "a PEFT adapter folder")
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    extra = {"metadata": {ADAPTER_CONFIG: text}, "scalars": weight_scalars(config)}
    return _folder_set(path, inner, "peft-adapter", extra)


def weight_scalars(config: dict[str, Any]) -> dict[str, Any]:
    """The config values that change the weight an adapter adds, as scalars."""
    out: dict[str, Any] = {}
    for key in _WEIGHT_KEYS:
        value = config.get(key)
        if value is None or isinstance(value, (bool, int, float, str)):
            out[f"adapter_config.{key}"] = value
    for key in _PATTERN_KEYS:
        table = config.get(key) or {}
        if isinstance(table, dict):
            for k, v in table.items():
                if isinstance(v, (bool, int, float)):
                    out[f"adapter_config.{key}.{k}"] = v
    return out
