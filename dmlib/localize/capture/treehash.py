"""Per-request block digests (``xxh3-128-tree-v1``, ``blake3-tree-v1``) in one compiled call.

A capture hashes every row-mapped boundary per request, in blocks of rows: for a small
tensor that is a few dozen hashes of a few KiB each, and the interpreter's work per
block (a slice, a hash object, a hex string) costs more than the hashing.
:func:`request_blocks` runs that loop in ``dmlib/localize/capture/_capture.c``; it returns None
where the compiled module is not there (no C compiler at install), and the caller takes
its Python loop, which gives the same digests (tests/test_localize_treehash.py). The
compiled module is used where it is built; ``DMLIB_KERNELS=numpy`` (the switch that
turns the compiled statistics off) turns it off too.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

_capture: Any
try:  # (the compiled module has no type information: Any)
    _capture = importlib.import_module("dmlib.localize.capture._capture")
except ImportError:  # pragma: no cover - built wherever a C compiler is
    _capture = None

#: False (tests, ``DMLIB_KERNELS=numpy``): take the caller's Python loop even where the
#: compiled one is built
USE_COMPILED = (
    _capture is not None
    and hasattr(_capture, "request_blocks")
    and os.environ.get("DMLIB_KERNELS", "").lower() != "numpy"
)


def request_blocks(
    hasher: Any,
    buf: Any,
    row_bytes: int,
    spans: Sequence[tuple[int, int]],
    block_rows: int,
    tag: bytes,
    piece: int,
    digest_size: int = 32,
) -> list[tuple[str, list[str]]] | None:
    """``(digest, block digests)`` (hex) per ``(first row, rows)`` span of ``buf``.

    ``buf``: a contiguous buffer of whole rows of ``row_bytes`` bytes; ``hasher``: called
    on each block's bytes, returns its ``digest_size``-byte digest (``bytes``, as
    ``xxhash.xxh3_128_digest``) or an object whose ``digest()`` does (the BLAKE3
    constructor). Blocks are ``block_rows`` rows (the last one shorter); a span's digest
    is its one block's, or with several the hasher's digest of ``tag``, the row count
    and ``block_rows`` (little-endian u64) and the blocks' raw digests. None: not
    computed here (no compiled module, or a block over ``piece`` bytes).

    Raises
    ------
    ValueError
        A span lies outside the buffer.
    """
    if not USE_COMPILED:
        return None
    out: list[tuple[str, list[str]]] | None = _capture.request_blocks(
        hasher, buf, row_bytes, spans, block_rows, tag, piece, digest_size
    )
    return out


def hash_boundary(
    hasher: Any,
    whole: Any,
    n_lead: int,
    rows: Any,
    row_bytes: int,
    spans: Sequence[tuple[str, int, int]],
    block_rows: int,
    tag: bytes,
    piece: int,
    digest_size: int,
) -> tuple[str, list[str] | None, dict[str, dict[str, Any]] | None] | None:
    """Every host digest of one capture boundary, in one compiled call.

    ``whole``: the tensor's bytes in C order (a contiguous buffer), hashed whole, and with
    ``n_lead >= 0`` also as that many equal slices (the digests per index of axis 0);
    ``rows``: the buffer of rows of ``row_bytes`` bytes the requests are read from (or
    None), ``spans``: ``(request id, first row, rows)`` per request on consecutive rows,
    each hashed as :func:`request_blocks` hashes a span. Returns ``(whole digest, slice
    digests or None, {request id: {"digest", "n_rows", "blocks"}} or None)`` in hex; None
    where the compiled module is not there or the bytes are over one ``piece`` (the
    caller's Python loop then gives the same digests).
    """
    if not USE_COMPILED or not _BOUNDARY:
        return None
    out = _capture.hash_boundary(hasher, whole, n_lead, rows, row_bytes, spans, block_rows, tag,
                               piece, digest_size)  # fmt: skip
    return cast("tuple[str, list[str] | None, dict[str, dict[str, Any]] | None] | None", out)


# an older build of the module (a checkout updated without a rebuild) lacks it
_BOUNDARY = _capture is not None and hasattr(_capture, "hash_boundary")
_GATHER = getattr(_capture, "gather", None)


def contiguous(arr: np.ndarray) -> np.ndarray:
    """``arr`` itself where it is C-contiguous, else a C-contiguous copy of it (the values
    of ``numpy.ascontiguousarray(arr)``), made by the compiled module where it is built:
    3-4 us for a 25 KB ``(batch, heads, positions, head_dim)`` view where numpy and
    torch take 6-14 us (measured; a capture copies one per attention tensor it reads by
    rows).
    """
    if arr.flags.c_contiguous:
        return arr
    if _GATHER is None or not USE_COMPILED or arr.dtype.hasobject:
        return np.ascontiguousarray(arr)
    out = np.empty(arr.shape, arr.dtype)
    try:
        _GATHER(arr, out)
    except (ValueError, BufferError, TypeError):  # a dtype the buffer protocol cannot export
        return np.ascontiguousarray(arr)
    return out


_DIRECT: list[tuple[Any, bool]] = []  # (an XXH3-128 digest function, called directly?)


def direct_xxh3(digest: Any) -> bool:
    """Let the compiled loop compute ``digest`` (``xxhash.xxh3_128_digest``) without a
    Python call per block: through ``XXH3_128bits_dispatch`` (the entry that picks AVX2 or
    AVX-512 at run time) or else ``XXH3_128bits``, which the xxhash package's compiled module
    exports, once its digests were found equal to ``digest``'s on every code path (lengths 0
    to 300 and larger). False (the Python call stays): not found, not equal, or no compiled
    module. Checked once per process.
    """
    for known, ok in _DIRECT:
        if known is digest:
            return ok
    ok = False
    module = sys.modules.get(getattr(digest, "__module__", "") or "")
    path = getattr(module, "__file__", None)
    if _capture is not None and hasattr(_capture, "use_xxh3") and path:
        # one function is called directly at a time: the last one checked and found equal
        ok = bool(_capture.use_xxh3(path, digest))
        if ok:
            _DIRECT[:] = [(f, False) for f, _ in _DIRECT]
    _DIRECT.append((digest, ok))
    return ok


__all__ = ["USE_COMPILED", "contiguous", "direct_xxh3", "hash_boundary", "request_blocks"]
