"""Per-position tensors broadcast over the batch, read per request by position.

A rotary embedding's cos and sin (``[1, L, d]``, or ``[L, d]``) and an absolute position table's
position ids (``[1, L]``) hold one row per position,
shared by every batch row of a ``(batch, L)`` layout: their leading dims do not flatten to
the row map's ``batch x L`` rows, so they were hashed whole and never judged against a
capture of another batch. Here each request's digests are of the rows of the positions it
occupies (the column of each of its physical rows, in the request's position order), so
position p of a request is compared with position p of it on the other side whatever the
batch (``broadcast`` in the manifest entry; ``row_dims`` the dims standing for the
positions). Only in the first pass, only with a batch of more than one row (with one
row such a tensor fits the row map as it is), and not for op tensors, layout inputs or
dumps (a broadcast boundary is hashed, never dumped).
"""

from __future__ import annotations

from typing import Any

from dmlib.localize.capture.digests import digest_hex
from dmlib.localize.capture.tensors import _to_numpy


def position_dims(rec: Any, shape: tuple[int, ...]) -> int | None:
    """The dims of ``shape`` that stand for the layout's positions (2 for ``[1, L, ...]``, 1
    for ``[L, ...]``), where ``rec``'s layout has more than one batch row; else None."""
    layout = rec.layout
    if layout is None or layout[0] < 2 or rec.step or rec.row_map is None:
        return None
    n = layout[1]
    if len(rec.row_map) != layout[0] * n:
        return None
    if len(shape) >= 2 and shape[0] == 1 and shape[1] == n:  # [1, L, ...], position ids [1, L]
        return 2
    if len(shape) >= 2 and shape[0] == n:
        return 1
    return None


def record_broadcast(rec: Any, module: str, call: int, kind: str, slot: str, t: Any, k: int) -> str:
    """Hash ``t`` whole and, per request, the rows of the positions it occupies."""
    n = rec.layout[1]
    t = t.detach() if t.requires_grad else t
    arr = _to_numpy(t)
    flat = arr.reshape(n, -1)
    columns = {r: [int(i) % n for i in idx] for r, idx in rec.row_map.requests.items()}
    entry = rec._entry(module, call, kind, slot, t.dtype, tuple(t.shape), None)
    entry["digest"] = digest_hex(arr, rec.scheme)
    entry["requests"] = rec._row_set_digests(flat, columns)
    entry["row_dims"] = k
    entry["broadcast"] = True
    rec.boundaries.append(entry)
    return str(entry["name"])


__all__ = ["position_dims", "record_broadcast"]
