"""Every digest a capture writes: the hash schemes' rules, written once for the writer and
the reader alike.

A host tensor's bytes are hashed whole, per index of axis 0 and per request in blocks of
rows (:func:`request_hashes`); a request's digest over several blocks is derived from the
blocks' digests (:func:`tree_request`, the ``*-tree-v1`` schemes). A device tensor is
checksummed where it lives (``cksum4-v1``, :func:`_device_checksums`). The compiled loops
(:mod:`dmlib.localize.capture.treehash`) give the same digests as the Python ones here.
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from dmlib import hashing
from dmlib.errors import CaptureError
from dmlib.localize.capture import treehash
from dmlib.localize.capture.format import (
    SCHEMES,
    TREE,
    XXH_TREE,
)
from dmlib.localize.capture.rowmap import RowMap


def digest_hex(data: np.ndarray | np.generic | memoryview | bytes, scheme: str) -> str:
    """Bare hex digest of exactly these bytes (an ndarray as its C-order bytes) in ``scheme``."""
    if not isinstance(data, (bytes, memoryview)):  # an array, or a numpy scalar (x[i] of 1-d)
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    if scheme == XXH_TREE:
        return cast(str, _xxh3_hex()(data))
    if scheme in (hashing.BLAKE3, TREE):  # a tree's leaf is the plain digest of its bytes
        if memoryview(data).nbytes <= hashing.PIECE:  # the plain digest: skip the piece logic
            return hashing._blake3()(data).hexdigest()
        return hashing.digest_bytes(data, hashing.BLAKE3).split(":", 1)[1]
    if scheme == hashing.SHA256:
        return hashlib.sha256(data).hexdigest()
    if scheme == hashing.CHECKSUM:
        return hashing.checksum_host(data).split(":", 1)[1]
    raise CaptureError(f"unknown hash scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")


#: the domain tag of a ``blake3-tree-v1`` request digest over several blocks
TREE_REQUEST_TAG = b"dmlib blake3-tree-v1 request\0"


#: the domain tag of an ``xxh3-128-tree-v1`` request digest over several blocks
XXH_REQUEST_TAG = b"dmlib xxh3-128-tree-v1 request\0"


#: tree schemes -> the domain tag of a request digest over several blocks
TREE_TAGS = {TREE: TREE_REQUEST_TAG, XXH_TREE: XXH_REQUEST_TAG}


_COUNTS = struct.Struct("<2Q")  # (rows, rows per block)


def tree_request(blocks: Sequence[str], n_rows: int, block_rows: int, scheme: str = TREE) -> str:
    """A request's digest under a tree ``scheme`` from its block digests (hex).

    One block: that block's digest (the plain digest of every byte of the request: for
    ``blake3-tree-v1`` as in ``blake3-64MiB``). Several: the scheme's hash (BLAKE3,
    XXH3-128) of its domain tag (:data:`TREE_TAGS`), the row count and the rows per
    block (little-endian u64) and the blocks' raw digests in order: equal digests mean
    the same blocks, hence the same bytes. Everything it needs is in the manifest, so a
    ``blake3-64MiB`` boundary's request digests can be rebuilt under ``blake3-tree-v1``
    (:func:`lift_blake3`).
    """
    if len(blocks) == 1:
        return blocks[0]
    # one decode of all the blocks and one hasher call: per-block work costs more than the hash
    data = TREE_TAGS[scheme] + _COUNTS.pack(n_rows, block_rows) + bytes.fromhex("".join(blocks))
    if scheme == XXH_TREE:
        return cast(str, _xxh3_hex()(data))
    return cast(str, _b3_class()(data).hexdigest())


def _b3_class() -> Any:
    """The blake3 constructor, looked up once (an import statement per call costs ~1 us)."""
    global _B3
    if _B3 is None:
        _B3 = hashing._blake3()
    return _B3


_B3: Any = None


def _xxh3_hex() -> Any:
    """``xxhash.xxh3_128_hexdigest``, looked up once."""
    global _XXH
    if _XXH is None:
        _XXH = hashing.xxh3_128().xxh3_128_hexdigest
    return _XXH


_XXH: Any = None


def request_hashes(
    rows: np.ndarray, block_rows: int, scheme: str = hashing.SHA256
) -> tuple[str, list[str]]:
    """Digest of a request's rows (position order) and of each block of ``block_rows`` rows.

    ``rows`` has one leading entry per position; a block's bytes are those positions'
    C-order bytes, so the digest does not depend on where the rows sat physically.
    """
    rows = np.ascontiguousarray(rows)
    flat = (
        rows.reshape(rows.shape[0], -1).view(np.uint8)
        if rows.size
        else rows.reshape(rows.shape[0], 0)
    )
    n = rows.shape[0]
    if scheme == XXH_TREE and rows.size:
        xh, mv, rb = _xxh3_hex(), flat.reshape(-1).data, flat.shape[1]
        blocks = [xh(mv[i * rb : (i + block_rows) * rb]) for i in range(0, n, block_rows)]
        return tree_request(blocks, n, block_rows, scheme), blocks
    if scheme in (hashing.BLAKE3, TREE) and rows.size and flat.nbytes <= hashing.PIECE:
        # the same digests as digest_hex, without its per-call array handling
        b3, mv, rb = hashing._blake3(), flat.reshape(-1).data, flat.shape[1]
        blocks = [
            b3(mv[i * rb : (i + block_rows) * rb]).hexdigest() for i in range(0, n, block_rows)
        ]
        if scheme == TREE:
            return tree_request(blocks, n, block_rows), blocks
        return (blocks[0] if len(blocks) == 1 else b3(mv).hexdigest()), blocks
    blocks = [digest_hex(flat[i : i + block_rows], scheme) for i in range(0, n, block_rows)]
    if scheme in TREE_TAGS:
        return tree_request(blocks, n, block_rows, scheme), blocks
    # one block holds every byte of the request: its digest is the request's
    return (blocks[0] if len(blocks) == 1 else digest_hex(flat, scheme)), blocks


def n_blocks(n_rows: int, block_rows: int) -> int:
    """How many blocks of ``block_rows`` rows ``n_rows`` rows fill (the last one may be short)."""
    return math.ceil(n_rows / block_rows)


def _device_checksums(
    t: Any,
    k: int | None,
    axes: tuple[int, int] | None,
    leading: bool,
    row_map: RowMap | None,
    block_rows: int,
) -> tuple[str, list[str] | None, dict[str, Any] | None]:
    """``cksum4-v1`` digests (whole, per index of axis 0, per request) of a device tensor.

    The same bytes and the same rules as the host path (:meth:`Recorder._hash`): the whole
    tensor in C order, a request's rows in position order and its blocks of
    ``block_rows`` rows. Three sums per row are taken where the tensor lives
    (:func:`dmlib.hashing.row_moments_torch`, one transfer of a few bytes per row); every
    digest is assembled from them on the host. ValueError where a row has an odd number
    of bytes.
    """
    size = t.element_size()
    t = t.contiguous()
    lead_rows = t.reshape((int(t.shape[0]) if t.dim() else 1, -1))
    m_lead = hashing.row_moments_torch(lead_rows)
    lead_bytes = int(lead_rows.shape[1]) * size
    whole = _ck(m_lead, lead_bytes)
    lead = [_ck(m_lead[i : i + 1], lead_bytes) for i in range(len(m_lead))] if leading else None
    if row_map is None or (k is None and axes is None):
        return whole, lead, None
    if axes is not None:
        rows = t.movedim(axes, (0, 1)).reshape((len(row_map), -1))
        m = hashing.row_moments_torch(rows)
    elif k == 1:
        rows, m = lead_rows, m_lead
    else:
        rows = t.reshape((len(row_map), -1))
        m = hashing.row_moments_torch(rows)
    row_bytes = int(rows.shape[1]) * size
    requests: dict[str, Any] = {}
    for rid, idx in row_map.requests.items():
        mine = m[idx]
        blocks = [_ck(mine[i : i + block_rows], row_bytes) for i in range(0, len(idx), block_rows)]
        digest = blocks[0] if len(blocks) == 1 else _ck(mine, row_bytes)
        requests[rid] = {"digest": digest, "n_rows": int(len(idx)), "blocks": blocks}
    return whole, lead, requests


def _b3_hex(b3: Any, mv: memoryview, scheme: str) -> str:
    """``digest_hex`` of a byte slice: the plain BLAKE3 digest up to one piece."""
    return b3(mv).hexdigest() if mv.nbytes <= hashing.PIECE else digest_hex(mv, scheme)


def _leaf_hasher(scheme: str) -> Callable[[memoryview], str]:
    """The hex digest of a byte slice in a host ``scheme`` (its tree's leaf digest)."""
    if scheme == XXH_TREE:
        return cast("Callable[[memoryview], str]", hashing.xxh3_128().xxh3_128_hexdigest)
    b3 = hashing._blake3()
    return lambda mv: _b3_hex(b3, mv, scheme)


def _tree_args(scheme: str) -> tuple[Any, bytes, int, int]:
    """(hasher, tree tag, piece, digest size) of a tree ``scheme`` for the compiled loop."""
    if scheme == XXH_TREE:  # XXH3 digests any length in one piece
        digest = hashing.xxh3_128().xxh3_128_digest
        treehash.direct_xxh3(digest)  # the compiled loop calls XXH3 itself where it can
        return digest, TREE_TAGS[scheme], sys.maxsize, 16
    return hashing._blake3(), TREE_TAGS[scheme], hashing.PIECE, 32


def _repeat_groups(bits: Any, same: Callable[[Any, Any], bool]) -> int:
    """``g > 1`` where each run of ``g`` consecutive heads (axis 1) is one head copied, else 1.

    ``bits``: an integer view of ``(batch, heads, ...)`` (numpy or torch), so that the
    copies are compared bit for bit; ``same``: that library's whole-array equality.
    """
    h = int(bits.shape[1])
    if h < 2 or not same(bits[:, 0], bits[:, 1]):
        return 1  # the common case (distinct heads), settled by one comparison
    g = 2
    while g < h and same(bits[:, 0], bits[:, g]):
        g += 1
    while g > 1 and h % g:
        g -= 1
    grouped = bits.reshape(bits.shape[0], h // g, g, *bits.shape[2:])
    return g if g > 1 and bool((grouped == grouped[:, :, :1]).all()) else 1


def _ck(moments: np.ndarray, row_bytes: int) -> str:
    return hashing.checksum_of_rows(moments, row_bytes).split(":", 1)[1]
