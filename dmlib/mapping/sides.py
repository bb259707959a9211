"""One side of a mapped comparison: a checkpoint, or several files read as one set.

Tensor-parallel checkpoints are one file per rank, each holding the same names. A side
given as a list of files, or as a directory that is not itself a checkpoint (a PyTorch
DCP directory is one), is read as a single set whose names are ``FILE:NAME`` (``FILE``:
the path relative to the directory, or the file name for a list), so that a rule can
capture the rank (``source = "rank{r}.safetensors:fc.weight"``) and concatenate shards.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Iterator, Sequence
from typing import Any

from dmlib.errors import DmlibError
from dmlib.tensor import TensorSet

__all__ = ["is_multi", "opened_side", "side_label"]

SEPARATOR = ":"


def is_multi(source: Any) -> bool:
    """True for a list of paths, or a directory no reader opens as one checkpoint."""
    if isinstance(source, (list, tuple)):
        return True
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        from dmlib.io import is_dcp_folder

        return not is_dcp_folder(source)
    return False


def side_label(source: Any) -> str:
    """How messages name a side."""
    if isinstance(source, (list, tuple)):
        return ", ".join(os.fspath(p) for p in source)
    if isinstance(source, TensorSet):
        return source.path or "the set"
    return os.fspath(source) if isinstance(source, (str, os.PathLike)) else "the set"


def _files_of(source: Any) -> list[tuple[str, str]]:
    """(label, path) of every file of a multi-file side, in name order."""
    from dmlib.io import format_for_suffix

    if isinstance(source, (list, tuple)):
        paths = [os.fspath(p) for p in source]
        if not paths:
            raise DmlibError("an empty list of files is not a checkpoint")
        labels = [os.path.basename(p) for p in paths]
        if len(set(labels)) != len(labels):
            root = os.path.commonpath([os.path.abspath(p) for p in paths])
            labels = [os.path.relpath(os.path.abspath(p), root) for p in paths]
        return list(zip(labels, paths, strict=True))
    root = os.fspath(source)
    found = []
    for d, subdirs, files in os.walk(root):
        subdirs[:] = sorted(s for s in subdirs if not s.startswith("."))
        for f in sorted(files):
            if not f.startswith(".") and format_for_suffix(f) is not None:
                p = os.path.join(d, f)
                found.append((os.path.relpath(p, root).replace(os.sep, "/"), p))
    if not found:
        raise DmlibError(
            "directory holds no tensor file (.safetensors, .pt, .npz, ...) and is not a "
            "DCP checkpoint",
            path=root,
        )
    return found


def _joined(parts: Sequence[tuple[str, TensorSet]], label: str) -> TensorSet:
    tensors = {}
    for file_label, ts in parts:
        for t in ts.disk_order():
            t2 = copy.copy(t)
            t2.name = f"{file_label}{SEPARATOR}{t.name}"
            tensors[t2.name] = t2

    def close() -> None:
        for _, ts in parts:
            ts.close()

    return TensorSet(tensors, path=label, format="files", closer=close)


@contextlib.contextmanager
def opened_side(source: Any) -> Iterator[TensorSet]:
    """The side as one TensorSet; closes on exit whatever was opened here."""
    if not is_multi(source):
        from dmlib.sources import opened

        with opened(source) as ts:
            yield ts
        return
    from dmlib.io import open_tensors

    parts: list[tuple[str, TensorSet]] = []
    try:
        for file_label, path in _files_of(source):
            parts.append((file_label, open_tensors(path)))
        ts = _joined(parts, side_label(source))
    except BaseException:
        for _, p in parts:
            p.close()
        raise
    try:
        yield ts
    finally:
        ts.close()
