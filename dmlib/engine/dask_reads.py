"""The Dask engine's structured reads: norms, padding and whole-tensor tasks.

Like the comparisons of :mod:`dmlib.engine.dask`, every task reads its bytes from a
path every worker can see and returns a small result: per-chunk sums of squares (added
here in the local engine's order, so the same bits), the nonzero padding slots (the
rows the answer reports), or whatever a whole-tensor task (a factorised layer) computes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dmlib import hashing
from dmlib.engine import refs
from dmlib.engine.dask import _compute, _dask, compute_batched
from dmlib.errors import DmlibError
from dmlib.tensor import Tensor, TensorSet


def map_tasks(fn: Callable[..., Any], arglists: Sequence[tuple[Any, ...]]) -> list[Any]:
    """``[fn(*args) for args in arglists]``, one Dask task each, in one graph."""
    dask = _dask()
    return _compute([dask.delayed(fn, pure=True)(*args) for args in arglists])


def _norm_spans(nbytes: int, itemsize: int, chunk: int) -> list[tuple[int, int]]:
    # pieces of about hashing.PIECE bytes, each a whole number of chunks, so that every
    # chunk of the local engine's sum lies in one piece
    step = max(1, hashing.PIECE // (chunk * itemsize)) * chunk * itemsize
    return [(s, min(s + step, nbytes)) for s in range(0, nbytes, step)]


def norms(tensors: Sequence[Tensor], chunk: int) -> list[float]:
    """||t||_F over the finite elements of each tensor, as ``ladder._norm(t.load(), chunk)``
    computes it: per-chunk float64 sums of squares from the workers, added here in order."""
    plan, args = [], []
    for t in tensors:
        ref = refs.ref_of(t)
        spans = _norm_spans(ref.nbytes, t.dtype.itemsize, chunk)
        plan.append(len(spans))
        args += [(ref, s, e, chunk) for s, e in spans]
    out = compute_batched(refs.norm_piece, args, [a[2] - a[1] for a in args])
    result, i = [], 0
    for n in plan:
        total = 0.0
        for chunk_sums in out[i : i + n]:
            for v in chunk_sums:
                total += v
        result.append(float(np.sqrt(total)))
        i += n
    return result


def buffer_base(ts: TensorSet) -> tuple[str, int]:
    """The file and byte offset of a tensor set's bytes; DmlibError when it has none."""
    buf = ts._buf
    if isinstance(buf, np.memmap) and buf.filename:
        return str(buf.filename), int(buf.offset)
    raise DmlibError(
        "engine='dask' reads padding from a file every worker can see; this tensor set is "
        "not memory-mapped from one (use engine='local')",
        path=ts.path,
    )


def padding_scans(ts: TensorSet, gaps: Sequence[tuple[int, int]]) -> list[dict[str, Any]]:
    """:func:`dmlib.engine.refs.scan_padding` of each ``(start, end)`` gap, read on workers.

    A gap longer than a piece is cut at multiples of ``hashing.PIECE`` (4-byte aligned,
    so every slot lies in one part) and its parts' results joined.
    """
    path, base = buffer_base(ts)
    plan, args = [], []
    for start, end in gaps:
        cuts = [
            start,
            *range((start // hashing.PIECE + 1) * hashing.PIECE, end, hashing.PIECE),
            end,
        ]
        parts = list(zip(cuts[:-1], cuts[1:]))
        plan.append(len(parts))
        args += [(path, base, s, e) for s, e in parts]
    out = compute_batched(refs.padding_piece, args, [a[3] - a[2] for a in args])
    scans, i = [], 0
    for n in plan:
        got = out[i : i + n]
        i += n
        scans.append(
            {
                "nonzero_bytes": sum(g["nonzero_bytes"] for g in got),
                "offsets": np.concatenate([g["offsets"] for g in got]),
                "bits": np.concatenate([g["bits"] for g in got]),
            }
        )
    return scans
