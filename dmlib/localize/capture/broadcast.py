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

from typing import Any, cast

from dmlib.hashing import CHECKSUM
from dmlib.localize.capture.digests import _device_checksums, digest_hex
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
    """Hash ``t`` whole and, per request, the rows of the positions it occupies.

    On the recorder's path: the digests of a tensor recorded so before at the same
    version are shared (a rotary embedding's cos and sin reach every layer), and a
    device tensor is checksummed where it lives (``cksum4-v1``) where ``device_hash``
    allows; else the host hashes a copy."""
    n = rec.layout[1]
    original, t = t, (t.detach() if t.requires_grad else t)
    entry = rec._entry(module, call, kind, slot, t.dtype, tuple(t.shape), None)
    entry["row_dims"] = k
    entry["broadcast"] = True
    rec.boundaries.append(entry)
    if rec._share(entry, original, ("broadcast", k), False):
        return str(entry["name"])
    columns = {r: [int(i) % n for i in idx] for r, idx in rec.row_map.requests.items()}
    if rec.device_hash and (not t.is_cpu or rec._device_path_on_cpu):
        try:  # (checksums do not depend on how the bytes are cut into rows)
            whole, _, requests = _device_checksums(t.reshape(n, -1), 1, None, False,
                                                   cast(Any, _Columns(columns)),
                                                   rec.block_rows)  # fmt: skip
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            pass  # the host hashes it instead
        else:
            entry["hash"], entry["digest"], entry["requests"] = CHECKSUM, whole, requests
            return str(entry["name"])
    arr = _to_numpy(t)
    entry["digest"] = digest_hex(arr, rec.scheme)
    entry["requests"] = rec._row_set_digests(arr.reshape(n, -1), columns)
    return str(entry["name"])


class _Columns:
    """What :func:`_device_checksums` reads of a row map for rows read by index of axis 0:
    ``requests``, each request's rows (here the columns it occupies) in order."""

    def __init__(self, requests: dict[str, list[int]]) -> None:
        self.requests = requests


__all__ = ["position_dims", "record_broadcast"]
