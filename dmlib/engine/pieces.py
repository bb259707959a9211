"""Work on one piece of one tensor pair, read from the files where it runs (a Dask worker).

A piece is the byte range ``[start, end)`` of a tensor, ``start`` a multiple of
:data:`dmlib.hashing.PIECE`; it is walked in the same chunks as the local engine's
:func:`dmlib.kernels.pair.compare_pair`, and everything comes back per chunk, in order, so
that the driver combines the pieces into exactly the local engine's row: integer counts
add, maxima take the max, and each floating-point sum is added chunk by chunk in the
local engine's order (the same additions, so the same bits).

Only small results travel: counts, a few floats per differing chunk, the ULP counts up
to the largest distance seen, 32-byte piece digests. These functions import no Dask.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dmlib import hashing
from dmlib.kernels import stream as K
from dmlib.kernels.ulp import float_bits


@dataclass(frozen=True)
class Side:
    """Where a tensor's bytes are: a file every worker can read and the byte offset in it."""

    path: str
    offset: int


@dataclass(frozen=True)
class PieceSpec:
    """One piece of one tensor pair: what to read and how to compare it."""

    a: Side
    b: Side
    start: int  # byte range of the tensor, [start, end)
    end: int
    kind: str  # "float", "int" or "bytes" (dmlib.kernels.pair.kind_of)
    dtype: str  # numpy dtype string of the elements (float: the float dtype)
    step: int  # chunk size in bytes (the local engine's)
    hash_name: str | None  # None: no identity hash of the pieces


def _dtype(spec: PieceSpec) -> np.dtype:
    if spec.kind == "float":
        from dmlib.dtypes import from_label

        return from_label(spec.dtype)
    return np.dtype(spec.dtype)


def _read(f: Any, offset: int, n: int, buf: bytearray) -> np.ndarray:
    f.seek(offset)
    view = memoryview(buf)[:n]
    got = 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise OSError(f"{f.name}: {n} bytes at {offset} expected, the file ends after {got}")
        got += k
    return np.frombuffer(buf, np.uint8, count=n)


def _chunks(spec: PieceSpec) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(byte offset in the tensor, bytes of a, bytes of b) per chunk of the piece."""
    # buffers no larger than the piece: a small tensor's piece would zero 2 x 4 MiB otherwise
    size = max(0, min(spec.step, spec.end - spec.start))
    bufa, bufb = bytearray(size), bytearray(size)
    with open(spec.a.path, "rb", buffering=0) as fa, open(spec.b.path, "rb", buffering=0) as fb:
        for off in range(spec.start, spec.end, spec.step):
            n = min(spec.step, spec.end - off)
            yield (
                off,
                _read(fa, spec.a.offset + off, n, bufa),
                _read(fb, spec.b.offset + off, n, bufb),
            )


def compare_piece(spec: PieceSpec) -> dict[str, Any]:
    """Statistics of the piece, per chunk: everything the local engine accumulates.

    Returns ``differing`` (list of per-chunk dicts for chunks whose bytes differ, in
    order), ``aa`` (per-chunk sum a*a of the chunks from byte ``aa_from`` on, the first
    differing chunk, in order; None for non-float kinds), ``digest_a`` and ``digest_b`` (raw BLAKE3 of each side's piece for
    the ``blake3-64MiB`` scheme; ``digest_b`` None when the piece is bit-identical).
    """
    dt = _dtype(spec)
    info = float_bits(dt) if spec.kind == "float" else None
    elem = info.bits if info is not None else (dt if spec.kind == "int" else np.dtype("u1"))
    bits = np.dtype(f"<u{elem.itemsize}") if elem.itemsize > 1 else np.dtype("u1")
    piece_hash = spec.hash_name == hashing.BLAKE3
    ha = hashing._blake3()() if piece_hash else None
    hb = hashing._blake3()() if piece_hash else None
    chunks_aa: list[float] = []
    aa_from: int | None = None
    differing: list[dict[str, Any]] = []
    with np.errstate(over="ignore", invalid="ignore"):
        for off, ca, cb in _chunks(spec):
            if ha is not None and hb is not None:
                ha.update(ca)
                hb.update(cb)
            va, vb = ca.view(elem), cb.view(elem)
            neq = np.not_equal(ca.view(bits), cb.view(bits))
            same = not neq.any()
            start = off // elem.itemsize
            acc = K.Acc()
            if info is not None and (aa_from is not None or not same):
                # sums a*a from the first differing chunk on; the driver asks for the
                # chunks before it only when the tensor differs (aa_piece)
                aa_from = off if aa_from is None else aa_from
                acc_aa = K.Acc()
                if same:
                    K.add_aa(acc_aa, va, vb, info)
                else:  # (one pass of the compiled kernel where there is one)
                    K.float_pair(acc_aa, acc, va, vb, start, info)
                chunks_aa.append(acc_aa.aa)
            if same:
                continue
            if info is None:
                K.int_chunk(acc, va, vb, start)
            differing.append(
                {
                    "chunk": off // spec.step,
                    "n_diff": acc.n_diff,
                    "first": acc.first,
                    "max_abs": acc.max_abs,
                    "sad": acc.sad,
                    "sdd": acc.sdd,
                    "counts": np.trim_zeros(acc.counts, "b"),
                    "max_ulp": acc.max_ulp,
                    "n_nan_payload": acc.n_nan_payload,
                    "n_nan_vs_num": acc.n_nan_vs_num,
                    "n_inf_mismatch": acc.n_inf_mismatch,
                }
            )
    return {
        "start": spec.start,
        "differing": differing,
        "aa": chunks_aa if info is not None else None,
        "aa_from": aa_from if aa_from is not None else spec.end,
        "digest_a": ha.digest() if ha is not None else None,
        "digest_b": hb.digest() if (hb is not None and differing) else None,
    }


def aa_piece(spec: PieceSpec) -> list[float]:
    """Per-chunk sum a*a over pairs finite on both sides (a piece without differences)."""
    return _squares_piece(spec, of_b=False)


def bb_piece(spec: PieceSpec) -> list[float]:
    """Per-chunk sum b*b over pairs finite on both sides (the rare near-zero-b case)."""
    return _squares_piece(spec, of_b=True)


def _squares_piece(spec: PieceSpec, *, of_b: bool) -> list[float]:
    info = float_bits(_dtype(spec))
    out = []
    with np.errstate(over="ignore", invalid="ignore"):
        for _, ca, cb in _chunks(spec):
            first, other = (cb, ca) if of_b else (ca, cb)
            acc = K.Acc()
            K.add_aa(acc, first.view(info.bits), other.view(info.bits), info)
            out.append(acc.aa)
    return out


def rescan_piece(spec: PieceSpec, lo: int, hi: int, shift: int) -> np.ndarray:
    """bincount of ``(u - lo) >> shift`` over the piece's finite differing ULP distances in [lo, hi]."""
    info = float_bits(_dtype(spec))
    nb = ((hi - lo) >> shift) + 1
    out = np.zeros(nb, np.int64)
    for _, ca, cb in _chunks(spec):
        K.add_ulp_bincount(out, ca, cb, info, lo, hi, shift)
    return out


def hash_piece(path: str, offset: int, nbytes: int) -> bytes:
    """Raw BLAKE3 of one piece of a file (``nbytes`` at ``offset``, at most one PIECE)."""
    buf = bytearray(min(nbytes, 1 << 22)) if nbytes else bytearray()
    h = hashing._blake3()()
    with open(path, "rb", buffering=0) as f:
        for off in range(offset, offset + nbytes, len(buf) or 1):
            n = min(len(buf), offset + nbytes - off)
            h.update(_read(f, off, n, buf))
    return h.digest()


def sha256_side(path: str, offset: int, nbytes: int) -> str:
    """``"sha256:<hex>"`` of one side's tensor bytes (sequential: one task per tensor)."""
    return hashing.digest_file(path, hashing.SHA256, offset, offset + nbytes)
