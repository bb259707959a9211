"""One streaming pass over a pair of tensors: every statistic of :func:`dmlib.compare`.

A tensor pair is walked in chunks of its raw (memory-mapped) bytes. Each chunk is first
compared as integers (fast, memory-bound); only chunks with a difference pay for the
float math. The SHA-256 of both sides is fed on worker threads in the same pass
(hashlib releases the GIL), and a side's hasher is only split from the other's at the
first chunk whose bytes differ, so identical tensors are hashed once.

Memory is bounded by the chunk size: the ULP median comes from exact counts of every
distance 0..ULP_EXACT plus one overflow count, refined by re-reading the tensor only
when the median lies above ULP_EXACT (so it is always exact).
"""

from __future__ import annotations

import collections
import math
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dmlib.stats.ulp import FloatBits, int_distance, ordered_int

#: Distances 0..ULP_EXACT are counted exactly; larger ones share one overflow count.
ULP_EXACT = 1 << 16
_NBINS = ULP_EXACT + 2


class HashLane:
    """A FIFO of hash updates run on one worker thread, with a bounded backlog."""

    def __init__(self, max_pending: int = 8) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._pending: collections.deque[Future[Any]] = collections.deque()
        self._max = max_pending

    def submit(self, fn: Any, *args: Any) -> None:
        self._pending.append(self._pool.submit(fn, *args))
        while len(self._pending) > self._max:
            self._pending.popleft().result()

    def drain(self) -> None:
        while self._pending:
            self._pending.popleft().result()

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._pool.shutdown(wait=True)


class TwinHash:
    """SHA-256 of side a and side b; b shares a's state until their bytes first differ."""

    def __init__(self, new_hasher: Any) -> None:
        self.a = new_hasher()
        self.b: Any = None  # None: every byte so far equal, b's digest is a's

    def feed(self, ca: np.ndarray, cb: np.ndarray, same: bool) -> None:
        if self.b is None:
            if same:
                self.a.update(ca)
                return
            self.b = self.a.copy()
        self.a.update(ca)
        self.b.update(cb)

    def hexdigests(self) -> tuple[str, str]:
        da = self.a.hexdigest()
        return da, (da if self.b is None else self.b.hexdigest())


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
        if not self.enabled:
            return
        self.done += n
        now = time.monotonic()
        if now - self.t0 > 1.0 and now - self.last > 0.25:
            self.last = now
            self.shown = True
            gib = 1 << 30
            sys.stderr.write(
                f"\rcompare: {100 * self.done / self.total:5.1f}% "
                f"({self.done / gib:.2f} of {self.total / gib:.2f} GiB per side)"
            )
            sys.stderr.flush()

    def finish(self) -> None:
        if self.shown:
            sys.stderr.write("\r" + " " * 60 + "\r")
            sys.stderr.flush()


@dataclass
class Acc:
    """Running statistics of one tensor pair."""

    n_diff: int = 0
    first: int | None = None
    max_abs: float = 0.0
    sumsq_diff: float = 0.0
    aa: float = 0.0
    bb: float = 0.0
    ab: float = 0.0
    counts: np.ndarray = field(default_factory=lambda: np.zeros(_NBINS, np.int64))
    max_ulp: int = -1
    n_nan_payload: int = 0
    n_nan_vs_num: int = 0
    n_inf_mismatch: int = 0


def _to_f64(bits: np.ndarray, dtype: np.dtype) -> np.ndarray:
    # upcast low precision before any arithmetic (bf16/f16/f8 -> f64)
    return bits.view(dtype).astype(np.float64)


def add_norms(acc: Acc, ca: np.ndarray, cb: np.ndarray | None, info: FloatBits) -> None:
    """Add a chunk's sums a.a, b.b, a.b over pairs where both sides are finite (cb None: b == a)."""
    xa = _to_f64(ca, info.dtype)
    xb = xa if cb is None else _to_f64(cb, info.dtype)
    aa = float(np.dot(xa, xa))
    bb = aa if cb is None else float(np.dot(xb, xb))
    ab = aa if cb is None else float(np.dot(xa, xb))
    if not (math.isfinite(aa) and math.isfinite(bb) and math.isfinite(ab)):
        keep = np.isfinite(xa) & np.isfinite(xb)
        xa, xb = xa[keep], xb[keep]
        aa, bb, ab = float(np.dot(xa, xa)), float(np.dot(xb, xb)), float(np.dot(xa, xb))
    acc.aa += aa
    acc.bb += bb
    acc.ab += ab


def finite_ulps(ga: np.ndarray, gb: np.ndarray, info: FloatBits) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Classify differing bit patterns; returns (finite-pair mask, NaN mask a, NaN mask b)."""
    mm = info.bits.type(info.mag_mask)
    mag_a = ga & mm
    mag_b = gb & mm
    lim = info.bits.type(info.finite_lim)
    fin = (mag_a < lim) & (mag_b < lim)
    nan_a = mag_a >= info.bits.type(info.nan_min)
    nan_b = mag_b >= info.bits.type(info.nan_min)
    return fin, nan_a, nan_b


def float_chunk(acc: Acc, ua: np.ndarray, ub: np.ndarray, start: int, info: FloatBits) -> None:
    """All statistics of one float chunk (bit views ``ua``/``ub``) that has a difference."""
    idx = np.flatnonzero(ua != ub)
    if idx.size == 0:
        return
    if acc.first is None:
        acc.first = start + int(idx[0])
    acc.n_diff += int(idx.size)
    ga, gb = ua[idx], ub[idx]
    fin, nan_a, nan_b = finite_ulps(ga, gb, info)
    if not fin.all():
        both = nan_a & nan_b
        one = nan_a ^ nan_b
        acc.n_nan_payload += int(np.count_nonzero(both))
        acc.n_nan_vs_num += int(np.count_nonzero(one))
        acc.n_inf_mismatch += int(np.count_nonzero(~fin & ~nan_a & ~nan_b))
        ga, gb = ga[fin], gb[fin]
    if ga.size == 0:
        return
    ulp = int_distance(ordered_int(ga, info), ordered_int(gb, info))
    acc.counts += np.bincount(np.minimum(ulp, ULP_EXACT + 1).astype(np.intp), minlength=_NBINS)
    acc.max_ulp = max(acc.max_ulp, int(ulp.max()))
    d = _to_f64(ga, info.dtype) - _to_f64(gb, info.dtype)
    acc.max_abs = max(acc.max_abs, float(np.max(np.abs(d))))
    acc.sumsq_diff += float(np.dot(d, d))


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
