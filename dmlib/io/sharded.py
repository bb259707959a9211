"""Hugging Face sharded checkpoints: ``*.index.json`` naming the shard of every tensor.

``model.safetensors.index.json`` (safetensors shards) and ``pytorch_model.bin.index.json``
(``torch.save`` shards) share one layout: ``{"metadata": {...}, "weight_map": {name:
shard file}}``. The shards' format is read from their names (all must agree); each shard
is opened lazily by its own reader and must hold exactly the tensors the index gives it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from dmlib.errors import FormatError, UnsupportedError
from dmlib.tensor import FileStamp, Tensor, TensorSet

#: shard suffix -> format
SHARD_FORMATS = {".safetensors": "safetensors", ".bin": "torch", ".pt": "torch", ".pth": "torch"}


def can_open(path: str) -> bool:
    """A shard index: a path ending in ``.index.json`` (the name alone decides)."""
    return path.endswith(".index.json")


def _index(index_path: str) -> dict[str, Any]:
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(f"corrupt shard index ({err})", path=index_path) from None
    except RecursionError:
        raise FormatError("shard index nests too deeply to be an index", path=index_path) from None
    wmap = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wmap, dict):
        raise FormatError("shard index has no 'weight_map' object", path=index_path)
    for name, shard in wmap.items():
        if not isinstance(shard, str) or os.path.basename(shard) != shard or not shard:
            raise FormatError(
                f"tensor {name!r}: shard {shard!r} is not a file name in the index's folder",
                path=index_path,
            )
    return index


def shard_format(index_path: str | os.PathLike[str]) -> str:
    """The format of the shards an index names (``"safetensors"`` or ``"torch"``)."""
    index_path = os.fspath(index_path)
    shards = sorted(set(_index(index_path)["weight_map"].values()))
    odd = [s for s in shards if os.path.splitext(s)[1].lower() not in SHARD_FORMATS]
    kinds = {SHARD_FORMATS[os.path.splitext(s)[1].lower()] for s in shards if s not in odd}
    if odd:
        raise UnsupportedError(
            f"shard {odd[0]!r}: unknown shard type (expected {', '.join(SHARD_FORMATS)})",
            path=index_path,
        )
    if len(kinds) > 1:
        raise FormatError(f"shards of more than one format: {', '.join(shards)}", path=index_path)
    return kinds.pop() if kinds else "safetensors"


def open_index(index_path: str | os.PathLike[str]) -> TensorSet:
    """Open an index and its shards as one TensorSet (format: the shards')."""
    from dmlib.io import open_tensors

    index_path = os.fspath(index_path)
    stamp = FileStamp.take(index_path)
    index = _index(index_path)
    raw_meta = index.get("metadata") or {}
    if not isinstance(raw_meta, dict):
        raise FormatError(
            f"shard index 'metadata' is a {type(raw_meta).__name__}, not an object", path=index_path
        )
    meta = {k: str(v) for k, v in raw_meta.items()}
    fmt = shard_format(index_path)
    folder = os.path.dirname(index_path)
    shards: dict[str, TensorSet] = {}
    tensors: dict[str, Tensor] = {}
    for name, shard in index["weight_map"].items():
        if shard not in shards:
            spath = os.path.join(folder, shard)
            if not os.path.isfile(spath):
                raise FormatError(
                    f"shard {shard!r} listed for {name!r} does not exist", path=index_path
                )
            shards[shard] = open_tensors(spath, format=fmt)
        if name not in shards[shard]:
            raise FormatError(
                f"tensor {name!r} is listed in shard {shard!r}, which does not hold it",
                path=index_path,
            )
        tensors[name] = shards[shard][name]
    # a tensor in a shard that the index does not list would be silently lost
    for shard, ts in shards.items():
        extra = [n for n in ts if index["weight_map"].get(n) != shard]
        if extra:
            raise FormatError(
                f"shard {shard!r} holds {len(extra)} tensor(s) the index does not give it, e.g. {extra[0]!r}",
                path=index_path,
            )
    scalars: dict[str, Any] = {}
    for ts in shards.values():
        scalars.update(ts.scalars)

    def close() -> None:
        for ts in shards.values():
            ts.close()

    return TensorSet(
        tensors, path=index_path, format=fmt, metadata=meta, scalars=scalars,
        layout={"shards": sorted(shards), "shard_format": fmt}, closer=close, stamp=stamp,
    )  # fmt: skip
