"""Per-sequence log-probs as JSON lines: one sequence per line, read into named arrays.

Each line is one object, ``{"logprobs": [...], "tokens": [...]}``, with the optional keys
``positions``, ``mask`` (lists as long as ``logprobs``), ``top_logprobs`` / ``top_ids`` and
``logits`` (lists of lists, all of one length); a first line ``{"metadata": {...}}``
(names to plain values) is the file's metadata. Sequence ``n``'s lists become the arrays
``<key>.n`` of an :class:`~dmlib.tensor.ArrayTensorSet` (floats as float64, integers as
int64, a mask as booleans or 0/1 integers): the ragged layout
:mod:`dmlib.stats.logprob_sides` reads. Blank lines are skipped.

Not a checkpoint format (no row in :data:`dmlib.io.REGISTRY`): a file is JSONL by its
suffix alone (:func:`is_jsonl`; a first byte ``{`` could open a safetensors header just as
well). Bounded before anything is parsed: the file's size (:func:`jsonl_max_bytes`), read
once as a regular file (:func:`dmlib.safepaths.read_regular`: a FIFO is refused, never
waited on; a file that changes while read is refused); then per line its bytes
(:data:`JSONL_MAX_LINE_BYTES`), the keys of each object
(:data:`dmlib._limits.MAX_JSON_KEYS`), nesting (a line holds at most lists of lists in an
object: anything deeper is refused, as is JSON nested past the parser's recursion), the
lines (:data:`JSONL_MAX_LINES`) and the entries of each list (:data:`JSONL_MAX_TOKENS`).
Every refusal is a :class:`~dmlib.errors.FormatError` naming the file and the line.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from dmlib._limits import MAX_NESTING, human, json_pairs_hook, limit_hint, max_decompressed
from dmlib.errors import FormatError
from dmlib.safepaths import read_regular
from dmlib.tensor import ArrayTensorSet

__all__ = [
    "JSONL_MAX_LINES",
    "JSONL_MAX_LINE_BYTES",
    "JSONL_MAX_TOKENS",
    "JSONL_SUFFIXES",
    "KEYS",
    "is_jsonl",
    "jsonl_max_bytes",
    "read_jsonl",
]

#: Lines (sequences) per file, bytes per line (its newline included), entries per list.
JSONL_MAX_LINES = 1 << 22
JSONL_MAX_LINE_BYTES = 1 << 28
JSONL_MAX_TOKENS = 1 << 22
#: The suffixes a JSONL file is told by (compared lower-cased).
JSONL_SUFFIXES = (".jsonl", ".ndjson")

#: The keys a sequence's object may hold: (dimensions, number kinds numpy may infer).
KEYS: dict[str, tuple[int, str]] = {
    "logprobs": (1, "fi"),
    "tokens": (1, "i"),
    "positions": (1, "i"),
    "mask": (1, "ib"),
    "top_logprobs": (2, "fi"),
    "top_ids": (2, "i"),
    "logits": (2, "fi"),
}


def jsonl_max_bytes() -> int:
    """The largest JSONL file read: 1/8 of :func:`dmlib._limits.max_decompressed` (a
    float in a parsed list takes about 32 bytes for its 8 to 20 characters of text)."""
    return max_decompressed() // 8


def is_jsonl(path: Any) -> bool:
    """Whether ``path`` names a JSONL file: by its suffix (:data:`JSONL_SUFFIXES`) alone."""
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).lower().endswith(JSONL_SUFFIXES)


def read_jsonl(path: str | os.PathLike[str]) -> ArrayTensorSet:
    """The JSONL file at ``path`` as a ragged :class:`ArrayTensorSet` (see the module
    docstring): ``logprobs.0``, ``tokens.0``, ..., ``logprobs.1``, ...; its metadata line
    as the set's metadata. Refused (:class:`FormatError`) past any bound or on any line
    that is not one sequence's object."""
    p = os.fspath(path)
    data = _read_bounded(p)
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, str] = {}
    n = 0
    for lineno, line in _lines(data, p):
        if not line.strip():
            continue
        obj = _json_line(line, lineno, p)
        if n == 0 and not arrays and set(obj) == {"metadata"}:
            meta = _metadata(obj["metadata"], lineno, p)
            continue
        if n >= JSONL_MAX_LINES:
            raise FormatError(f"more than {JSONL_MAX_LINES} sequences", path=p)
        for kind, arr in _sequence(obj, lineno, p).items():
            arrays[f"{kind}.{n}"] = arr
        n += 1
    if n == 0:
        raise FormatError("no sequence in the file (one JSON object per line expected)", path=p)
    return ArrayTensorSet(arrays, path=p, format="jsonl", metadata=meta)


def _read_bounded(p: str) -> bytes:
    """The file's bytes: its size checked first (with the hint to raise the limit), then
    read as a regular file whose size is checked again where it is opened."""
    real = os.path.realpath(p)
    try:
        size = os.stat(real).st_size
    except OSError as err:
        raise FormatError(f"cannot read: {err.strerror or err}", path=p) from None
    limit = jsonl_max_bytes()
    if size > limit:
        raise FormatError(
            f"JSONL file of {human(size)} is over the {human(limit)} read ({limit_hint()})",
            path=p,
        )
    return read_regular(real, where=p, error=FormatError, limit=limit, kind="a JSONL file")


def _lines(data: bytes, p: str) -> Any:
    """``(line number, line)`` of every line (its newline kept), each at most
    :data:`JSONL_MAX_LINE_BYTES` bytes: a longer one is refused before it is copied."""
    start, lineno, size = 0, 0, len(data)
    while start < size:
        lineno += 1
        end = data.find(b"\n", start, start + JSONL_MAX_LINE_BYTES)
        end = end + 1 if end >= 0 else min(size, start + JSONL_MAX_LINE_BYTES + 1)
        if end - start > JSONL_MAX_LINE_BYTES:
            raise FormatError(f"line {lineno} is longer than {human(JSONL_MAX_LINE_BYTES)}", path=p)
        yield lineno, data[start:end]
        start = end


def _json_line(line: bytes, lineno: int, path: str) -> dict[str, Any]:
    try:
        obj = json.loads(line, object_pairs_hook=json_pairs_hook(path, f"line {lineno}"))
    except FormatError:  # the keys' bound (a ValueError too): its own message
        raise
    except RecursionError:
        raise FormatError(
            f"line {lineno}: nested too deeply (more than {MAX_NESTING} levels of lists or "
            "objects)",
            path=path,
        ) from None
    except ValueError as err:
        raise FormatError(f"line {lineno}: not JSON ({str(err)[:80]})", path=path) from None
    if not isinstance(obj, dict):
        raise FormatError(
            f"line {lineno}: expected a JSON object, got {type(obj).__name__}", path=path
        )
    return obj


def _metadata(meta: Any, lineno: int, path: str) -> dict[str, str]:
    if not isinstance(meta, dict) or not all(
        isinstance(v, (str, int, float, bool)) for v in meta.values()
    ):
        raise FormatError(f"line {lineno}: 'metadata' must map names to plain values", path=path)
    return {str(k): str(v) for k, v in meta.items()}


def _sequence(obj: dict[str, Any], lineno: int, path: str) -> dict[str, np.ndarray]:
    """One line's arrays. Each value must be a list that numpy reads as a 1-D (or, for
    the top-k lists and logits, 2-D) array of the key's number kinds: so nothing nested
    deeper than an object of lists of lists gets through."""
    if "logprobs" not in obj:
        raise FormatError(f"line {lineno}: no 'logprobs' list", path=path)
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        raise FormatError(
            f"line {lineno}: unknown key(s) {unknown[:4]}; known: {sorted(KEYS)}", path=path
        )
    out: dict[str, np.ndarray] = {}
    for kind, value in obj.items():
        ndim, kinds = KEYS[kind]
        if not isinstance(value, list) or len(value) > JSONL_MAX_TOKENS:
            raise FormatError(
                f"line {lineno}: {kind!r} must be a list of at most {JSONL_MAX_TOKENS} entries",
                path=path,
            )
        arr = _array(value)
        empty = arr is not None and arr.size == 0 and arr.ndim == 1
        if arr is None or not (empty or (arr.ndim == ndim and arr.dtype.kind in kinds)):
            what = "integers" if kinds == "i" else "numbers"
            what = what if ndim == 1 else f"lists of {what}, all of one length"
            raise FormatError(f"line {lineno}: {kind!r} must hold {what}", path=path)
        if empty and ndim == 2:
            arr = arr.reshape(0, 0)
        out[kind] = arr.astype(np.float64 if "f" in kinds else np.int64)
    return out


def _array(value: list[Any]) -> np.ndarray | None:
    """The list as numpy infers it (bools stay bools, ints ints), None when ragged, mixed
    or nested past numpy's dimensions."""
    try:
        arr = np.array(value)
    except (ValueError, TypeError, OverflowError, RecursionError):
        return None
    return None if arr.dtype == object else arr
