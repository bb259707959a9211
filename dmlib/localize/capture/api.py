"""The public entry of the capture: :func:`capture`, a ``with`` block that records the
forward passes run inside it (its rooms: :mod:`dmlib.localize.capture`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dmlib.errors import CaptureError
from dmlib.localize.capture.format import (
    HOST_SCHEMES,
    LAYOUT_INPUTS,
    root_label,
)
from dmlib.localize.capture.hooks import (
    _conclude,
    _hooked,
)
from dmlib.localize.capture.recorder import (
    Recorder,
)
from dmlib.localize.capture.rowmap import (
    RowMap,
)
from dmlib.localize.capture.tensors import (
    _require_torch,
    _select,
    default_modules,
)
from dmlib.localize.capture.writer import (
    _prepare_dir,
)

try:
    import torch
except ImportError:  # pragma: no cover - reading captures needs no torch; writing does
    torch = None  # type: ignore[assignment]


@contextlib.contextmanager
def capture(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    modules: str | Iterable[str] | None = None,
    row_map: Sequence[Any] | None = None,
    block_rows: int = 64,
    dump: str | Iterable[str] | None = None,
    dump_requests: Iterable[Any] | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    hash_threads: int = 2,
    device_hash: bool = True,
    ops: bool = False,
    op_modules: str | Iterable[str] | None = None,
    layout_inputs: str | Iterable[str] | None = None,
    hash: str = "xxh3",
) -> Iterator[Recorder]:
    """Capture module boundaries of the forward passes run inside the ``with`` block.

    Parameters
    ----------
    model
        The torch module whose submodules are hooked.
    path
        Capture directory (created). ``manifest.json`` is written last; an interrupted
        run leaves a manifest marked incomplete, which :func:`dmlib.open_capture` refuses.
    modules
        Module names or glob patterns (``"encoder.layer.0.*"``); default: every leaf
        module plus top-level blocks. ``""`` hooks the model itself.
    row_map
        One entry per physical row of the leading dimensions (batch x sequence, say):
        ``(request_id, position)`` or ``None`` for padding; or a list of such lists, one
        per batch row. Boundaries whose leading dimensions flatten to this many rows are
        hashed per request (``row_dims``); the others are hashed whole and per index of
        their first axis (``leading``), so that a per-sequence boundary (first axis =
        batch, e.g. pooled outputs) is attributed to the request filling each batch row.
        A row map that fits no boundary raises :class:`CaptureError`. A tensor whose
        leading dims flatten to the row map's length is read per position even if it is
        per sequence by meaning (``[batch, n]`` with ``n`` equal to the sequence length):
        choose shapes, or ``modules``, that keep the two apart.
    block_rows
        Positions per block hash.
    dump
        Glob patterns of boundary names whose full tensors are written (a module's
        output is named like the module, its inputs ``module:input0``...).
    dump_requests
        With ``dump``: write only these requests' rows (position order) instead of whole
        physical tensors.
    metadata
        JSON-able description stored in the manifest.
    overwrite
        Replace an existing capture at ``path``.
    hash_threads
        Worker threads that hash (and dump) host tensors while the forward pass runs
        (0: hash and write in the hook itself, with no copy of the tensor; with ``dump``,
        two more threads, which mostly wait on the disk). With ``hash="xxh3"`` (the
        default) host tensors are hashed in the hook whatever their size (hashing costs
        less than the copy a worker needs); with ``"blake3"``, those over 1 MiB are
        copied and hashed by the workers. Dumps over 1 MiB are written by the workers.
    device_hash
        Checksum tensors on a GPU (any non-CPU device) where they live, with torch ops
        (``cksum4-v1``, bit-exact with :func:`dmlib.hashing.checksum_host`); False: copy
        them to the host and hash there. Each boundary names its scheme (``hash``);
        captures compare only digests of one scheme.
    ops
        Also record every ATen (or custom) operation run inside the hooked modules,
        as boundaries named ``module/aten.addmm#0`` (see :mod:`dmlib.localize.ops`).
    op_modules
        Module names or glob patterns whose ops are recorded (default: ``modules``);
        an op belongs to the innermost such module running it.
    layout_inputs
        More inputs whose values follow the batch layout rather than one request's data
        (glob patterns on a keyword's name, ``"my_mask"``, or on a boundary name,
        ``"blocks.*:input2"``), added to :data:`~dmlib.localize.captures.LAYOUT_INPUTS`
        (attention masks, position ids, cache positions, cu_seqlens...). They are
        hashed whole, flagged ``layout`` and never judged as the request's values.
    hash
        The host tensors' digests: ``"xxh3"`` (``xxh3-128-tree-v1``, the default: XXH3-128,
        about ten times BLAKE3's speed) or ``"blake3"`` (``blake3-tree-v1``, what dmlib
        wrote before version 4: to compare with such captures). Captures compare only
        digests of one scheme; docs/formats.md says why XXH3 is enough for captures.

    KV caches (a transformers ``Cache`` or tuples of past keys and values under
    ``past_key_values`` and kin) entering a hooked module are hashed per layer (keys,
    values) and per request along their position axis (``cache``). Each forward pass of
    the model after the first (a decode step of ``generate()``) is numbered in its
    boundaries (``step``); :func:`dmlib.localize.hf.capture_generate` records the chosen
    tokens as well.
    """
    _require_torch()
    path = Path(path)
    named = dict(model.named_modules())  # walked once
    rec = _new_recorder(model, path, row_map=row_map, block_rows=block_rows, dump=dump,
                        dump_requests=dump_requests, metadata=metadata, overwrite=overwrite,
                        hash_threads=hash_threads, device_hash=device_hash,
                        layout_inputs=layout_inputs, scheme=hash, named=named)  # fmt: skip
    rec.write_manifest(complete=False, durable=False)  # marks a capture in progress
    tracker = None
    if ops:
        from dmlib.localize.ops import OpRecorder  # (it imports this package's rooms)

        tracker = OpRecorder(
            rec, model, _select(model, modules if op_modules is None else op_modules, named)
        )
    with _hooked(model, modules, rec, tracker, named):
        yield rec
    _conclude(rec, path)


def _new_recorder(
    model: torch.nn.Module,
    path: Path,
    *,
    row_map: Sequence[Any] | None,
    block_rows: int,
    dump: str | Iterable[str] | None,
    dump_requests: Iterable[Any] | None,
    metadata: dict[str, Any] | None,
    overwrite: bool,
    hash_threads: int,
    device_hash: bool,
    layout_inputs: str | Iterable[str] | None,
    scheme: str = "xxh3",
    named: dict[str, Any] | None = None,
) -> Recorder:
    """Check the arguments, prepare the folder and build the :class:`Recorder`."""
    if block_rows < 1:
        raise CaptureError(f"block_rows={block_rows}; expected a positive integer", path=path)
    host = HOST_SCHEMES.get(str(scheme).lower())
    if host is None:
        raise CaptureError(f"hash={scheme!r}; expected 'xxh3' or 'blake3'", path=path)
    extra_layout = (
        [] if layout_inputs is None
        else [layout_inputs] if isinstance(layout_inputs, str) else list(layout_inputs)
    )  # fmt: skip
    root = root_label(dict(model.named_modules()) if named is None else named)
    _prepare_dir(path, overwrite)
    return Recorder(
        path,
        row_map=None if row_map is None else RowMap.shared(row_map, path=path),
        block_rows=int(block_rows),
        dump=[] if dump is None else ([dump] if isinstance(dump, str) else list(dump)),
        dump_requests=None if dump_requests is None else {str(r) for r in dump_requests},
        metadata=dict(metadata or {}),
        hash_threads=int(hash_threads),
        device_hash=bool(device_hash),
        root=root,
        layout_inputs=(*LAYOUT_INPUTS, *extra_layout),
        scheme=host,
    )


__all__ = ["capture", "default_modules", "Recorder"]
