"""An independent oracle of the ``blake3-tree-v1`` request digest (blake3 package, struct).

Written from the format's description (docs), not from dmlib's code: one block, the plain
BLAKE3 digest of the request's bytes; several, BLAKE3 of the tag
``b"dmlib blake3-tree-v1 request\\0"``, two little-endian u64 (rows, rows per block)
and the blocks' 32-byte digests in order.
"""

from __future__ import annotations

import struct

import numpy as np
from blake3 import blake3


def tree_request(rows: np.ndarray, block_rows: int) -> tuple[str, list[str]]:
    """(request digest, block digests) of ``rows`` (one leading entry per position)."""
    flat = np.ascontiguousarray(rows).reshape(len(rows), -1).view(np.uint8)
    n = flat.shape[0]
    blocks = [blake3(flat[i : i + block_rows].tobytes()).digest() for i in range(0, n, block_rows)]
    if len(blocks) == 1:
        return blocks[0].hex(), [blocks[0].hex()]
    head = b"dmlib blake3-tree-v1 request\0" + struct.pack("<2Q", n, block_rows)
    return blake3(head + b"".join(blocks)).hexdigest(), [b.hex() for b in blocks]
