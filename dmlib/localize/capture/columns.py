"""A later pass's rows of several positions, digested one position at a time.

A pass after the first of a prefill + decode capture (a speculative verification, a chunk
of a chunked prefill, a loop of one's own feeding several tokens per row) holds
``(batch, n, ...)`` tensors whose leading dims are not the row map's: they are hashed whole
and per batch row (``leading``), one digest covering a batch row's ``n`` columns. With
``block_rows=1`` (one digest per position: the full-sequence capture's per-position
scheme) each batch row's columns are also digested as a request's rows are, by the same
code: the row's digest over its columns and one block per column, column ``c``'s block the
digest of ``x[b, c]``'s bytes, as a full-sequence capture's block of that position is of
its row's bytes. The manifest entry's ``columns`` holds them: ``{"hash": scheme, "rows":
[{"digest", "n_rows", "blocks"} per batch row]}``, in the scheme the entry's own digests
have (``cksum4-v1`` where a device tensor is checksummed where it lives), so that a
comparison reading ``pass_rows`` judges column ``c`` of batch row ``b`` against the
position it computed by digest alone.

Only axis 1 is read as the columns, only where axis 0 is the layout's batch and axis 1
holds more than one entry, for tensors of three dims or more and integer ``(batch, n)``
ones (the token ids fed; a float ``(batch, n)`` tensor is a one-column pass's logits or a
pooled row, not columns), module and op boundaries alike (never a KV cache, a state or
another marked kind: those are not per-position rows of the pass).
"""

from __future__ import annotations

from typing import Any

from dmlib import hashing
from dmlib.localize.capture.digests import _device_checksums
from dmlib.localize.capture.rowmap import RowMap
from dmlib.localize.capture.tensors import _to_numpy
from dmlib.localize.capture.treehash import contiguous


def wants_columns(rec: Any, entry: dict[str, Any], shape: tuple[int, ...]) -> bool:
    """Whether ``entry`` (a tensor of ``shape`` recorded by ``rec``) is digested per column."""
    if rec.step == 0 or rec.block_rows != 1 or rec.row_map is None:
        return False
    if entry["leading"] is None or len(shape) < 2 or shape[1] < 2:
        return False
    if len(shape) == 2 and not entry["dtype"].startswith(("int", "uint", "bool")):
        return False  # (batch, vocab) logits of a one-column pass are no columns
    if any(k in entry for k in ("layout", "cache", "rolled", "state", "router", "grad",
                                "param_grad", "recorded", "expert")):  # fmt: skip
        return False
    batch = rec.row_map.batch or (rec.layout[0] if rec.layout else None)
    return batch is not None and shape[0] == batch


def record_columns(rec: Any, entry: dict[str, Any], t: Any) -> None:
    """Set ``entry["columns"]``: per batch row of ``t``, its columns' digests (block_rows=1)."""
    b, n = int(t.shape[0]), int(t.shape[1])
    t = t.detach() if t.requires_grad else t
    if (not t.is_cpu or rec._device_path_on_cpu) and rec.device_hash:
        rm = RowMap([[(str(i), c) for c in range(n)] for i in range(b)])
        try:
            got = _device_checksums(t.reshape(b * n, -1), 1, None, False, rm, 1)[2]
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            got = None  # hashed on the host below, as the entry itself then is
        if got is not None:
            entry["columns"] = _columns(hashing.CHECKSUM, got, b)
            return
    flat = contiguous(_to_numpy(t)).reshape(b * n, -1)
    rows = {str(i): list(range(i * n, (i + 1) * n)) for i in range(b)}
    entry["columns"] = _columns(rec.scheme, rec._row_set_digests(flat, rows), b)


def _columns(scheme: str, got: dict[str, dict[str, Any]], b: int) -> dict[str, Any]:
    return {"hash": scheme, "rows": [got[str(i)] for i in range(b)]}


__all__ = ["record_columns", "wants_columns"]
