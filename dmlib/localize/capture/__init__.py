"""The capture: record what enters and leaves named torch modules during forward passes.

``with dmlib.capture(model, path, row_map=...): model(x)`` installs forward hooks,
hashes every boundary tensor (whole, and per logical request in blocks of positions),
optionally dumps selected boundaries in full, and writes ``path/manifest.json`` last;
``dmlib.open_capture(path)`` reads it back without torch. Hooks return nothing and only
read: each tensor is detached and never written, so the model's outputs are unchanged.

The rooms (each imports only the ones listed before it):

- :mod:`~dmlib.localize.capture.format`: the file format: names, versions, hash schemes,
  the boundary kinds (one table) and the one :class:`Boundary` type of a manifest entry,
  which the writer builds and the reader parses;
- :mod:`~dmlib.localize.capture.treehash`, :mod:`~dmlib.localize.capture.jsonenc`: the
  entries into the compiled module (``_capture.c``: digests, strided copy, manifest JSON);
- :mod:`~dmlib.localize.capture.rowmap`: physical rows -> (request, position);
- :mod:`~dmlib.localize.capture.digests`: every digest rule (hash trees, device checksums);
- :mod:`~dmlib.localize.capture.reader`: :func:`open_capture` and :class:`Capture`;
- :mod:`~dmlib.localize.capture.tensors`: a module call's tensors found and read as numpy;
- :mod:`~dmlib.localize.capture.writer`: the manifest and dump files, the capture folder;
- :mod:`~dmlib.localize.capture.hostdigests`: a boundary's digests, host or device;
- :mod:`~dmlib.localize.capture.recorder`: :class:`Recorder`, what the hooks call;
- :mod:`~dmlib.localize.capture.hooks`: the hooks installed for a ``with`` block;
- :mod:`~dmlib.localize.capture.options`: :class:`CaptureOptions`, every setting once;
- :mod:`~dmlib.localize.capture.api`: :func:`capture`, the public entry (this package
  exports it, with :func:`open_capture`, :class:`Capture` and :class:`CaptureOptions`).

Where the time goes, and what is done about it (``benchmarks/bench_capture.py``):

- Host tensors are hashed with XXH3-128 (``xxh3-128-tree-v1``, format version 4: about
  ten times BLAKE3's speed, which ``hash="blake3"`` keeps) in the hook, on the tensor's
  own memory: at 55 GB/s hashing costs less than the private copy a worker thread would
  need (a later in-place op may change the memory). With BLAKE3, tensors over 1 MiB are
  copied and hashed on worker threads while the forward pass goes on. A request that
  fits in one block is hashed once: its block's bytes are all of its bytes. A tensor is
  made contiguous once and every digest (whole, per batch row, per request and block) is
  taken from byte offsets into that buffer. A request's digest is derived from its
  blocks' digests (a hash tree, since format version 3), so each byte is hashed twice
  (whole tensor, blocks), no longer three times; the whole tensor stays a plain digest,
  comparable whatever the row maps.
- Every digest of one boundary (whole, per index of axis 0, each request's blocks and tree
  digest, the requests' dicts) comes from one call into the compiled module on the
  tensor's own memory (:func:`dmlib.localize.capture.treehash.hash_boundary`; the Python loop where
  it is not built): per block, the interpreter's slice, hash object and hex string cost
  more than hashing a few KiB. XXH3-128 is called there without a Python call per digest
  (the xxhash package's exported ``XXH3_128bits_dispatch``, its AVX2/AVX-512 entry, checked
  against its own function first). An op's tensor read by row axes (attention's ``(batch,
  heads, positions, head_dim)``) is hashed on a view whose rows are in C order where they
  are (a ``transpose(1, 2)`` of ``(batch, positions, ...)``), else on one copy gathered in C.
- How a tensor of a given shape is read (row dims, row axes, per-index digests) is worked
  out once per capture; a row map's requests, JSON text and KV-cache row plans once per row
  map, kept for the next captures of that layout (:meth:`RowMap.shared`); the manifest's entries
  are written by orjson in one pass (:func:`dmlib.localize.capture.jsonenc.compact_lines`,
  the text ``json.dumps`` writes; as fast as the C writer dmlib had for it); a manifest is replaced after the old one is removed (ext4
  writes out a file renamed over another at once: 0.3 ms a manifest).
- An op's output over the memory of one of its inputs (a view, ``_unsafe_view``) takes the
  input's digests when the op writes nothing (its ATen schema says so); the output of an
  op that may write is always hashed (inside the dispatch, torch has not yet bumped the
  version counter of what it wrote).
- One tensor object passed on unchanged (a block's output is the next block's input, the
  input of query, key and value) is hashed, copied and dumped once: a boundary that
  records the same live tensor object at the same version counter (torch bumps it on
  every in-place write) takes the first recording's digests and dump file.
- Device tensors are checksummed where they live (``cksum4-v1``, torch integer ops):
  three sums per row cross to the host, which assembles every digest from them, and
  nothing else is copied unless dumped. Where the device checksum cannot be taken (a row
  of an odd number of bytes, an op the device lacks), the host hash of a copy is the
  fallback; each boundary names the scheme it was hashed with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dmlib.localize.capture.format import Boundary, RequestHash
from dmlib.localize.capture.options import CaptureOptions
from dmlib.localize.capture.reader import Capture, open_capture
from dmlib.localize.capture.rowmap import RowMap

if TYPE_CHECKING:
    from dmlib.localize.capture.api import capture
    from dmlib.localize.capture.recorder import Recorder
    from dmlib.localize.capture.tensors import default_modules

#: names whose rooms import torch (where it is installed): imported when first asked for,
#: so that reading a capture never imports torch
_LAZY = {
    "capture": "dmlib.localize.capture.api",
    "Recorder": "dmlib.localize.capture.recorder",
    "default_modules": "dmlib.localize.capture.tensors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "Boundary", "Capture", "CaptureOptions", "Recorder", "RequestHash", "RowMap", "capture", "default_modules",
    "open_capture",
]  # fmt: skip
