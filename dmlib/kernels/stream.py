"""One streaming pass over a pair of tensors: every statistic of :func:`dmlib.compare`.

A tensor pair is walked in chunks of its raw (memory-mapped) bytes. Each chunk is first
compared as bytes (``memcmp`` in the compiled module, else numpy on 8-byte words:
memory-bound); only chunks with a difference pay for the float math. Float32 and float64
chunks get every statistic in one pass of the optional compiled kernel
(``dmlib/kernels/_fused.c``, see :func:`kernel_name`); other dtypes, or every dtype without
it, use the numpy kernels below (a mask, the differing places, then the statistics on
them). When identity hashes are asked for (:mod:`dmlib.hashing`), side a's hash is fed
each chunk right after its comparison, while its pages are mapped (BLAKE3 on every core;
SHA-256, sequential, runs on a worker thread instead, over the same pages); side b is
hashed only once a chunk is found to differ (identical bytes have side a's digest), so
identical tensors are hashed once.

Memory is bounded by the chunk size: the ULP median comes from exact counts of every
distance 0..ULP_EXACT plus one overflow count, refined by re-reading the tensor only
when the median lies above ULP_EXACT (so it is always exact).
"""

from __future__ import annotations

import collections
import math
import mmap
import os
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dmlib import hashing
from dmlib.kernels.ulp import FloatBits, int_distance, ulp_bits

#: Distances 0..ULP_EXACT are counted exactly; larger ones share one overflow count.
ULP_EXACT = 1 << 16
_NBINS = ULP_EXACT + 2


class PageReleaser:
    """Unmaps pages already read from this process (``MADV_DONTNEED``), lagging a few chunks.

    Reading a memory map makes every touched page resident in this process, so without
    this the resident set of a comparison would grow to both files' size. Dropping the
    mapping of pages behind the cursor keeps it bounded; the page cache keeps the data,
    and a worker thread still hashing a dropped page simply faults it back in.
    """

    def __init__(self, lag: int = 3) -> None:
        self._lag = lag
        self._queue: collections.deque[tuple[Any, int, int]] = collections.deque()

    @staticmethod
    def root(arr: np.ndarray) -> tuple[Any, int] | None:
        """The mmap under ``arr`` and the address it starts at (None when not memory-mapped)."""
        base = arr
        while isinstance(base, np.ndarray) and isinstance(base.base, np.ndarray):
            base = base.base
        mm = getattr(base, "base", None)
        if not isinstance(mm, mmap.mmap) or not hasattr(mm, "madvise") or len(mm) == 0:
            return None
        # the mapping's own first byte (an array over it may start at a file offset)
        start = np.frombuffer(mm, np.uint8, count=1).ctypes.data
        PageReleaser._sequential(mm, arr.ctypes.data - start, arr.nbytes)
        return mm, start

    @staticmethod
    def _sequential(mm: Any, lo: int, n: int) -> None:
        # read-ahead hint for the span about to be walked: in benchmarks/bench_read.py (two
        # 512 MiB files, best of 3) a map with it took 0.97x the time of a plain map on a warm
        # cache and 0.77x on a cold one; readinto into reused buffers 1.16x and 1.42x
        page = mmap.PAGESIZE
        lo_p = lo // page * page
        try:
            mm.madvise(mmap.MADV_SEQUENTIAL, lo_p, n + (lo - lo_p))
        except (ValueError, OSError, AttributeError):  # only speed is at stake
            pass

    def add(self, chunk: np.ndarray, root: tuple[Any, int] | None) -> None:
        """Queue the whole pages inside ``chunk`` for release; release the oldest beyond the lag."""
        if root is None:
            return
        mm, start = root
        lo = chunk.ctypes.data - start
        hi = lo + chunk.nbytes
        page = mmap.PAGESIZE
        lo = -(-lo // page) * page
        hi = hi // page * page
        if hi > lo:
            self._queue.append((mm, lo, hi))
        while len(self._queue) > self._lag:
            self._release(*self._queue.popleft())

    @staticmethod
    def _release(mm: Any, lo: int, hi: int) -> None:
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (ValueError, OSError):  # closed or not allowed: only memory is at stake
            pass

    def flush(self) -> None:
        """Release every page range still queued."""
        while self._queue:
            self._release(*self._queue.popleft())


def prime_allocator(nbytes: int) -> None:
    """Allocate and free one block of ``nbytes`` (at most 32 MiB) before the chunk loop.

    glibc's malloc serves blocks above its mmap threshold (128 KiB at first) with
    mmap/munmap, fresh zeroed pages every time, and raises that threshold (and its
    heap-trim threshold) only once it has freed such a block. The per-chunk temporaries
    here are a few MiB, so without this every chunk paid for page faults (measured: a
    third of the time of a differing 1 GiB comparison). Elsewhere this is a no-op.
    """
    block = np.empty(min(nbytes, 32 << 20), np.uint8)
    del block


def hash_views(raws: Iterable[np.ndarray], chunk_bytes: int, name: str | None = None) -> str:
    """``"<scheme>:<hex>"`` (:mod:`dmlib.hashing`) of the concatenated bytes, read chunk by
    chunk with bounded residency."""
    h = hashing.Hasher(name)
    rel = PageReleaser(lag=2)
    for raw in raws:
        raw = raw.view(np.ndarray)
        root = PageReleaser.root(raw)
        for off in range(0, raw.nbytes, chunk_bytes):
            chunk = raw[off : off + chunk_bytes]
            h.update(chunk.data)
            rel.add(chunk, root)
    rel.flush()
    return h.hexdigest()


def _stderr() -> Any:
    """stderr as the terminal gets it: the counter's carriage returns are its own, not data's
    (the CLI's stream escapes control characters; :class:`dmlib.textsafe.SafeStream`)."""
    return getattr(sys.stderr, "unescaped", sys.stderr)


class Progress:
    """A one-line byte counter on stderr, shown only for comparisons that take a while."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        if enabled is None:
            enabled = bool(getattr(sys.stderr, "isatty", lambda: False)())
        self.enabled = enabled
        self.total = max(total, 1)
        self.done = 0
        self.t0 = time.monotonic()
        self.last = 0.0
        self.shown = False

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes; redraw the line from 1 s after the start, at most each 0.25 s."""
        if not self.enabled:
            return
        self.done += n
        now = time.monotonic()
        if now - self.t0 > 1.0 and now - self.last > 0.25:
            self.last = now
            self.shown = True
            gib = 1 << 30
            err = _stderr()
            err.write(
                f"\rcompare: {100 * self.done / self.total:5.1f}% "
                f"({self.done / gib:.2f} of {self.total / gib:.2f} GiB per side)"
            )
            err.flush()

    def finish(self) -> None:
        """Clear the line, if it was shown."""
        if self.shown:
            self.shown = False
            err = _stderr()
            err.write("\r" + " " * 60 + "\r")
            err.flush()


@dataclass
class Acc:
    """Running statistics of one tensor pair.

    Norms are kept as ``aa`` = sum a*a over pairs finite on both sides plus, over the
    finite *differing* pairs only, ``sad`` = sum a*d and ``sdd`` = sum d*d with d = b - a:
    then b.b = aa + 2 sad + sdd and a.b = aa + sad, so b is never converted where it
    equals a.
    """

    n_diff: int = 0
    first: int | None = None
    max_abs: float = 0.0
    aa: float = 0.0
    sad: float = 0.0
    sdd: float = 0.0
    # counts of ULP distances 0, 1, ...: grown as larger distances appear (to _NBINS at
    # most; the last bin is the overflow), so an identical tensor costs no 512 KiB array
    counts: np.ndarray = field(default_factory=lambda: np.zeros(64, np.int64))
    max_ulp: int = -1
    n_nan_payload: int = 0
    n_nan_vs_num: int = 0
    n_inf_mismatch: int = 0

    @property
    def bb(self) -> float:
        """b.b, as ``aa + 2 sad + sdd``."""
        return self.aa + 2 * self.sad + self.sdd

    @property
    def ab(self) -> float:
        """a.b, as ``aa + sad``."""
        return self.aa + self.sad


def _to_f64(bits: np.ndarray, dtype: np.dtype) -> np.ndarray:
    # upcast low precision before any arithmetic (bf16/f16/f8 -> f64)
    return bits.view(dtype).astype(np.float64)


def add_aa(acc: Acc, ua: np.ndarray, ub: np.ndarray, info: FloatBits) -> None:
    """Add sum a*a over the chunk's pairs that are finite on both sides (bit views ua, ub)."""
    kernel = compiled_for(info)
    if kernel is not None:  # the same sum as float_pair's, so every engine agrees
        acc.aa += _run(kernel, ua, ub)[0]
        return
    xa = ua.view(info.dtype)
    # einsum upcasts block by block (float64 accumulation, no float64 copy of the chunk)
    aa = float(np.einsum("i,i->", xa, xa, dtype=np.float64))
    # a NaN or inf somewhere (or an overflow): exclude those pairs; a narrow or fnuz format
    # can hold a pattern that is no finite value yet reads as one, so always check those
    if not math.isfinite(aa) or info.irregular:
        keep = info.finite(ua) & info.finite(ub)
        x = xa[keep].astype(np.float64)
        aa = _dot(x, x)
    acc.aa += aa


# -- the optional compiled kernel (dmlib/kernels/_fused.c, built by setup.py where a C
# compiler is) ---------------------------------------------------------------------------

try:
    from dmlib.kernels import _fused  # type: ignore[attr-defined]
except ImportError:  # not built (no compiler at install): the numpy kernels do everything
    _fused = None

#: Use the compiled kernel where it covers the dtype (float32, float64); False, or the
#: environment variable ``DMLIB_KERNELS=numpy``, runs the numpy kernels everywhere.
USE_COMPILED = os.environ.get("DMLIB_KERNELS", "").lower() != "numpy"
_scratch = threading.local()


def compiled_for(info: FloatBits | None) -> Any:
    """The compiled kernel for this float format (``_fused.f32``/``f64``), or None."""
    if _fused is None or not USE_COMPILED or info is None or info.irregular:
        return None
    if info.dtype == np.float32:
        return _fused.f32
    if info.dtype == np.float64:
        return _fused.f64
    return None


def compiled_same() -> Any:
    """``memcmp`` of two contiguous buffers (the compiled module's ``same``), or None."""
    return _fused.same if _fused is not None and USE_COMPILED else None


def compiled_topk() -> Any:
    """The compiled top-k pass (``_fused.topk``, used by ``stats.logprob_figures``), or None."""
    return getattr(_fused, "topk", None) if _fused is not None and USE_COMPILED else None


def kernel_name() -> str:
    """Which kernels compare float32/float64 chunks here: ``"compiled"`` or ``"numpy"``."""
    return "compiled" if _fused is not None and USE_COMPILED else "numpy"


def float_pair(
    acc_aa: Acc, acc: Acc, ua: np.ndarray, ub: np.ndarray, start: int, info: FloatBits
) -> None:
    """:func:`add_aa` into ``acc_aa`` and :func:`float_chunk` into ``acc`` (they may be one
    Acc), in one pass of the compiled kernel where it covers the dtype."""
    kernel = compiled_for(info)
    if kernel is None:
        add_aa(acc_aa, ua, ub, info)
        float_chunk(acc, ua, ub, start, info)
        return
    aa, n_diff, first, max_abs, sad, sdd, max_ulp, nan_p, nan_n, inf_m, counts = _run(
        kernel, ua, ub
    )
    acc_aa.aa += aa
    if not n_diff:
        return
    if acc.first is None:
        acc.first = start + first
    acc.n_diff += n_diff
    acc.n_nan_payload += nan_p
    acc.n_nan_vs_num += nan_n
    acc.n_inf_mismatch += inf_m
    if max_ulp < 0:  # every differing pair involves a NaN or an infinity
        return
    acc.max_ulp = max(acc.max_ulp, max_ulp)
    _add_counts(acc, counts)
    acc.max_abs = max(acc.max_abs, max_abs)
    acc.sad += sad
    acc.sdd += sdd


def _run(kernel: Any, ua: np.ndarray, ub: np.ndarray) -> tuple:
    """The kernel on one chunk pair: its ten statistics and the chunk's ULP counts (the
    bins up to its largest distance; the thread's scratch bins are left zeroed)."""
    scratch = getattr(_scratch, "counts", None)
    if scratch is None:
        scratch = _scratch.counts = np.zeros(_NBINS, np.int64)
    out = list(kernel(np.ascontiguousarray(ua), np.ascontiguousarray(ub), scratch))
    max_ulp = out[6] = out[6] - 1  # (the kernel returns it + 1, unsigned)
    counts = None
    if max_ulp >= 0:
        top = min(max_ulp, ULP_EXACT + 1) + 1
        counts = scratch[:top].copy()
        scratch[:top] = 0
    return (*out, counts)


def _add_counts(acc: Acc, small: np.ndarray) -> None:
    """Add one chunk's ULP counts (bins 0..its largest distance) to ``acc.counts``."""
    if small.size > acc.counts.size:
        grown = np.zeros(max(small.size, min(_NBINS, 4 * acc.counts.size)), np.int64)
        grown[: acc.counts.size] = acc.counts
        acc.counts = grown
    acc.counts[: small.size] += small


def finite_ulps(
    ga: np.ndarray, gb: np.ndarray, info: FloatBits
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Classify differing bit patterns; returns (finite-pair mask, NaN mask a, NaN mask b)."""
    return info.finite(ga) & info.finite(gb), info.nan(ga), info.nan(gb)


def add_ulp_bincount(
    out: np.ndarray, ca: np.ndarray, cb: np.ndarray, info: FloatBits, lo: int, hi: int, shift: int
) -> None:
    """``out += bincount((u - lo) >> shift)`` over the finite differing ULP distances ``u`` in
    ``[lo, hi]`` of one chunk pair: the exact-median rescan's pass (:func:`kth_ulp`), the
    same for the local engine and a Dask piece."""
    ua, ub = ca.view(info.bits), cb.view(info.bits)
    idx = np.flatnonzero(ua != ub)
    if idx.size == 0:
        return
    ga, gb = ua[idx], ub[idx]
    fin, _, _ = finite_ulps(ga, gb, info)
    u = ulp_bits(ga[fin], gb[fin], info).astype(np.uint64)
    u = u[(u >= np.uint64(lo)) & (u <= np.uint64(hi))]
    out += np.bincount(
        ((u - np.uint64(lo)) >> np.uint64(shift)).astype(np.intp), minlength=len(out)
    )


def _dot(x: np.ndarray, y: np.ndarray) -> float:
    # einsum's own loop, not BLAS: a multi-threaded BLAS dot on a busy machine is 10-100x slower
    return float(np.einsum("i,i->", x, y))


def float_chunk(
    acc: Acc,
    ua: np.ndarray,
    ub: np.ndarray,
    start: int,
    info: FloatBits,
    neq: np.ndarray | None = None,
) -> None:
    """All statistics of one float chunk (bit views ``ua``/``ub``, ``neq`` = ``ua != ub``)."""
    if compiled_for(info) is not None:
        float_pair(Acc(), acc, ua, ub, start, info)
        return
    idx = np.flatnonzero(ua != ub if neq is None else neq)
    if idx.size == 0:
        return
    if acc.first is None:
        acc.first = start + int(idx[0])
    acc.n_diff += int(idx.size)
    ga, gb = ua[idx], ub[idx]
    mm = info.bits.type(info.mag_mask)
    top = max(int(np.max(ga & mm)), int(np.max(gb & mm)))
    if top >= info.finite_lim or info.irregular:  # a NaN or an infinity may differ: count, drop
        fin, nan_a, nan_b = finite_ulps(ga, gb, info)
        acc.n_nan_payload += int(np.count_nonzero(nan_a & nan_b))
        acc.n_nan_vs_num += int(np.count_nonzero(nan_a ^ nan_b))
        acc.n_inf_mismatch += int(np.count_nonzero(~fin & ~nan_a & ~nan_b))
        ga, gb = ga[fin], gb[fin]
        if ga.size == 0:
            return
    ulp = ulp_bits(ga, gb, info)
    top_ulp = int(ulp.max())
    acc.max_ulp = max(acc.max_ulp, top_ulp)
    if top_ulp > ULP_EXACT:
        ulp = np.minimum(ulp, info.bits.type(ULP_EXACT + 1), out=ulp)
    if ulp.dtype == np.uint64:
        ulp = ulp.astype(np.intp)  # bincount takes what casts safely to intp
    _add_counts(acc, np.bincount(ulp))  # as long as the largest distance: a few bins
    xa = _to_f64(ga, info.dtype)
    d = _to_f64(gb, info.dtype)
    d -= xa
    acc.max_abs = max(acc.max_abs, float(np.max(np.abs(d))))
    acc.sad += _dot(xa, d)
    acc.sdd += _dot(d, d)


def int_chunk(acc: Acc, va: np.ndarray, vb: np.ndarray, start: int) -> None:
    """n_diff, first difference and max |a-b| of an integer or bool chunk (typed views)."""
    if va.dtype == np.bool_:
        idx = np.flatnonzero(np.logical_xor(va, vb))
    else:
        idx = np.flatnonzero(va != vb)
    if idx.size == 0:
        return
    if acc.first is None:
        acc.first = start + int(idx[0])
    acc.n_diff += int(idx.size)
    ga, gb = va[idx], vb[idx]
    if ga.dtype == np.bool_:
        m = 1
    elif ga.dtype.kind == "u":
        m = int(np.max(np.where(ga >= gb, ga - gb, gb - ga)))
    elif ga.dtype.kind == "i":
        m = int(np.max(int_distance(ga.astype(np.int64), gb.astype(np.int64))))
    else:  # opaque bytes (quantized): no magnitude
        m = -1
    if m >= 0:
        acc.max_abs = max(acc.max_abs, float(m))
    else:
        acc.max_abs = math.nan


def kth_ulp(counts: np.ndarray, k: int, rescan: Any, max_ulp: int) -> int:
    """The k-th smallest (0-based) finite ULP distance, exactly.

    ``counts`` holds exact counts of 0..ULP_EXACT and one overflow count; ranks in the
    overflow are found by ``rescan(lo, hi, shift)``, which returns bincount of
    ``(u - lo) >> shift`` over the distances ``u`` in ``[lo, hi]`` (a re-read of the
    tensor), narrowing the range 65536-fold per pass (at most four passes for float64).
    """
    cum = np.cumsum(counts[: ULP_EXACT + 1])
    if k < cum[-1]:
        return int(np.searchsorted(cum, k, side="right"))
    k -= int(cum[-1])
    lo, hi = ULP_EXACT + 1, max_ulp
    while True:
        shift = max(0, (hi - lo + 1).bit_length() - 16)
        sub = rescan(lo, hi, shift)
        csum = np.cumsum(sub)
        j = int(np.searchsorted(csum, k, side="right"))
        k -= int(csum[j - 1]) if j else 0
        lo, hi = lo + (j << shift), min(hi, lo + ((j + 1) << shift) - 1)
        if shift == 0:
            return lo
