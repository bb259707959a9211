"""One file described: format, layout, records, tensors with their hashes, padding.

What ``dmlib inspect`` prints, as data.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from dmlib.errors import NotTensorsError
from dmlib.hashing import hash_bytes, new_hasher
from dmlib.io import open_tensors
from dmlib.padding import padding_census

__all__ = ["describe", "file_role"]


def describe(
    path: str | os.PathLike[str], *, format: str | None = None, hashes: bool = True
) -> dict[str, Any]:
    """Everything ``dmlib inspect`` shows about one file, as one dict.

    Parameters
    ----------
    path
        A checkpoint file (any format :func:`dmlib.open_tensors` reads).
    format
        Skip detection and read as this format.
    hashes
        SHA-256 of each tensor, each record, all tensor bytes and the whole file (one
        pass over the tensor bytes); False leaves them None.

    Returns
    -------
    dict
        ``path``, ``format``, ``layout``, ``metadata``, ``scalars``, ``n_tensors``,
        ``numel``, ``file_hash``, ``data_hash``, ``records`` (one dict per burnpack
        record), ``tensors`` (one dict per tensor in disk order, keys as in
        ``TensorSet.table()`` plus ``data_hash``), ``role`` (:func:`file_role`: what the
        file is, such as a Trainer RNG state, or None), for a Trainer checkpoint folder
        ``files`` (``{file: role}``), and for burnpack files ``padding``
        (:func:`dmlib.padding_census` as lists of rows). :func:`dmlib._json.jsonable`
        makes it JSON. A Trainer's ``training_args.bin`` (a pickled object, never
        unpickled) is described by its role alone, with no tensors.
    """
    try:
        ts = open_tensors(path, format=format)
    except NotTensorsError as err:  # training_args.bin: a pickled object, never unpickled
        args_doc = _not_tensors(path, err)
        if args_doc is None:
            raise
        return args_doc
    with ts:
        # one pass over the tensor bytes feeds every hash: per tensor, per record, whole data
        whole = new_hasher()
        per_record = {r.index: new_hasher() for r in ts.records}
        tensors = []
        for t in ts.disk_order():
            digest = None
            if hashes:
                raw = t.raw()
                digest = hash_bytes(raw)
                whole.update(raw.data)
                if t.record in per_record:
                    per_record[t.record].update(raw.data)
            tensors.append({**t.describe(), "data_hash": digest})
        doc: dict[str, Any] = {
            "path": ts.path,
            "format": ts.format,
            "layout": ts.layout,
            "metadata": ts.metadata,
            "scalars": ts.scalars,
            "n_tensors": len(ts),
            "numel": ts.numel,
            "file_hash": ts.file_hash() if hashes else None,
            "data_hash": whole.hexdigest() if hashes else None,
            "records": [
                {
                    "record": r.index,
                    "start": r.start,
                    "end": r.end,
                    "data_base": r.data_base,
                    "layout": r.layout["layout"],
                    "n_tensors": len(r),
                    "data_hash": per_record[r.index].hexdigest() if hashes else None,
                }
                for r in ts.records
            ],
            "tensors": tensors,
        }
        doc["role"] = file_role(
            [t.name for t in ts.disk_order()], ts.scalars, name=os.path.basename(str(path))
        )
        if ts.format == "hf-trainer":  # a checkpoint folder: what each of its files is
            doc["files"] = _folder_roles(ts)
        if ts.format == "burnpack":
            c = padding_census(ts)
            doc["padding"] = {
                "gaps": c.gaps.to_dict(orient="records"),
                "slots": c.slots.to_dict(orient="records"),
            }
    return doc


# -- what a file of a training checkpoint is ------------------------------------------

# the generators of a Trainer's rng_state.pth (its top-level keys) and their names here
_TRAINER_RNG = {"python": "python", "numpy": "numpy", "cpu": "torch CPU", "cuda": "CUDA",
                "mps": "MPS", "xpu": "XPU", "npu": "NPU", "hpu": "HPU", "mlu": "MLU"}  # fmt: skip
# an Accelerate random_states_<i>.pkl: its keys and the generators they hold
_ACCELERATE_RNG = {"random_state": "python", "numpy_random_seed": "numpy",
                   "torch_manual_seed": "torch CPU", "torch_cuda_manual_seed": "CUDA",
                   "torch_xpu_manual_seed": "XPU", "torch_npu_manual_seed": "NPU"}  # fmt: skip
_WEIGHTS = re.compile(r"^(?:model|pytorch_model)(?:-\d+-of-\d+)?\.(?:safetensors|bin)$")
_ADAPTER = re.compile(r"^adapter_model\.(?:safetensors|bin)$")


def file_role(
    names: Sequence[str], scalars: Mapping[str, Any], *, name: str = ""
) -> dict[str, str] | None:
    """What a file of a training checkpoint is, from its tensor and scalar names (and its
    file name for the weights): ``{"kind": ..., "text": ...}`` with kind ``rng_state``,
    ``optimizer``, ``scheduler``, ``weights`` or ``adapter``; None for anything else.

    >>> file_role(["numpy.1", "cpu"], {"python.0": 3})["text"]
    'a Trainer RNG state (python, numpy, torch CPU)'
    """
    heads = {k.split(".", 1)[0] for k in [*names, *scalars]}
    if heads and heads <= set(_TRAINER_RNG) and {"python", "cpu"} <= heads:
        gens = [v for k, v in _TRAINER_RNG.items() if k in heads]
        return {"kind": "rng_state", "text": f"a Trainer RNG state ({', '.join(gens)})"}
    if heads and heads <= {*_ACCELERATE_RNG, "step"} and "random_state" in heads:
        gens = [v for k, v in _ACCELERATE_RNG.items() if k in heads]
        return {"kind": "rng_state", "text": f"an Accelerate RNG state ({', '.join(gens)})"}
    if "param_groups" in heads and heads <= {"state", "param_groups", "param_names"}:
        return {"kind": "optimizer", "text": _optimizer_text(names, scalars)}
    if not names and "last_epoch" in scalars and ("base_lrs" in heads or "_last_lr" in heads):
        last = scalars.get("_last_lr.0")
        lr = f", learning rate {last}" if last is not None else ""
        text = f"a learning-rate scheduler state (step {scalars['last_epoch']}{lr})"
        return {"kind": "scheduler", "text": text}
    if _WEIGHTS.match(name) and names:
        return {"kind": "weights", "text": f"model weights ({len(names)} tensors)"}
    if _ADAPTER.match(name) and names:
        return {"kind": "adapter", "text": f"a PEFT adapter's weights ({len(names)} tensors)"}
    return None


def _optimizer_text(names: Sequence[str], scalars: Mapping[str, Any]) -> str:
    """An optimizer state dict in words: its parameters, the state each keeps, its groups."""
    per_param: dict[str, set[str]] = {}
    for n in names:
        if n.startswith("state."):
            param, _, key = n[len("state.") :].rpartition(".")
            per_param.setdefault(param, set()).add(key)
    keys = sorted({k for ks in per_param.values() for k in ks})
    groups = {k.split(".")[1] for k in scalars if k.startswith("param_groups.")}
    lrs = sorted({v for k, v in scalars.items() if re.fullmatch(r"param_groups\.\d+\.lr", k)})
    text = f"an optimizer state: {len(per_param)} parameter{'s' * (len(per_param) != 1)}"
    text += f" ({', '.join(keys)})" if keys else ""
    text += f", {len(groups)} parameter group{'s' * (len(groups) != 1)}"
    return text + (f" (lr {', '.join(map(str, lrs))})" if lrs else "")


def _folder_roles(ts: Any) -> dict[str, str]:
    """``{file: what it is}`` for each file of a Trainer or Accelerate checkpoint folder."""
    out: dict[str, str] = {}
    names = [t.name for t in ts.disk_order()]
    for entry in str(ts.metadata.get("components", "")).split("; "):
        comp, _, files = entry.partition(": ")
        for f in filter(None, files.split(", ")):
            if comp == "weights":  # the unprefixed names, whichever file holds each
                files_w = list(filter(None, files.split(", ")))
                sub = [n for n in names if n.split(".", 1)[0] not in _PREFIXES]
                role = file_role(sub, {}, name=f)
                text = role["text"] if role else "model weights"
                out[f] = (
                    text
                    if len(files_w) == 1
                    else f"{text.split(' (')[0]} (one of {len(files_w)} files)"
                )
                continue
            if comp == "trainer":
                out[f] = "the Trainer's state (global step, epoch, log history)"
                continue
            pre = comp + "."
            role = file_role(
                [n[len(pre) :] for n in names if n.startswith(pre)],
                {k[len(pre) :]: v for k, v in ts.scalars.items() if k.startswith(pre)},
                name=f,
            )
            out[f] = role["text"] if role else comp
    note = str(ts.metadata.get("not_tensors", ""))
    if note.startswith("training_args.bin"):
        out["training_args.bin"] = TRAINING_ARGS_TEXT
    return out


_PREFIXES = {"optimizer", "scheduler", "rng", "trainer"}
TRAINING_ARGS_TEXT = (
    "the Trainer's training arguments (a pickled transformers TrainingArguments: settings, "
    "no tensors; not unpickled, since unpickling runs code)"
)


def _not_tensors(path: str | os.PathLike[str], err: NotTensorsError) -> dict[str, Any] | None:
    """The description of a pickled object dmlib does not unpickle, when it is a Trainer's
    ``TrainingArguments``; None for any other object (the error stands)."""
    if "TrainingArguments" not in err.message:
        return None
    return {
        "path": os.fspath(path), "format": "torch", "layout": {}, "metadata": {},
        "scalars": {}, "n_tensors": 0, "numel": 0, "file_hash": None, "data_hash": None,
        "records": [], "tensors": [],
        "role": {"kind": "training_args", "text": TRAINING_ARGS_TEXT},
    }  # fmt: skip
