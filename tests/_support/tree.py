"""Independent oracles of the capture tree schemes (the blake3 and xxhash packages, struct).

Written from the format's description (docs/formats.md), not from dmlib's code:

- ``xxh3-128-tree-v1`` (the default): a leaf is the 16-byte XXH3-128 digest of its bytes;
  a request of one block has that block's digest; of several, XXH3-128 of the tag
  ``b"dmlib xxh3-128-tree-v1 request\\0"``, two little-endian u64 (rows, rows per block)
  and the blocks' 16-byte digests in order.
- ``blake3-tree-v1`` (``hash="blake3"``): the same with BLAKE3 (32-byte digests) and the
  tag ``b"dmlib blake3-tree-v1 request\\0"``.
"""

from __future__ import annotations

import struct

import numpy as np
import xxhash
from blake3 import blake3

#: dmlib.capture(hash=...) name -> the scheme name its boundaries carry
SCHEME = {"xxh3": "xxh3-128-tree-v1", "blake3": "blake3-tree-v1"}


def leaf_raw(data: bytes, scheme: str = "xxh3") -> bytes:
    """The raw leaf digest of ``data`` in ``scheme`` (``"xxh3"`` or ``"blake3"``)."""
    return xxhash.xxh3_128_digest(data) if scheme == "xxh3" else blake3(data).digest()


def leaf(x: bytes | np.ndarray, scheme: str = "xxh3") -> str:
    """The hex leaf digest of ``x`` (an array as its C-order bytes)."""
    data = x if isinstance(x, bytes) else np.ascontiguousarray(x).tobytes()
    return leaf_raw(data, scheme).hex()


def tree_request(rows: np.ndarray, block_rows: int, scheme: str = "xxh3") -> tuple[str, list[str]]:
    """(request digest, block digests) of ``rows`` (one leading entry per position)."""
    flat = np.ascontiguousarray(rows).reshape(len(rows), -1).view(np.uint8)
    n = flat.shape[0]
    blocks = [leaf_raw(flat[i : i + block_rows].tobytes(), scheme) for i in range(0, n, block_rows)]
    if len(blocks) == 1:
        return blocks[0].hex(), [blocks[0].hex()]
    head = f"dmlib {SCHEME[scheme]} request\0".encode() + struct.pack("<2Q", n, block_rows)
    return leaf_raw(head + b"".join(blocks), scheme).hex(), [b.hex() for b in blocks]
