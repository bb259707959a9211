"""Statistics of one tensor pair, streamed chunk by chunk (the row of :func:`dmlib.compare`)."""

from __future__ import annotations

import bisect
import itertools
import math
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from dmlib import hashing
from dmlib.dtypes import bits_dtype, dtype_label, is_float, native
from dmlib.errors import DmlibError
from dmlib.kernels import stream as K
from dmlib.kernels.ulp import float_bits
from dmlib.tensor import PACKINGS, Tensor, unpack

DEFAULT_CHUNK = 4 << 20

#: (column, lowest ULP, highest ULP or None for the open bucket), in histogram order.
ULP_BUCKETS: list[tuple[str, int, int | None]] = [("ulp_0", 0, 0), ("ulp_1", 1, 1), ("ulp_2", 2, 2)]
ULP_BUCKETS += [
    (f"ulp_{(1 << (k - 1)) + 1}_{1 << k}", (1 << (k - 1)) + 1, 1 << k) for k in range(2, 17)
]
ULP_BUCKETS += [(f"ulp_gt_{K.ULP_EXACT}", K.ULP_EXACT + 1, None)]
ULP_COLUMNS = [c for c, _, _ in ULP_BUCKETS] + ["ulp_nonfinite"]
NAN_COLUMNS = ["n_nan_payload", "n_nan_vs_num", "n_signed_zero", "n_inf_mismatch"]
COLUMNS = (
    ["name", "dtype", "shape", "numel", "n_diff", "frac_diff", "max_abs", "max_ulp", "median_ulp"]
    + ULP_COLUMNS
    + NAN_COLUMNS
    + ["rel_fro", "cosine", "first_diff", "data_hash_a", "data_hash_b"]
)
NULLABLE_INT = ["max_ulp"] + ULP_COLUMNS + NAN_COLUMNS


def kind_of(t: Tensor) -> str:
    """One of ``"float"`` (ULP statistics; complex too, per component), ``"int"`` (ints,
    bools) or ``"bytes"`` (quantized, opaque)."""
    if t.quantized:
        return "bytes"
    if is_float(component(t.dtype)):
        return "float"
    if t.dtype.kind in "iub":
        return "int"
    return "bytes"


def component(dtype: np.dtype) -> np.dtype:
    """The float type of a complex dtype's real and imaginary parts; other dtypes unchanged."""
    dt = np.dtype(dtype)
    if dt.kind == "c":
        return np.dtype(f"{dt.byteorder if dt.byteorder != '=' else ''}f{dt.itemsize // 2}")
    return dt


def same_layout(ta: Tensor, tb: Tensor) -> bool:
    """True when two tensors can be compared element by element (dtype, shape, size agree).

    Byte order does not count for floats and integers: a big-endian float32 holds float32
    values, compared as such. Opaque bytes must match exactly.
    """
    if kind_of(ta) == "bytes" or kind_of(tb) == "bytes":
        same_dtype = ta.dtype == tb.dtype
    else:
        same_dtype = native(ta.dtype) == native(tb.dtype)
    return (
        same_dtype
        and ta.shape == tb.shape
        and ta.quantized == tb.quantized
        and ta.nbytes == tb.nbytes
        and ta.packing == tb.packing
        and (not ta.quantized or ta.dtype_name == tb.dtype_name)
    )


def _chunk_pairs(
    ta: Tensor,
    tb: Tensor,
    elem: np.dtype,
    chunk_bytes: int,
    rel: K.PageReleaser | None = None,
    on_raw: Callable[[np.ndarray, np.ndarray], None] | None = None,
) -> Iterator[tuple[int, Any, Any]]:
    """(first element index, bytes of a, bytes of b) per chunk; pages released after use.

    ``elem`` is in this machine's byte order; a side stored in the other order is swapped
    chunk by chunk (a copy), so the kernels always see native bit patterns. ``on_raw``
    sees each chunk of a's and b's stored bytes (before any swap) once the chunk has been
    used, in order, before its pages are released.
    """
    # plain ndarray views: np.memmap's per-slice bookkeeping costs more than the compare
    ra, rb = ta.raw().view(np.ndarray), tb.raw().view(np.ndarray)
    if ra.nbytes != ta.nbytes or rb.nbytes != tb.nbytes:
        raise DmlibError(f"tensor {ta.name!r}: stored bytes do not match its nbytes", path=ta.path)
    roots = (K.PageReleaser.root(ra), K.PageReleaser.root(rb)) if rel is not None else (None, None)
    swap_a, swap_b = _swapped(ta, elem), _swapped(tb, elem)
    # packed sub-byte values (fp4x2) are unpacked chunk by chunk to one per byte
    per = PACKINGS[ta.packing] if ta.packing is not None else 1
    step = max(1, chunk_bytes // elem.itemsize) * elem.itemsize
    for off in range(0, ta.nbytes, step):
        if off:  # raw() checked the files before the first chunk; a shrunk map is not touched
            # (a stat per chunk, never the recent-check shortcut: a chunk takes well under
            # its millisecond, so a truncation during one would slip past it)
            ta.check_unchanged()
            tb.check_unchanged()
        ca, cb = ra[off : off + step], rb[off : off + step]
        sa = ca.view(elem.newbyteorder()).astype(elem).view(np.uint8) if swap_a else ca
        sb = cb.view(elem.newbyteorder()).astype(elem).view(np.uint8) if swap_b else cb
        if ta.packing is not None and tb.packing is not None:
            sa, sb = unpack(sa, ta.packing), unpack(sb, tb.packing)
        yield off // elem.itemsize * per, sa, sb
        if on_raw is not None:
            on_raw(ca, cb)
        if rel is not None:  # the mapped chunks, not the swapped copies
            rel.add(ca, roots[0])
            rel.add(cb, roots[1])


def _swapped(t: Tensor, elem: np.dtype) -> bool:
    """True when ``t`` is stored in the other byte order than this machine's, as multi-byte elements."""
    return elem.itemsize > 1 and not t.dtype.isnative


def compare_pair(
    ta: Tensor,
    tb: Tensor,
    chunk_bytes: int,
    pool: ThreadPoolExecutor,
    progress: K.Progress,
    rel: K.PageReleaser,
    hash_cache: dict[int, Future[str]] | None = None,
    hash_name: str | None = None,
) -> dict[str, Any]:
    """One row of :func:`dmlib.compare`; the two data hashes come back as futures in ``_hashes``.

    ``hash_cache`` (id of a Tensor -> future digest) lets several comparisons of the
    same open tensors hash each of them once.
    """
    kind, parts, elem, info = _layout(ta)
    hashes = _PairHashes(ta, tb, chunk_bytes, pool, hash_cache, hash_name)
    acc = K.Acc()
    differing = False
    bits = bits_dtype(elem)
    compiled = K.compiled_for(info)  # float32/float64 with the compiled kernel built
    for start, ca, cb in _chunk_pairs(ta, tb, elem, chunk_bytes, rel, hashes.on_raw()):
        va, vb = ca.view(elem), cb.view(elem)
        progress.advance(ca.nbytes)
        # equal bytes first, at memcmp speed on the widest words (no mask is built)
        # (once the tensor is known to differ, straight to the mask: most chunks will too)
        if not differing and same_bytes(ca, cb):
            continue
        if compiled is not None and info is not None and differing:
            # one pass of the compiled kernel: a.a, and the differing pairs if any
            K.float_pair(acc, acc, va, vb, start, info)
            continue
        # the integer mask the float statistics reuse (differing bytes, unless a side
        # was byte-swapped: values are compared, so a mask decides)
        neq = np.not_equal(ca.view(bits), cb.view(bits))
        if not neq.any():
            if differing and info is not None:
                K.add_aa(acc, va, vb, info)
            continue
        if not differing and info is not None:
            # the norms also need every identical chunk before the first difference
            _add_norms_before(acc, ta, tb, elem, chunk_bytes, rel, start, info)
        differing = True
        hashes.b_differs()
        _differing_chunk(acc, va, vb, start, info, compiled is not None, neq)
    hashes.close()
    row = finish_row(acc, ta, tb, kind, info, chunk_bytes, differing, rel, parts=parts)
    ta.check_unchanged()  # a row of bytes that changed under it is never returned
    tb.check_unchanged()
    row["_hashes"] = hashes.futures()
    return row


def _layout(ta: Tensor) -> tuple[str, int, np.dtype, Any]:
    """How a tensor is compared: its kind, components per element (2: complex), the
    dtype its chunks are viewed as, and the float facts (None: not a float)."""
    kind = kind_of(ta)
    # complex tensors are compared component by component (real, imaginary, real...)
    dtype = component(native(ta.dtype))
    parts = ta.dtype.itemsize // dtype.itemsize if kind != "bytes" else 1
    elem = bits_dtype(dtype) if kind == "float" else dtype if kind == "int" else np.dtype("u1")
    info = float_bits(dtype) if kind == "float" else None
    return kind, parts, elem, info


def _add_norms_before(
    acc: K.Acc,
    ta: Tensor,
    tb: Tensor,
    elem: np.dtype,
    chunk_bytes: int,
    rel: K.PageReleaser,
    start: int,
    info: Any,
) -> None:
    """Add a.a over the identical chunks before the first differing one (read again)."""
    for s2, pa, pb in _chunk_pairs(ta, tb, elem, chunk_bytes, rel):
        if s2 >= start:
            break
        K.add_aa(acc, pa.view(elem), pb.view(elem), info)


def _differing_chunk(
    acc: K.Acc,
    va: np.ndarray,
    vb: np.ndarray,
    start: int,
    info: Any,
    compiled: bool,
    neq: np.ndarray,
) -> None:
    """The statistics of one chunk that holds a difference."""
    if compiled and info is not None:
        K.float_pair(acc, acc, va, vb, start, info)
    elif info is not None:
        K.add_aa(acc, va, vb, info)
        K.float_chunk(acc, va, vb, start, info, neq)
    else:
        K.int_chunk(acc, va, vb, start)


class _PairHashes:
    """The data hashes of one pair: a's (inline in the comparison loop for BLAKE3, else
    on ``pool``), and b's only once b is known to differ from a."""

    def __init__(
        self,
        ta: Tensor,
        tb: Tensor,
        chunk_bytes: int,
        pool: ThreadPoolExecutor,
        cache: dict[int, Future[str]] | None,
        hash_name: str | None,
    ) -> None:
        self.ta, self.tb, self.chunk_bytes, self.pool = ta, tb, chunk_bytes, pool
        self.cache: dict[int, Future[str]] = {} if cache is None else cache
        self.hash_name = hash_name
        self.inline = None if hash_name is None else _inline_hasher(ta, self.cache, hash_name)
        self.inline_b: Any = None  # b's hasher, once b is known to differ (a copy of a's state)
        self.a = self.digest(ta) if self.inline is None else None
        # stays None while b's bytes equal a's; equal values in two byte orders are not equal bytes
        self.b = None if ta.dtype.isnative == tb.dtype.isnative else self.digest(tb)

    def digest(self, t: Tensor) -> Future[str] | None:
        if self.hash_name is None:  # no identity hashes asked for: bytes are compared, not hashed
            return None
        if id(t) not in self.cache:
            self.cache[id(t)] = self.pool.submit(
                _hash_checked, t, t.raw(), self.chunk_bytes, self.hash_name
            )
        return self.cache[id(t)]

    def on_raw(self) -> Callable[[np.ndarray, np.ndarray], None] | None:
        """What the chunk loop feeds each chunk's stored bytes to (None: nothing inline)."""
        return None if self.inline is None else self._feed

    def _feed(self, raw_a: np.ndarray, raw_b: np.ndarray) -> None:
        assert self.inline is not None
        self.inline.update(raw_a)
        if self.inline_b is not None:
            self.inline_b.update(raw_b)

    def b_differs(self) -> None:
        """b differs from a in the current chunk: start b's hash if it is not running."""
        if self.b is None and self.inline_b is None and self.hash_name is not None:
            # b equals a up to this chunk: b's hash continues from a's state, in the loop,
            # instead of reading b again on a worker thread
            if self.inline is not None and id(self.tb) not in self.cache:
                self.inline_b = self.inline.copy()
            else:
                self.b = self.digest(self.tb)

    def close(self) -> None:
        """The inline digests, once every chunk went through the loop."""
        if self.inline is not None:
            self.a = self.cache[id(self.ta)] = Future()
            self.a.set_result(self.inline.hexdigest())
        if self.inline_b is not None:
            self.b = self.cache[id(self.tb)] = Future()
            self.b.set_result(self.inline_b.hexdigest())

    def futures(self) -> tuple[Future[str] | None, Future[str] | None]:
        """(a's, b's) digest futures; b's None when its bytes are a's (then cached as a's)."""
        if self.b is None and self.a is not None:
            self.cache.setdefault(id(self.tb), self.a)  # same bytes, same digest
        return self.a, self.b


def compare_arrays(
    a: np.ndarray, b: np.ndarray, chunk_bytes: int = DEFAULT_CHUNK, name: str = "array"
) -> dict[str, Any]:
    """The :func:`dmlib.compare` row of two in-memory arrays of one dtype and shape (no
    hashes): the comparison's statistics and NaN policy for arrays that are no file's."""
    ta, tb = (
        Tensor(name, x.dtype, x.shape, nbytes=x.nbytes, source=x)
        for x in (np.ascontiguousarray(a), np.ascontiguousarray(b))
    )
    if not same_layout(ta, tb):
        raise DmlibError(
            f"{name}: {dtype_label(ta.dtype)}{list(ta.shape)} and "
            f"{dtype_label(tb.dtype)}{list(tb.shape)} cannot be compared element by element"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        row = compare_pair(ta, tb, chunk_bytes, None, K.Progress(0, False), K.PageReleaser())  # type: ignore[arg-type]
    row.pop("_hashes", None)
    return row


def _hash_checked(t: Tensor, raw: np.ndarray, chunk_bytes: int, hash_name: str) -> str:
    """The digest of ``raw`` (``t``'s bytes), refused if ``t``'s file changed meanwhile."""
    digest = K.hash_views([raw], chunk_bytes, hash_name)
    t.check_unchanged()
    return digest


def _inline_hasher(ta: Tensor, cache: dict[int, Future[str]], hash_name: str | None) -> Any:
    """A BLAKE3 hasher fed with a's chunks by the comparison loop itself, or None.

    Hashing each chunk right after comparing it reads pages the comparison has just
    mapped; on a worker thread the hash trailed the comparison, found its pages already
    released and faulted them in again. BLAKE3 hashes each chunk on every core, so the
    loop costs about compare + hash / cores (benchmarks/README.md). SHA-256 is
    sequential: it stays on the worker pool, beside the comparison.
    """
    if id(ta) in cache or hashing.algorithm(hash_name) != hashing.BLAKE3:
        return None
    # a multi-threaded BLAKE3 hasher costs ~60 us to make and is slower than one thread
    # below about a megabyte (measured: 0.8 MB 158 vs 141 us, 4 MiB 460 vs 780 us): a
    # checkpoint of many small tensors paid that per tensor; the digest is the same
    threads = _HASH_THREADS if ta.nbytes >= _THREADED_HASH_BYTES else 1
    return hashing.Hasher(hash_name, threads=threads)


#: Threads BLAKE3 uses per chunk hashed inside the comparison loop (tensors of at least
#: ``_THREADED_HASH_BYTES``; smaller ones on one thread).
_HASH_THREADS = max(1, min(os.cpu_count() or 1, 8))
_THREADED_HASH_BYTES = 2 << 20


#: Bytes compared per step when checking two chunks for equality: the comparison's
#: temporary (one bool per 8-byte word) stays in the core's cache.
_EQ_BLOCK = 1 << 20


def same_bytes(ca: np.ndarray, cb: np.ndarray) -> bool:
    """True when two chunks hold the same bytes (compared as 8-byte words where they
    divide, a block at a time, stopping at the first block that differs)."""
    if ca.nbytes != cb.nbytes:
        return False
    ua, ub = ca.view(np.uint8).reshape(-1), cb.view(np.uint8).reshape(-1)
    same = K.compiled_same()
    if same is not None and ua.flags.c_contiguous and ub.flags.c_contiguous:
        return bool(same(ua, ub))  # memcmp, the interpreter lock released
    n8 = ca.nbytes // 8 * 8
    for off in range(0, n8, _EQ_BLOCK):
        end = min(off + _EQ_BLOCK, n8)
        if not np.array_equal(ua[off:end].view(np.uint64), ub[off:end].view(np.uint64)):
            return False
    return bool(np.array_equal(ua[n8:], ub[n8:]))


def identical_row(ta: Tensor) -> dict[str, Any]:
    """The row of a pair whose bytes are known to be identical (equal digests), read from nothing."""
    kind, parts, _, info = _layout(ta)
    return finish_row(K.Acc(), ta, ta, kind, info, 0, False, None, parts=parts)


def finish_row(
    acc: K.Acc,
    ta: Tensor,
    tb: Tensor,
    kind: str,
    info: Any,
    chunk_bytes: int,
    differing: bool,
    rel: K.PageReleaser | None,
    reread: Any = None,
    parts: int = 1,
) -> dict[str, Any]:
    """The result row of a compared pair, from its accumulator.

    Name, dtype, shape, numel, ``n_diff``, ``frac_diff`` (of ``numel x parts`` components),
    ``max_abs`` and ``first_diff`` (an element index, None when nothing differs); for
    ``kind == "bytes"``, ``frac_diff`` is per byte, ``max_abs`` NaN and ``first_diff`` a byte
    index. With float facts (``info`` not None), the ULP and norm columns too; ``reread``: an
    engine's re-reads of the bytes for them (None: read here).
    """
    # parts: components per element (2 for complex, compared component by component)
    numel = ta.numel
    row: dict[str, Any] = {
        "name": ta.name,
        "dtype": dtype_label(ta.dtype) if not ta.quantized else ta.dtype_name,
        "shape": list(ta.shape),
        "numel": numel,
        "n_diff": acc.n_diff,
        "frac_diff": acc.n_diff / (numel * parts) if numel else 0.0,
        "max_abs": acc.max_abs,
        "first_diff": None
        if acc.first is None
        else tuple(int(i) for i in np.unravel_index(acc.first // parts, ta.shape)),
    }
    if kind == "bytes":
        row["frac_diff"] = acc.n_diff / ta.nbytes if ta.nbytes else 0.0
        row["max_abs"] = math.nan
        if acc.first is not None:
            row["first_diff"] = (acc.first,)  # byte index: the packed layout has no element grid
    if info is not None:
        row.update(_float_columns(acc, ta, tb, info, chunk_bytes, differing, rel, reread))
    return row


def _float_columns(
    acc: K.Acc,
    ta: Tensor,
    tb: Tensor,
    info: Any,
    chunk_bytes: int,
    differing: bool,
    rel: K.PageReleaser | None,
    reread: Any = None,
) -> dict:
    # reread: an engine's ``rescan(lo, hi, shift)`` and ``sum_bb()`` over the same bytes
    # (read where the bytes are); None reads them here
    c = acc.counts
    out: dict[str, Any] = {}
    # the histogram has 65,538 bins, mostly empty: its non-empty bins are found once
    # (one pass) and each bucket sums those in its range (twenty passes over every bin
    # cost a small tensor ~60 us); the sums are of the same integers
    bins = np.flatnonzero(c).tolist()
    running = [0, *itertools.accumulate(c[bins].tolist())]  # Python ints: exact
    for col, lo, hi in ULP_BUCKETS:
        i = bisect.bisect_left(bins, lo)
        j = len(bins) if hi is None else bisect.bisect_right(bins, hi)
        out[col] = running[j] - running[i]
    out["ulp_nonfinite"] = acc.n_nan_payload + acc.n_nan_vs_num + acc.n_inf_mismatch
    out["n_nan_payload"] = acc.n_nan_payload
    out["n_nan_vs_num"] = acc.n_nan_vs_num
    out["n_signed_zero"] = int(c[0])
    out["n_inf_mismatch"] = acc.n_inf_mismatch
    n_fin = int(c.sum())
    if n_fin:
        out["max_ulp"] = acc.max_ulp

        def rescan(lo: int, hi: int, shift: int) -> np.ndarray:
            if reread is not None:
                return reread.rescan(lo, hi, shift)
            return _rescan(ta, tb, info, chunk_bytes, lo, hi, shift, rel)

        lo_k = K.kth_ulp(c, (n_fin - 1) // 2, rescan, acc.max_ulp)
        hi_k = lo_k if n_fin % 2 else K.kth_ulp(c, n_fin // 2, rescan, acc.max_ulp)
        out["median_ulp"] = (lo_k + hi_k) / 2
    else:
        out["max_ulp"] = 0  # no finite pair differs: the largest distance over finite pairs is 0
        out["median_ulp"] = math.nan
    if not differing:
        out["rel_fro"], out["cosine"] = 0.0, 1.0
        return out
    bb = acc.bb
    if bb <= 1e-9 * acc.aa:
        # b.b came out of a cancellation (b is nearly the zero vector): sum it directly
        bb = reread.sum_bb() if reread is not None else _sum_bb(ta, tb, info, chunk_bytes, rel)
    na, nb = math.sqrt(acc.aa), math.sqrt(bb)
    nd = math.sqrt(acc.sdd)
    out["rel_fro"] = nd / na if na > 0 else (0.0 if nd == 0 else math.inf)
    if na > 0 and nb > 0:
        out["cosine"] = max(-1.0, min(1.0, acc.ab / (na * nb)))
    else:
        out["cosine"] = 1.0 if na == nb else 0.0
    return out


def _sum_bb(
    ta: Tensor, tb: Tensor, info: Any, chunk_bytes: int, rel: K.PageReleaser | None
) -> float:
    """sum b*b over pairs finite on both sides, read again (the rare near-zero-b case)."""
    acc = K.Acc()
    for _, ca, cb in _chunk_pairs(ta, tb, info.bits, chunk_bytes, rel):
        K.add_aa(acc, cb.view(info.bits), ca.view(info.bits), info)
    return acc.aa


def _rescan(
    ta: Tensor,
    tb: Tensor,
    info: Any,
    chunk_bytes: int,
    lo: int,
    hi: int,
    shift: int,
    rel: K.PageReleaser | None,
) -> np.ndarray:
    """bincount of ``(u - lo) >> shift`` over finite differing ULP distances ``u`` in [lo, hi]."""
    nb = ((hi - lo) >> shift) + 1
    out = np.zeros(nb, np.int64)
    for _, ca, cb in _chunk_pairs(ta, tb, info.bits, chunk_bytes, rel):
        K.add_ulp_bincount(out, ca, cb, info, lo, hi, shift)
    return out
