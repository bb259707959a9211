"""A float32 safetensors file written by hand (its header and bytes laid out here, not by
dmlib's writer), for tests that build small studies."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np


def write_f32(
    path: Path, tensors: dict[str, np.ndarray], meta: dict[str, str] | None = None
) -> None:
    """``tensors`` as little-endian float32, in order, after an 8-byte header length and the
    JSON header (``__metadata__`` from ``meta``)."""
    header: dict = {"__metadata__": meta or {}}
    blobs, offset = [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))
