"""One side of a log-prob comparison: per-sequence log-probs read from a file or memory.

The layouts (``docs/logprobs.md`` is the user's page):

*Padded*: a tensor ``logprobs`` ``[S, T]`` (float), with ``mask`` ``[S, T]`` (bool or 0/1:
1 counts) or ``lengths`` ``[S]`` (the first ``lengths[s]`` positions count), else every
position counts. Beside it, all optional and of the same ``[S, T]`` leading shape:
``tokens`` (int ids; ``token_ids`` and ``input_ids`` are the same), ``positions`` (int),
``top_logprobs`` with ``top_ids`` ``[S, T, K]``, ``logits`` ``[S, T, V]`` (the whole
distribution; log-probs are taken as well, the softmax is applied).

*Ragged*: one tensor per sequence: ``logprobs.0``, ``logprobs.1``, ... (``[T_s]``), with
``tokens.N``, ``positions.N``, ``mask.N``, ``top_logprobs.N`` / ``top_ids.N`` (``[T_s, K]``)
and ``logits.N`` (``[T_s, V]``) beside them; a ``torch.save``\\ d list of tensors (names
``0``, ``1``, ...) is a ragged ``logprobs``. A file holding one float tensor of another
name is taken as ``logprobs``.

*JSONL*: one sequence per line, ``{"logprobs": [...], "tokens": [...]}`` with the same
optional keys (``top_logprobs`` / ``top_ids`` / ``logits`` as lists of lists); a first line
``{"metadata": {...}}`` is the file's metadata. Read by :mod:`dmlib.io.jsonl_logprobs`
(its bounds are there) into the ragged layout.

Metadata (safetensors ``__metadata__``, a torch file's scalars, the JSONL metadata line)
holds what the identity gate compares: :data:`IDENTITY_KEYS`.

A *position* is the index of a token among the counted tokens of its sequence (the
mask's ones, in order), the same in every layout.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dmlib.errors import DmlibError
from dmlib.io.jsonl_logprobs import is_jsonl, read_jsonl
from dmlib.sources import opened
from dmlib.tensor import TensorSet

__all__ = [
    "IDENTITY_KEYS",
    "KINDS",
    "LogprobSide",
    "read_jsonl",
    "read_mask",
    "read_side",
]

#: What may be beside ``logprobs``, each with its aliases (first: the name used here).
KINDS: dict[str, tuple[str, ...]] = {
    "logprobs": ("logprobs",),
    "tokens": ("tokens", "token_ids", "input_ids"),
    "positions": ("positions",),
    "mask": ("mask",),
    "top_logprobs": ("top_logprobs",),
    "top_ids": ("top_ids",),
    "logits": ("logits",),
}
_TRAILING = {"top_logprobs": 1, "top_ids": 1, "logits": 1}  # dims after [S, T] / [T_s]

#: Metadata keys the identity gate compares where both sides give them.
IDENTITY_KEYS = (
    "weights_hash",
    "model",
    "tokenizer",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
)


@dataclass
class LogprobSide:
    """One side: the counted tokens of every sequence as flat arrays, plus metadata.

    ``arrays[kind]`` is a list of per-sequence arrays (``[T_s, ...]``, the counted tokens
    only); ``offsets`` the start of each sequence in a flat concatenation.
    """

    label: str
    arrays: dict[str, list[np.ndarray]]
    metadata: dict[str, str] = field(default_factory=dict)
    raw_mask: list[np.ndarray] | None = None  # the side's own mask, per sequence
    # padded arrays where every position counts: a block of sequences is then a view
    dense: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def n_seq(self) -> int:
        return len(self.arrays["logprobs"])

    @property
    def lengths(self) -> np.ndarray:
        return np.array([len(a) for a in self.arrays["logprobs"]], dtype=np.int64)

    def has(self, kind: str) -> bool:
        return kind in self.arrays

    def dtype(self) -> np.dtype:
        first = next((a for a in self.arrays["logprobs"]), None)
        return np.dtype(np.float32) if first is None else first.dtype

    def flat(self, kind: str, s0: int, s1: int) -> np.ndarray:
        """The counted tokens of sequences ``s0 .. s1 - 1`` of ``kind``, concatenated."""
        whole = self.dense.get(kind)
        if whole is not None:
            return whole[s0:s1].reshape(-1, *whole.shape[2:])
        parts = self.arrays[kind][s0:s1]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0)


def read_side(source: Any, label: str, *, mask: Any = None) -> LogprobSide:
    """A :class:`LogprobSide` from a path (any format dmlib reads, or ``.jsonl``), a
    TensorSet, a mapping name -> array, a list of per-sequence arrays or an ``[S, T]``
    array; ``mask`` (the same forms) is applied on top of the side's own mask."""
    if isinstance(source, LogprobSide):
        return source
    if isinstance(source, np.ndarray) or (
        isinstance(source, Sequence) and not isinstance(source, (str, bytes))
    ):
        source = _from_arrays(source)
    if is_jsonl(source):
        source = read_jsonl(source)
    where = label
    with opened(source) as ts:
        where = ts.path or label
        side = _side_of(ts, label, where)
    if mask is not None:
        side = _apply_mask(side, read_mask(mask, side, where))
    return side


def _from_arrays(values: Any) -> dict[str, np.ndarray]:
    if isinstance(values, np.ndarray) and values.ndim in (1, 2):
        return {"logprobs": values if values.ndim == 2 else values[None, :]}
    return {f"logprobs.{i}": np.asarray(v) for i, v in enumerate(values)}


# -- tensor sets -------------------------------------------------------------------------


def _names_of(ts: TensorSet) -> dict[str, str | list[str]]:
    """kind -> tensor name (padded) or ordered list of names (ragged)."""
    names = list(ts)
    found: dict[str, str | list[str]] = {}
    for kind, aliases in KINDS.items():
        for alias in aliases:
            if alias in ts:
                found[kind] = alias
                break
            rx = re.compile(re.escape(alias) + r"\.(\d+)")
            ragged = sorted(
                (int(m.group(1)), n) for n in names if (m := rx.fullmatch(n)) is not None
            )
            if ragged:
                found[kind] = [n for _, n in ragged]
                break
    if "logprobs" not in found:
        found.update(_bare_logprobs(ts, names))
    return found


def _bare_logprobs(ts: TensorSet, names: list[str]) -> dict[str, str | list[str]]:
    """A ``torch.save``\\ d list (names ``0``, ``1``, ...) or a lone float tensor."""
    if names and all(n.isdigit() for n in names):
        return {"logprobs": sorted(names, key=int)}
    floats = [n for n in names if ts[n].dtype.kind == "f" or ts[n].dtype.name == "bfloat16"]
    if len(names) == 1 and floats:
        return {"logprobs": names[0]}
    shown = ", ".join(repr(n) for n in names[:8]) + (" ..." if len(names) > 8 else "")
    raise DmlibError(
        "no log-probs found: expected a tensor 'logprobs' ([S, T], padded) or 'logprobs.0', "
        f"'logprobs.1', ... (one per sequence); the file holds {shown or 'no tensors'}",
        path=ts.path,
    )


def _side_of(ts: TensorSet, label: str, where: str) -> LogprobSide:
    found = _names_of(ts)
    meta = {**{k: str(v) for k, v in ts.scalars.items()}, **ts.metadata}
    lp = found["logprobs"]
    if isinstance(lp, str):
        arrays, raw_mask, dense = _padded(ts, found, where)
    else:
        (arrays, raw_mask), dense = _ragged(ts, found, where), {}
    for kind, per in arrays.items():
        _check_dtype(kind, per, where)
    return LogprobSide(label, arrays, meta, raw_mask, dense)


def _load(ts: TensorSet, name: str) -> np.ndarray:
    # a plain ndarray over the reader's bytes (a memmap subclass runs Python code for
    # each of the thousands of per-sequence views taken below)
    return np.asarray(ts[name].load())


def _padded(
    ts: TensorSet, found: Mapping[str, Any], where: str
) -> tuple[dict[str, list[np.ndarray]], list[np.ndarray] | None, dict[str, np.ndarray]]:
    lp = _load(ts, found["logprobs"])
    if lp.ndim == 1:
        lp = lp[None, :]
    if lp.ndim != 2:
        raise DmlibError(
            f"tensor 'logprobs' has shape {list(lp.shape)}: expected [S, T]", path=where
        )
    s, t = lp.shape
    keep = _padded_mask(ts, found, (s, t), where)
    arrays: dict[str, list[np.ndarray]] = {}
    dense: dict[str, np.ndarray] = {}
    for kind, name in found.items():
        if kind == "mask" or not isinstance(name, str):
            continue
        a = lp if kind == "logprobs" else _load(ts, name)
        if kind != "logprobs" and a.ndim == 1 + _TRAILING.get(kind, 0) and s == 1:
            a = a[None]
        want = 2 + _TRAILING.get(kind, 0)
        if a.ndim != want or a.shape[:2] != (s, t):
            raise DmlibError(
                f"tensor {name!r} has shape {list(a.shape)}: expected [{s}, {t}"
                f"{', K' if want == 3 else ''}] beside 'logprobs' [{s}, {t}]",
                path=where,
            )
        arrays[kind] = [a[i] if keep is None else a[i][keep[i]] for i in range(s)]
        if keep is None and a.flags.c_contiguous:
            dense[kind] = a
    own = None if keep is None or "mask" not in found else [keep[i] for i in range(s)]
    return arrays, own, dense


def _padded_mask(
    ts: TensorSet, found: Mapping[str, Any], shape: tuple[int, int], where: str
) -> np.ndarray | None:
    if "mask" in found and isinstance(found["mask"], str):
        return _as_mask(_load(ts, found["mask"]), shape, found["mask"], where)
    if "lengths" in ts:
        n = _load(ts, "lengths")
        if n.shape != (shape[0],) or n.dtype.kind not in "iu":
            raise DmlibError(
                f"tensor 'lengths' has shape {list(n.shape)} and dtype {n.dtype}: expected "
                f"[{shape[0]}] integers",
                path=where,
            )
        if len(n) and (n.min() < 0 or n.max() > shape[1]):
            raise DmlibError(f"tensor 'lengths' holds values outside 0..{shape[1]}", path=where)
        return np.arange(shape[1])[None, :] < n[:, None]
    return None


def _as_mask(m: np.ndarray, shape: tuple[int, ...], name: str, where: str) -> np.ndarray:
    if tuple(m.shape) != tuple(shape):
        raise DmlibError(
            f"mask {name!r} has shape {list(m.shape)}: expected {list(shape)}", path=where
        )
    if m.dtype == np.bool_:
        return m
    if m.dtype.kind not in "iu" or (m.size and (m.min() < 0 or m.max() > 1)):
        raise DmlibError(f"mask {name!r} must hold booleans or 0/1 integers", path=where)
    return m.astype(bool)


def _ragged(
    ts: TensorSet, found: Mapping[str, Any], where: str
) -> tuple[dict[str, list[np.ndarray]], list[np.ndarray] | None]:
    names = found["logprobs"]
    n = len(names)
    lp = [_load(ts, x) for x in names]
    for name, a in zip(names, lp, strict=True):
        if a.ndim != 1:
            raise DmlibError(f"tensor {name!r} has shape {list(a.shape)}: expected [T]", path=where)
    masks = None
    if "mask" in found:
        masks = [
            _as_mask(_load(ts, x), lp[i].shape, x, where)
            for i, x in enumerate(_per_seq(found["mask"], n, "mask", where))
        ]
    arrays: dict[str, list[np.ndarray]] = {}
    for kind, kind_names in found.items():
        if kind == "mask":
            continue
        per = (
            lp
            if kind == "logprobs"
            else [_load(ts, x) for x in _per_seq(kind_names, n, kind, where)]
        )
        for i, a in enumerate(per):
            want = 1 + _TRAILING.get(kind, 0)
            if a.ndim != want or a.shape[0] != lp[i].shape[0]:
                raise DmlibError(
                    f"{kind} of sequence {i} has shape {list(a.shape)}: expected "
                    f"[{lp[i].shape[0]}{', K' if want == 2 else ''}] beside its log-probs",
                    path=where,
                )
        arrays[kind] = per if masks is None else [a[m] for a, m in zip(per, masks, strict=True)]
    return arrays, masks


def _per_seq(names: Any, n: int, kind: str, where: str) -> list[str]:
    if isinstance(names, str) or len(names) != n:
        got = 1 if isinstance(names, str) else len(names)
        raise DmlibError(
            f"{kind}: {got} tensor(s) for {n} sequences (ragged log-probs need one "
            f"'{kind}.N' per sequence)",
            path=where,
        )
    return list(names)


def _check_dtype(kind: str, per: list[np.ndarray], where: str) -> None:
    if not per:
        return
    dt = per[0].dtype
    if kind in ("logprobs", "top_logprobs", "logits"):
        ok = dt.kind == "f" or dt.name == "bfloat16" or dt.name.startswith("float")
    else:
        ok = dt.kind in "iu"
    if not ok:
        raise DmlibError(
            f"{kind} has dtype {dt}: expected {'floats' if kind in ('logprobs', 'top_logprobs', 'logits') else 'integers'}",
            path=where,
        )
    if any(a.dtype != dt for a in per):
        raise DmlibError(f"{kind}: sequences hold different dtypes", path=where)


# -- masks -------------------------------------------------------------------------------


def read_mask(mask: Any, side: LogprobSide, where: str) -> list[np.ndarray]:
    """A mask given beside the inputs, per sequence of the side's *stored* layout: an
    ``[S, T]`` array or a list of per-sequence arrays, or a file holding ``mask``
    (``[S, T]`` or ``mask.N``) or a single tensor."""
    if isinstance(mask, (str, os.PathLike, TensorSet)) or isinstance(mask, Mapping):
        with opened(mask) as ts:
            names = list(ts)
            pick = "mask" if "mask" in ts else names[0] if len(names) == 1 else None
            if pick is not None:
                arr = ts[pick].load()
                return [np.asarray(r) for r in (arr if arr.ndim == 2 else arr[None])]
            ragged = sorted((int(n[5:]), n) for n in names if re.fullmatch(r"mask\.\d+", n))
            if not ragged:
                raise DmlibError(
                    "no mask found: expected a tensor 'mask' ([S, T]) or 'mask.0', 'mask.1', ...",
                    path=ts.path,
                )
            return [ts[n].load() for _, n in ragged]
    if isinstance(mask, np.ndarray) and mask.ndim == 2:
        return list(mask)
    return [np.asarray(m) for m in mask]


def _apply_mask(side: LogprobSide, masks: list[np.ndarray]) -> LogprobSide:
    """Keep the counted tokens the extra mask also keeps (it is given over the stored
    layout: the side's own mask, where it has one, says where its counted tokens sit)."""
    if len(masks) != side.n_seq:
        raise DmlibError(f"the mask has {len(masks)} sequences, {side.label} has {side.n_seq}")
    keep: list[np.ndarray] = []
    given: list[np.ndarray] = []
    for i, m in enumerate(masks):
        own = None if side.raw_mask is None else side.raw_mask[i]
        stored = len(own) if own is not None else len(side.arrays["logprobs"][i])
        m = _as_mask(np.asarray(m), (stored,), f"of sequence {i}", side.label)
        given.append(m)
        keep.append(m if own is None else m[own])
    arrays = {k: [a[m] for a, m in zip(v, keep, strict=True)] for k, v in side.arrays.items()}
    own_masks = side.raw_mask
    raw = given if own_masks is None else [o & m for o, m in zip(own_masks, given, strict=True)]
    return LogprobSide(side.label, arrays, side.metadata, raw)
