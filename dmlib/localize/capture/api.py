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
    root_label,
)
from dmlib.localize.capture.hooks import (
    _conclude,
    _hooked,
)
from dmlib.localize.capture.options import UNSET, CaptureOptions
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
    torch,  # (None where torch is not installed)
)
from dmlib.localize.capture.writer import (
    _prepare_dir,
)


@contextlib.contextmanager
def capture(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    options: CaptureOptions | None = None,
    *,
    modules: str | Iterable[str] | None = UNSET,
    row_map: Sequence[Any] | None = UNSET,
    block_rows: int = UNSET,
    dump: str | Iterable[str] | None = UNSET,
    dump_requests: Iterable[Any] | None = UNSET,
    metadata: dict[str, Any] | None = UNSET,
    overwrite: bool = UNSET,
    hash_threads: int = UNSET,
    device_hash: bool = UNSET,
    ops: bool = UNSET,
    op_modules: str | Iterable[str] | None = UNSET,
    layout_inputs: str | Iterable[str] | None = UNSET,
    hash: str = UNSET,
    backward: bool = UNSET,
    grad_seed: int | None = UNSET,
    experts: bool = UNSET,
) -> Iterator[Recorder]:
    """Capture module boundaries of the forward passes run inside the ``with`` block.

    Parameters
    ----------
    model
        The torch module whose submodules are hooked.
    path
        Capture directory (created). ``manifest.json`` is written last; an interrupted
        run leaves a manifest marked incomplete, which :func:`dmlib.open_capture` refuses.
    options
        Every setting below in one :class:`~dmlib.localize.capture.options.CaptureOptions`
        (where each default is); a keyword given here replaces its field.
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
    backward
        Also record the backward passes run inside the block (:mod:`.backward`): each
        hooked module's gradients w.r.t. its outputs (``module:grad_output0``) and inputs
        (``module:grad_input0``), per request like the forward, in the order the hooks
        fire, and every parameter's ``.grad`` at the end of each backward pass
        (``name:grad``, ``name:grad#1``...: accumulated over the passes before it).
    grad_seed
        The seed of the random upstream gradient ``rec.backward(out)`` sends into ``out``
        (``out.backward(randn)``, the draws continuing over micro-batches; written in the
        manifest): a uniform gradient (``out.sum().backward()``) hides a backward whose
        atomic adds vary in order. None: ones.
    experts
        Also record each expert's rows of every experts module (transformers' 3-D
        ``gate_up_proj`` / ``down_proj`` modules) as boundaries of kind ``expert``,
        ``module:expert<e>.<stage>#call``: one SHA-256 digest per token routed to expert
        ``e``, per request by position (:mod:`.expertrows`), judged per (expert, request,
        position) by a comparison; the experts modules are hooked too. A module that
        cannot be judged so (an ``experts_implementation`` whose kernels are not read row by
        row, such as ``deepgemm``) is written into the capture as not judged, with the
        reason. Off by default: every torch call
        of the forward then passes a Python mode (cost: benchmarks/README.md).

    KV caches (a transformers ``Cache`` or tuples of past keys and values under
    ``past_key_values`` and kin) entering a hooked module are hashed per layer (keys,
    values) and per request along their position axis (``cache``). Each forward pass of
    the model after the first (a decode step of ``generate()``) is numbered in its
    boundaries (``step``); :func:`dmlib.localize.hf.capture_generate` records the chosen
    tokens as well.
    """
    _require_torch()
    path = Path(path)
    opts = _options(path, options, modules=modules, row_map=row_map, block_rows=block_rows,
                    dump=dump, dump_requests=dump_requests, metadata=metadata, overwrite=overwrite,
                    hash_threads=hash_threads, device_hash=device_hash, ops=ops,
                    op_modules=op_modules, layout_inputs=layout_inputs, hash=hash,
                    backward=backward, grad_seed=grad_seed, experts=experts)  # fmt: skip
    named = dict(model.named_modules())  # walked once
    rec = _new_recorder(model, path, opts, named)
    rec.write_manifest(complete=False, durable=False)  # marks a capture in progress
    tracker = None
    if opts.ops:
        from dmlib.localize.ops import OpRecorder  # (it imports this package's rooms)

        chosen = opts.modules if opts.op_modules is None else opts.op_modules
        tracker = OpRecorder(rec, model, _select(model, chosen, named))
    from dmlib.localize.capture.expertrows import routing_record
    from dmlib.localize.capture.record import active

    with (
        routing_record(rec, model),  # coverage.experts_modules, in every capture
        _experts(rec, model, named),
        _hooked(model, opts.modules, rec, tracker, named),
        active(rec),
    ):
        yield rec
    _conclude(rec, path)


def _experts(rec: Recorder, model: Any, named: dict[str, Any]) -> Any:
    """With ``experts=True``, each expert's rows recorded (:mod:`.expertrows`)."""
    if not rec.options.experts:
        return contextlib.nullcontext()
    from dmlib.localize.capture.expertrows import recording

    return recording(rec, model, named)


def _options(path: Path, options: CaptureOptions | None, **settings: Any) -> CaptureOptions:
    """The capture's options: ``options`` with the keywords given; a bad setting is a
    :class:`CaptureError` naming the capture folder."""
    try:
        return CaptureOptions.of(options, **settings)
    except CaptureError as err:
        raise CaptureError(str(err), path=path) from None


def _new_recorder(
    model: torch.nn.Module, path: Path, opts: CaptureOptions, named: dict[str, Any] | None = None
) -> Recorder:
    """Prepare the folder and build the :class:`Recorder` (its row map checked here)."""
    root = root_label(dict(model.named_modules()) if named is None else named)
    _prepare_dir(path, opts.overwrite)
    row_map = None if opts.row_map is None else RowMap.shared(opts.row_map, path=path)
    return Recorder(path, opts, row_map=row_map, root=root)


__all__ = ["capture", "default_modules", "Recorder"]
