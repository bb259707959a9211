"""Whole tensors and byte ranges read where they are used (a Dask worker), by path.

The pair pieces of :mod:`dmlib.engine.pieces` serve comparisons; the structured analyses
need other reads: a tensor's norm (per piece, per chunk, added in order by the driver),
a factorised layer's factors (whole tensors: the effective weight is a matrix product),
and the padding bytes between tensors. A :class:`Ref` names a tensor's bytes in a file
every worker can see; these functions import no Dask and return small results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dmlib.errors import DmlibError
from dmlib.tensor import Tensor

SLOT = 4  # bytes of one float32 padding slot (dmlib.padding.SLOT)


@dataclass(frozen=True)
class Ref:
    """A tensor stored plainly in a file: path, absolute byte offset, dtype, shape."""

    path: str
    offset: int
    dtype: str  # numpy dtype string, or an ml_dtypes name (dmlib.dtypes.from_label)
    shape: tuple[int, ...]
    nbytes: int

    def np_dtype(self) -> np.dtype:
        """The numpy dtype :attr:`dtype` names (ml_dtypes names import ml_dtypes)."""
        from dmlib.dtypes import from_label

        return from_label(self.dtype)


def ref_of(t: Tensor) -> Ref:
    """The :class:`Ref` of a tensor; a DmlibError naming engine='local' when it has none."""
    from dmlib.engine.dask import side_of

    side = side_of(t)
    if t.quantized or t.packing is not None:
        raise DmlibError(
            f"tensor {t.name!r}: engine='dask' reads tensors stored plainly (one element per "
            f"{t.dtype.itemsize} bytes); this one is {t.dtype_label}, packed or quantized "
            "(use engine='local')",
            path=t.path,
        )
    dt = t.dtype
    label = dt.name if dt.kind == "V" else dt.str  # ml_dtypes by name, others keep byte order
    return Ref(side.path, side.offset, label, tuple(int(n) for n in t.shape), int(t.nbytes))


def _read(path: str, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` bytes of ``path`` at ``offset`` as a uint8 array (an OSError if short)."""
    from dmlib.engine.pieces import _read as read_into

    buf = bytearray(nbytes)
    if not nbytes:
        return np.zeros(0, np.uint8)
    with open(path, "rb", buffering=0) as f:
        return read_into(f, offset, nbytes, buf)


def load(ref: Ref) -> np.ndarray:
    """The tensor of ``ref`` as an array of its dtype and shape (what ``Tensor.load`` gives)."""
    raw = _read(ref.path, ref.offset, ref.nbytes)
    return raw.view(ref.np_dtype()).reshape(ref.shape)


def norm_piece(ref: Ref, start: int, end: int, chunk: int) -> list[float]:
    """Per chunk of ``chunk`` elements of bytes ``[start, end)``: the float64 sum of squares
    of the finite elements (``dmlib.forensics.ladder._norm``'s terms, in its order)."""
    dt = ref.np_dtype()
    flat = _read(ref.path, ref.offset + start, end - start).view(dt)
    from dmlib._blas import one_thread

    out = []
    with one_thread():  # as the local engine's norm
        for i in range(0, flat.size, chunk):
            x = flat[i : i + chunk].astype(np.float64)
            x = x[np.isfinite(x)]
            out.append(float(np.dot(x, x)))
    return out


def padding_piece(path: str, base: int, start: int, end: int) -> dict[str, Any]:
    """Padding bytes ``[start, end)`` of a buffer that starts at byte ``base`` of ``path``.

    Returns ``nonzero_bytes`` and the nonzero float32 slots of the file's 4-byte grid
    wholly inside the range: ``offsets`` (buffer offsets) and ``bits`` (their u32 words).
    Zero slots stay behind: the driver knows the grid, and a missing slot is zero.
    """
    return scan_padding(_read(path, base + start, end - start), start, end)


def scan_padding(raw: np.ndarray, start: int, end: int) -> dict[str, Any]:
    """:func:`padding_piece` of bytes already read (``raw`` = bytes ``[start, end)``)."""
    first, last = -(-start // SLOT) * SLOT, end // SLOT * SLOT
    offsets, bits = np.zeros(0, np.int64), np.zeros(0, np.uint32)
    if last > first:
        words = raw[first - start : last - start].view("<u4")
        nz = np.flatnonzero(words)
        offsets = first + SLOT * nz.astype(np.int64)
        bits = words[nz].astype(np.uint32)
    return {"nonzero_bytes": int(np.count_nonzero(raw)), "offsets": offsets, "bits": bits}
