"""The numbers of a log-prob comparison, token by token, summed per sequence.

Everything is computed in float64 from the stored values, over the counted tokens of a
block of sequences at a time (flat arrays), and reduced per sequence by ``reduceat``;
:class:`Sums` holds one block's per-sequence sums and maxima, and :func:`combine` the
overall figures from all blocks. The definitions (``docs/logprobs.md``), with
``x = log p_A``, ``y = log p_B`` of the sampled token, ``d = y - x = log r``,
``r = p_B / p_A``:

- ``mean_abs_dlogprob``, ``max_abs_dlogprob``: mean and max of ``|d|``;
- ``k1 = -d``, ``k2 = d**2 / 2``, ``k3 = (r - 1) - d``: Schulman's estimators of
  ``KL(A || B)`` from tokens sampled by A (their means);
- ``chi2 = (r - 1)**2`` (mean): estimates the chi-square divergence ``E_A[(r - 1)**2]``;
- ``mean_abs_dp``: mean ``|exp(y) - exp(x)|``;
- ``pearson_r`` of ``x`` and ``y``; ``frac_over_ln2``: share of tokens with ``|d| > ln 2``;
- ``max_ulp``: largest ULP distance where both sides hold one float dtype.

Only tokens where both log-probs are finite enter the figures; ``n_nonfinite`` counts
the others (and ``n_diff`` counts those of them whose values differ).
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from dmlib.errors import DmlibError
from dmlib.kernels.stream import compiled_topk
from dmlib.kernels.ulp import ulp_distance

__all__ = [
    "LN2",
    "Segments",
    "Sums",
    "block_sums",
    "combine",
    "full_kl",
    "on_threads",
    "per_sequence",
    "topk_kl",
]

LN2 = math.log(2.0)

#: Top-k lists up to this length are matched by shifts (K comparisons per entry); longer
#: ones by a sort per token (:func:`_pairs_general`).
_SHIFTS_UP_TO = 64

#: False (tests): :func:`topk_kl` takes its numpy path even where the compiled pass
#: (``dmlib/kernels/_fused.c``'s ``topk``) is built; ``DMLIB_KERNELS=numpy`` turns that
#: off everywhere (``dmlib.kernels.stream.compiled_topk``).
USE_COMPILED = True

_SUMS = ("k1", "k2", "k3", "chi2", "abs_dp", "abs_d", "over")

_T = TypeVar("_T")
_R = TypeVar("_R")


def on_threads(fn: Callable[[_T], _R], items: Sequence[_T], workers: int) -> list[_R]:
    """``[fn(item) for item in items]``, the items taken in turn by ``workers`` threads
    (the calling one among them); an item that raises raises here, the first in order.

    Plain threads: ``concurrent.futures`` imports ``logging`` and ``queue``, some 4 ms of
    every command's start-up on this machine."""
    out: list[Any] = [None] * len(items)
    errors: list[BaseException | None] = [None] * len(items)
    turn = itertools.count()  # next() on a count is atomic under the interpreter lock

    def work() -> None:
        while (i := next(turn)) < len(items):
            try:
                out[i] = fn(items[i])
            except BaseException as err:  # noqa: BLE001 - re-raised below, in item order
                errors[i] = err

    threads = [threading.Thread(target=work) for _ in range(min(workers, len(items)) - 1)]
    for t in threads:
        t.start()
    try:
        work()
    finally:
        for t in threads:
            t.join()
    for err in errors:
        if err is not None:
            raise err
    return out


@dataclass
class Sums:
    """One block of sequences: per-sequence counts, sums, maxima and centred moments."""

    n: np.ndarray
    n_finite: np.ndarray
    n_diff: np.ndarray
    n_nonfinite: np.ndarray
    sums: dict[str, np.ndarray]
    max_abs: np.ndarray
    worst: np.ndarray  # position of the largest |d| in its sequence (-1: none)
    mean_x: np.ndarray
    mean_y: np.ndarray
    m2x: np.ndarray
    m2y: np.ndarray
    cxy: np.ndarray
    max_ulp: np.ndarray | None
    extra: dict[str, np.ndarray] = field(default_factory=dict)  # kl sums, overlap sums
    extra_n: dict[str, np.ndarray] = field(default_factory=dict)
    extra_max: dict[str, np.ndarray] = field(default_factory=dict)
    top: list[tuple[float, int, int, float, float]] = field(default_factory=list)


class Segments:
    """Consecutive per-sequence segments of a flat array: sums and maxima by ``reduceat``."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths
        self.starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        self.nz = lengths > 0
        self.first = self.starts[self.nz]

    def sum(self, values: np.ndarray) -> np.ndarray:
        out = np.zeros(len(self.lengths))
        if len(self.first):
            out[self.nz] = np.add.reduceat(values, self.first)
        return out

    def max(self, values: np.ndarray, fill: Any) -> np.ndarray:
        out = np.full(len(self.lengths), fill, dtype=values.dtype)
        if len(self.first):
            out[self.nz] = np.maximum.reduceat(values, self.first)
        return out

    def spread(self, per_seq: np.ndarray) -> np.ndarray:
        return np.repeat(per_seq, self.lengths)

    def count(self, mask: np.ndarray) -> np.ndarray:
        """The true entries of each segment (float64, as :meth:`sum` of the mask as 0/1
        gives them): by where the true entries fall, no float copy of the mask."""
        where = np.flatnonzero(mask)
        edges = np.searchsorted(where, np.append(self.starts, len(mask)))
        return np.diff(edges).astype(np.float64)


def block_sums(
    ra: np.ndarray, rb: np.ndarray, lengths: np.ndarray, *, first_seq: int, n_worst: int
) -> Sums:
    """The sampled-token figures of one block: ``ra``, ``rb`` the stored log-probs (flat),
    ``lengths`` the counted tokens per sequence of the block."""
    x = ra.astype(np.float64)
    y = rb.astype(np.float64)
    seg = Segments(lengths)
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite pairs: masked out below
        d = y - x
    # the common case, every pair finite (then no mask is needed below), told by one pass
    # over d: a non-finite x or y makes d non-finite; only where d is not finite (that, or
    # an overflow) are x and y tested
    fin = np.ones(0, dtype=bool)
    every = bool(np.isfinite(d).all())
    if not every:
        fin = np.isfinite(x) & np.isfinite(y)
        every = bool(fin.all())
        d = d if every else np.where(fin, d, 0.0)
    diff = _differs(ra, rb, x, y)
    with np.errstate(invalid="ignore", over="ignore"):
        r1 = np.expm1(d)
        dp = np.abs(np.exp(y) - np.exp(x))
    ad = np.abs(d)
    sums = {
        "k1": -seg.sum(d),
        "k2": seg.sum(d * d) / 2,
        "k3": seg.sum(r1 - d),
        "chi2": seg.sum(r1 * r1),
        "abs_dp": seg.sum(dp if every else np.where(fin, dp, 0.0)),
        "abs_d": seg.sum(ad),
        "over": seg.count(ad > LN2),
    }
    nf = lengths.astype(np.float64) if every else seg.count(fin)
    moments = _moments(x, y, None if every else fin, seg, nf)
    # |d| for ranking: a non-finite pair that differs ranks first (inf), an equal one last
    rank = ad if every else np.where(fin, ad, np.where(diff, np.inf, -1.0))
    max_abs = seg.max(ad if every else np.where(fin, ad, -np.inf), -np.inf)
    best = max_abs if every else seg.max(rank, -np.inf)  # every: rank is |d|
    worst = _argmax_pos(rank, seg, best)
    ulp = None
    if ra.dtype == rb.dtype:
        u = ulp_distance(ra, rb) if every else np.where(fin, ulp_distance(ra, rb), 0)
        ulp = seg.max(u.astype(np.uint64), np.uint64(0))
    return Sums(
        n=lengths.astype(np.int64),
        n_finite=nf.astype(np.int64),
        n_diff=seg.count(diff).astype(np.int64),
        n_nonfinite=(lengths - nf).astype(np.int64),
        sums=sums,
        max_abs=max_abs,
        worst=worst,
        mean_x=moments["mean_x"],
        mean_y=moments["mean_y"],
        m2x=moments["m2x"],
        m2y=moments["m2y"],
        cxy=moments["cxy"],
        max_ulp=ulp,
        top=_top(rank, seg, best, first_seq, x, y, n_worst),
    )


def _differs(ra: np.ndarray, rb: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Tokens whose stored bits differ (one dtype) or whose values differ (two dtypes;
    NaN against NaN is equal)."""
    if ra.dtype == rb.dtype:
        u = np.dtype(f"u{ra.dtype.itemsize}")
        return ra.view(u) != rb.view(u)
    return (x != y) & ~(np.isnan(x) & np.isnan(y))


def _moments(
    x: np.ndarray, y: np.ndarray, fin: np.ndarray | None, seg: Segments, nf: np.ndarray
) -> dict[str, np.ndarray]:
    """Per-sequence means and centred second moments (two passes: no cancellation);
    ``fin`` masks the tokens that count (None: all)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mx = seg.sum(x if fin is None else np.where(fin, x, 0.0)) / nf
        my = seg.sum(y if fin is None else np.where(fin, y, 0.0)) / nf
    mx = np.where(nf > 0, mx, 0.0)
    my = np.where(nf > 0, my, 0.0)
    dx = x - seg.spread(mx)
    dy = y - seg.spread(my)
    if fin is not None:
        dx, dy = np.where(fin, dx, 0.0), np.where(fin, dy, 0.0)
    return {
        "mean_x": mx,
        "mean_y": my,
        "m2x": seg.sum(dx * dx),
        "m2y": seg.sum(dy * dy),
        "cxy": seg.sum(dx * dy),
    }


def _argmax_pos(rank: np.ndarray, seg: Segments, best: np.ndarray) -> np.ndarray:
    """Position (within its sequence) of the first largest ``rank`` (``best``: each
    sequence's largest); -1 for none."""
    out = np.full(len(seg.lengths), -1, dtype=np.int64)
    if not len(seg.first):
        return out
    idx = np.where(rank == seg.spread(best), np.arange(len(rank)), len(rank))
    out[seg.nz] = np.minimum.reduceat(idx, seg.first) - seg.first
    out[best <= 0] = -1  # nothing differs there: no worst position
    return out


def _top(
    rank: np.ndarray,
    seg: Segments,
    best: np.ndarray,
    first_seq: int,
    x: np.ndarray,
    y: np.ndarray,
    n: int,
) -> list[tuple[float, int, int, float, float]]:
    """The ``n`` largest ``rank`` (> 0): (rank, sequence, position, x, y); among equal
    ranks at the cut, the first tokens.

    Where the block has ``n`` sequences or more, only tokens ranked at least the
    ``n``-th largest of the sequences' largest ranks (``best``) are looked at: ``n``
    sequences each hold a token ranked that high, so the ``n`` largest of the block are
    among them (no selection over every token)."""
    if n <= 0 or not len(rank):
        return []
    k = min(n, len(rank))
    peaks = best[seg.nz]
    floor = np.partition(peaks, len(peaks) - k)[len(peaks) - k] if len(peaks) >= k else 0.0
    idx = np.flatnonzero((rank >= floor) & (rank > 0))
    if len(idx) > k:
        v = rank[idx]
        cut = -np.partition(-v, k - 1)[k - 1]
        above = idx[v > cut]
        idx = np.concatenate([above, idx[v == cut][: k - len(above)]])
    seq = np.searchsorted(seg.starts, idx, side="right") - 1
    return [
        (float(rank[i]), int(s) + first_seq, int(i - seg.starts[s]), float(x[i]), float(y[i]))
        for i, s in zip(idx, seq, strict=True)
    ]


# -- whole distributions ---------------------------------------------------------------


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    top = np.max(z, axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    return z - top - np.log(np.sum(np.exp(z - top), axis=1, keepdims=True))


def full_kl(za: np.ndarray, zb: np.ndarray, k: int, rows: int = 1 << 22) -> dict[str, np.ndarray]:
    """Per token: ``kl_ab = sum_v p_A (log p_A - log p_B)``, ``kl_ba`` the other way, and
    ``topk_overlap``: the share of A's ``k`` most likely ids among B's ``k`` (from logits
    or log-probs over the whole vocabulary; the softmax is taken in float64)."""
    n, v = za.shape
    k = max(1, min(k, v))
    out = {name: np.empty(n) for name in ("kl_ab", "kl_ba", "topk_overlap")}
    step = max(1, rows // max(v, 1))
    for s in range(0, n, step):
        la, lb = _log_softmax(za[s : s + step]), _log_softmax(zb[s : s + step])
        pa, pb = np.exp(la), np.exp(lb)
        with np.errstate(invalid="ignore"):
            out["kl_ab"][s : s + step] = np.sum(np.where(pa > 0, pa * (la - lb), 0.0), axis=1)
            out["kl_ba"][s : s + step] = np.sum(np.where(pb > 0, pb * (lb - la), 0.0), axis=1)
        ia = np.argpartition(-la, k - 1, axis=1)[:, :k]
        ib = np.argpartition(-lb, k - 1, axis=1)[:, :k]
        out["topk_overlap"][s : s + step] = _matches(ia, ib)[0].sum(axis=1) / k
    return out


def _matches(ia: np.ndarray, ib: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For id lists ``[n, Ka]`` and ``[n, Kb]`` (distinct ids within a list): a mask of
    adjacent matched pairs ``[n, Ka + Kb - 1]`` and the column in A and in B of each pair.

    One sort per row: the key holds the id, then the side, then the column, so that an id
    both lists hold sorts as A's entry followed by B's.
    """
    ka = ia.shape[1]
    cols_a = np.arange(ka, dtype=np.int64)
    cols_b = np.arange(ib.shape[1], dtype=np.int64) + (1 << 16)
    key = np.concatenate(
        [(ia.astype(np.int64) << 17) | cols_a, (ib.astype(np.int64) << 17) | cols_b], axis=1
    )
    key.sort(axis=1)
    ident = key >> 17
    low = key & ((1 << 17) - 1)
    match = (ident[:, 1:] == ident[:, :-1]) & (low[:, :-1] < (1 << 16)) & (low[:, 1:] >= (1 << 16))
    col_a = np.where(match, low[:, :-1], 0)
    col_b = np.where(match, low[:, 1:] - (1 << 16), 0)
    return match, col_a, col_b


def topk_kl(
    la: np.ndarray,
    ia: np.ndarray,
    lb: np.ndarray,
    ib: np.ndarray,
    rows: int | None = None,
    *,
    threads: int | None = None,
) -> dict[str, np.ndarray]:
    """Per token, from top-k log-probs with their ids: ``topk_overlap`` (ids both lists
    hold / the shorter list's length) and ``kl_topk_ab`` / ``kl_topk_ba``: the KL of the
    two distributions coarsened to the ids both lists hold plus one bucket for the rest of
    the vocabulary (a lower bound of the whole KL: coarsening never raises a KL). An id a
    list holds twice counts once, with its first entry's log-prob.

    By the compiled pass (``_fused.topk``: one pass per token) where it is built, else in
    numpy; both worked through ``rows`` tokens at a time (numpy: in buffers made once per
    thread; fresh temporaries of a block each time would fault in new pages), on threads
    where there are several blocks (both release the interpreter lock): at most ``threads``
    (None: the machine's cores, up to 8).
    """
    _check_topk_shapes(la, ia, lb, ib)
    n = la.shape[0]
    out = {k: np.empty(n) for k in ("kl_topk_ab", "kl_topk_ba", "topk_overlap")}
    ka, kb = ia.shape[1], ib.shape[1]
    k = max(1, min(ka, kb))
    shifts = ka == kb <= _SHIFTS_UP_TO
    compiled = _topk_compiled(la, ia, lb, ib)
    if compiled is not None:
        rows = rows or 1 << 16  # no buffers to keep in the cache: larger blocks
    else:
        # the shifts' comparisons take K * K bytes per token, the sort's keys 8 (Ka + Kb)
        cap = (1 << 22) // max(1, ka * ka) if shifts else (1 << 20) // max(1, ka + kb)
        rows = max(1, min(rows or 1 << 13, cap))
    starts = list(range(0, n, rows))
    workers = max(1, min(len(starts), os.cpu_count() or 1, 8, threads or 8))

    def run(mine: list[int]) -> None:
        if compiled is not None:
            for s in mine:
                compiled(s, min(n, s + rows), out)
            return
        work = _TopkWork(min(rows, n), ka, shifts)
        for s in mine:
            e = min(n, s + rows)
            mask, y = _topk_pairs(ia[s:e], ib[s:e], lb[s:e], work)
            for key, v in _topk_sums(la[s:e], mask, y, k, work).items():
                out[key][s:e] = v

    on_threads(run, [starts[w::workers] for w in range(workers)], workers)
    return out


def _check_topk_shapes(la: np.ndarray, ia: np.ndarray, lb: np.ndarray, ib: np.ndarray) -> None:
    """Both sides' log-probs and ids ``[n, K]`` of one ``n``, each side's two of one ``K``."""
    for side, lp, ids in (("A", la, ia), ("B", lb, ib)):
        if lp.ndim != 2 or lp.shape != ids.shape:
            raise DmlibError(
                f"top_logprobs of {side} have shape {list(lp.shape)}, its top_ids "
                f"{list(ids.shape)}: expected one [tokens, K]"
            )
    if la.shape[0] != lb.shape[0]:
        raise DmlibError(f"top-k lists of {la.shape[0]} tokens in A, {lb.shape[0]} in B")


def _topk_compiled(la: np.ndarray, ia: np.ndarray, lb: np.ndarray, ib: np.ndarray) -> Any:
    """``run(s, e, out)``: the compiled pass (``_fused.topk``) over tokens ``s:e``, or None
    where it is not built, is switched off, or the lists are empty. The shapes are checked
    before (:func:`_check_topk_shapes`), then the C checks every buffer's length against
    them; it reads C-ordered float32/float64 log-probs and
    int32/int64 ids (others are converted first: ids are below 2**46, as the caller checks).
    """
    topk = compiled_topk() if USE_COMPILED else None
    if topk is None:
        return None
    if not (la.shape[1] and lb.shape[1]):
        return None

    def fit(v: np.ndarray, kinds: tuple[type, ...], other: type) -> np.ndarray:
        return np.ascontiguousarray(v if v.dtype in kinds else v.astype(other))

    la, lb = (fit(v, (np.float32, np.float64), np.float64) for v in (la, lb))
    ia, ib = (fit(v, (np.int32, np.int64), np.int64) for v in (ia, ib))
    ka, kb = la.shape[1], lb.shape[1]
    widths = (la.itemsize, lb.itemsize, ia.itemsize, ib.itemsize)

    def run(s: int, e: int, out: dict[str, np.ndarray]) -> None:
        res = [out[k][s:e] for k in ("kl_topk_ab", "kl_topk_ba", "topk_overlap")]
        topk(la[s:e], ia[s:e], lb[s:e], ib[s:e], *res, e - s, ka, kb, *widths)

    return run


class _TopkWork:
    """The buffers one thread reuses block after block (views of their first rows)."""

    def __init__(self, rows: int, k: int, shifts: bool = True) -> None:
        self.k = k
        self.shifts = shifts
        self.f64 = [np.empty(rows * k) for _ in range(5)]
        self.flags = [np.empty(rows * k, dtype=bool) for _ in range(2)]
        self.ids = [np.empty(rows * k, dtype=np.uint16) for _ in range(2)]
        self.tag = np.empty(rows * k, dtype=np.int64)
        size = max(k - 1, 1) * k * rows if shifts else 0
        self.eq = np.zeros(-(-size // 8) * 8, dtype=bool)  # whole 8-byte words

    def f(self, i: int, n: int) -> np.ndarray:
        return self.f64[i][: n * self.k].reshape(n, self.k)


def _topk_pairs(
    ia: np.ndarray, ib: np.ndarray, lb: np.ndarray, work: _TopkWork | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(mask, y)``, both ``[n, Ka]`` in A's entries: ``mask`` where the entry is the first
    of its id in A's list and B's list holds the id, ``y`` B's log-prob of it there (B's
    first entry of the id; float64).

    Nothing is sorted: A's entry ``i`` is compared with B's entry ``i`` (the lists' orders
    mostly agree), then for each shift ``t`` with B's entry ``(i + t) % K`` of the same
    token, on the id lists transposed (``[K, n]``: each shift is two contiguous
    comparisons) and cut to their low 16 bits; the few candidates of every shift are then
    checked on the whole ids at once. Where an id of one list meets two entries of the
    other (a repeated id), the token is done again by :func:`_pairs_general`.
    """
    n, ka = ia.shape
    if ka != ib.shape[1] or n == 0 or work is None or work.k != ka or not work.shifts:
        return _pairs_general(ia, ib, lb)
    ia, ib, lb = (np.ascontiguousarray(v) for v in (ia, ib, lb))
    flat_m, flat_h = (f[: n * ka] for f in work.flags)
    mask = flat_m.reshape(n, ka)
    np.equal(ia, ib, out=mask)
    flat_h[:] = flat_m
    y = work.f(0, n)
    y[:] = lb
    at, bt = (v[: n * ka].reshape(ka, n) for v in work.ids)
    np.copyto(at, ia.T, casting="unsafe")  # the low 16 bits: a match is a candidate
    np.copyto(bt, ib.T, casting="unsafe")
    size = ka * n
    eq = work.eq[: (ka - 1) * size].reshape(ka - 1, ka, n)
    for t in range(1, ka):
        np.equal(at[: ka - t], bt[t:], out=eq[t - 1, : ka - t])
        np.equal(at[ka - t :], bt[:t], out=eq[t - 1, ka - t :])
    fa, fb, r = _candidates(work.eq, (ka - 1) * size, n, ka)
    fa, fb, r = (v[ia.ravel()[fa] == ib.ravel()[fb]] for v in (fa, fb, r))
    dirty = r[flat_m[fa] | flat_h[fb] | _repeated(fa, work.tag) | _repeated(fb, work.tag)]
    flat_m[fa] = True
    flat_h[fb] = True
    y.ravel()[fa] = lb.ravel()[fb]
    if len(dirty):
        flag = np.zeros(n, dtype=bool)  # not np.unique: it imports numpy.ma (10 ms)
        flag[dirty] = True
        again = np.flatnonzero(flag)
        mask[again], y[again] = _pairs_general(ia[again], ib[again], lb[again])
    return mask, y


def _candidates(
    eq: np.ndarray, used: int, n: int, ka: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The true entries of the ``[K - 1, K, n]`` comparisons as flat entries of A and B
    (``[n, K]``) and their token: found by 8-byte words, then within the words."""
    w = np.flatnonzero(eq[: -(-used // 8) * 8].view(np.uint64) != 0)
    p = (w[:, None] * 8 + np.arange(8)).ravel()
    p = p[p < used]
    p = p[eq[p]]
    t, p = np.divmod(p, ka * n)
    i, r = np.divmod(p, n)
    return r * ka + i, r * ka + (i + t + 1) % ka, r


def _repeated(flat: np.ndarray, tag: np.ndarray) -> np.ndarray:
    """Where ``flat`` holds an entry more than once (every occurrence but the last)."""
    order = np.arange(len(flat))
    tag[flat] = order
    return tag[flat] != order


def _pairs_general(ia: np.ndarray, ib: np.ndarray, lb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_topk_pairs` by one sort per token of keys holding the id, the side and the
    entry: an id's keys sort together, A's before B's, each list's in its order, so the
    first key of an id is A's first entry of it and the first B key after an A key of the
    same id is B's first entry. For long lists, lists of two lengths and tokens with a
    repeated id; ids below 2**46 and lists shorter than 2**16 (the caller checks).
    """
    n, ka = ia.shape
    kb = ib.shape[1]
    mask, y = np.zeros((n, ka), dtype=bool), np.zeros((n, ka))
    if not (n and ka and kb):
        return mask, y
    key = np.concatenate(
        [
            (ia.astype(np.int64) << 17) | np.arange(ka, dtype=np.int64),
            (ib.astype(np.int64) << 17) | np.arange(kb, dtype=np.int64) | (1 << 16),
        ],
        axis=1,
    )
    key.sort(axis=1)
    ident, side = key >> 17, (key >> 16) & 1
    start = np.ones(key.shape, dtype=bool)
    start[:, 1:] = ident[:, 1:] != ident[:, :-1]
    first = np.maximum.accumulate(np.where(start, np.arange(ka + kb), 0), axis=1)
    b_first = np.zeros(key.shape, dtype=bool)
    b_first[:, 1:] = (side[:, 1:] == 1) & (side[:, :-1] == 0) & ~start[:, 1:]
    row, at = np.nonzero(b_first)
    col_a = key[row, first[row, at]] & 0xFFFF
    col_b = key[row, at] & 0xFFFF
    mask[row, col_a] = True
    y[row, col_a] = lb[row, col_b]
    return mask, y


def _topk_sums(
    la: np.ndarray, mask: np.ndarray, y: np.ndarray, k: int, work: _TopkWork | None = None
) -> dict[str, np.ndarray]:
    """The top-k figures of ``n`` tokens from :func:`_topk_pairs`' ``mask`` and ``y``.

    Without guards first (products with the 0/1 mask, sums as dot products); a token
    where any log-prob is not finite (or ``exp`` overflows) comes out non-finite there and
    is done again with the guards (``0 log 0 = 0``, an entry with no mass adds nothing).
    """
    n = la.shape[0]
    if work is None or work.k != la.shape[1] or y.shape != la.shape:
        work = _TopkWork(n, la.shape[1])
    if la.dtype not in (np.float32, np.float64):
        la = la.astype(np.float64)
    w, pa, pb, d = (work.f(i, n) for i in range(1, 5))
    w[:] = mask
    with np.errstate(over="ignore", invalid="ignore"):
        np.exp(la, out=pa, dtype=np.float64)  # float64 from the stored values, no copy
        np.exp(y, out=pb)
        pa *= w
        pb *= w
        np.subtract(la, y, out=d, dtype=np.float64)
        ab = np.einsum("ij,ij->i", pa, d)
        ba = -np.einsum("ij,ij->i", pb, d)
    sa, sb = np.einsum("ij->i", pa), np.einsum("ij->i", pb)
    bad = np.flatnonzero(~(np.isfinite(ab) & np.isfinite(ba)))
    if len(bad):
        x = la[bad].astype(np.float64)
        ab[bad], ba[bad], sa[bad], sb[bad] = _guarded_sums(x, mask[bad], y[bad])
    rest_a = np.maximum(1.0 - sa, 0.0)
    rest_b = np.maximum(1.0 - sb, 0.0)
    return {
        "kl_topk_ab": ab + _bucket(rest_a, rest_b),
        "kl_topk_ba": ba + _bucket(rest_b, rest_a),
        "topk_overlap": np.einsum("ij->i", w) / k,
    }


def _guarded_sums(
    x: np.ndarray, mask: np.ndarray, y: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    with np.errstate(over="ignore", invalid="ignore"):
        pa, pb = np.exp(x), np.exp(y)
        d = x - y
        ab = np.where(mask & (pa > 0), pa * d, 0.0).sum(axis=1)
        ba = np.where(mask & (pb > 0), -pb * d, 0.0).sum(axis=1)
    return ab, ba, np.where(mask, pa, 0.0).sum(axis=1), np.where(mask, pb, 0.0).sum(axis=1)


def _bucket(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``p log(p / q)`` with ``0 log 0 = 0`` and ``inf`` where ``p > 0 = q``."""
    v = np.zeros(np.shape(p))
    some = np.flatnonzero(p > 0)  # log(0) is a slow path: taken only where it counts
    if len(some):
        ps, qs = p[some], q[some]
        with np.errstate(divide="ignore", invalid="ignore"):
            v[some] = ps * (np.log(ps) - np.log(qs))
    return v


# -- per sequence and overall ----------------------------------------------------------


def per_sequence(s: Sums) -> dict[str, np.ndarray | None]:
    """The per-sequence columns of one block (means over the finite tokens)."""
    nf = s.n_finite.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = {k: np.where(nf > 0, v / nf, np.nan) for k, v in s.sums.items()}
        r = s.cxy / np.sqrt(s.m2x * s.m2y)
    cols = {
        "n_tokens": s.n,
        "n_diff": s.n_diff,
        "mean_abs_dlogprob": mean["abs_d"],
        "max_abs_dlogprob": np.where(np.isfinite(s.max_abs), s.max_abs, np.nan),
        "worst_position": s.worst,
        "k1": mean["k1"],
        "k2": mean["k2"],
        "k3": mean["k3"],
        "chi2": mean["chi2"],
        "mean_abs_dp": mean["abs_dp"],
        "pearson_r": np.where((s.m2x > 0) & (s.m2y > 0), r, np.nan),
        "frac_over_ln2": mean["over"],
        "max_ulp": s.max_ulp,
        "n_nonfinite": s.n_nonfinite,
    }
    for k, v in s.extra.items():
        with np.errstate(invalid="ignore", divide="ignore"):
            cols[k] = np.where(s.extra_n[k] > 0, v / s.extra_n[k], np.nan)
    for k, v in s.extra_max.items():
        cols[f"max_{k}"] = v
    return cols


def combine(blocks: list[Sums]) -> dict[str, Any]:
    """The overall figures of every block together (means over all finite tokens; the
    Pearson r of all tokens from the per-sequence moments, combined exactly)."""
    cat = {
        f: np.concatenate([getattr(b, f) for b in blocks]) if blocks else np.zeros(0)
        for f in ("n", "n_finite", "n_diff", "n_nonfinite", "mean_x", "mean_y", "m2x", "m2y", "cxy")
    }
    nf = cat["n_finite"].astype(np.float64)
    total = float(nf.sum())
    sums = {k: float(sum(b.sums[k].sum() for b in blocks)) for k in _SUMS}

    def mean(v: float) -> float | None:
        return v / total if total else None

    out: dict[str, Any] = {
        "n_tokens": int(cat["n"].sum()),
        "n_diff": int(cat["n_diff"].sum()),
        "n_nonfinite": int(cat["n_nonfinite"].sum()),
        "mean_abs_dlogprob": mean(sums["abs_d"]),
        "max_abs_dlogprob": _max_of([b.max_abs for b in blocks]),
        "k1": mean(sums["k1"]),
        "k2": mean(sums["k2"]),
        "k3": mean(sums["k3"]),
        "chi2": mean(sums["chi2"]),
        "mean_abs_dp": mean(sums["abs_dp"]),
        "pearson_r": _pooled_r(cat, nf, total),
        "frac_over_ln2": mean(sums["over"]),
        "max_ulp": _max_ulp(blocks),
    }
    for k in blocks[0].extra if blocks else ():
        n = float(sum(b.extra_n[k].sum() for b in blocks))
        out[k] = float(sum(b.extra[k].sum() for b in blocks)) / n if n else None
    for k in blocks[0].extra_max if blocks else ():
        out[f"max_{k}"] = _max_of([b.extra_max[k] for b in blocks])
    return out


def _max_of(parts: list[np.ndarray]) -> float | None:
    vals = np.concatenate(parts) if parts else np.zeros(0)
    vals = vals[~np.isnan(vals) & (vals > -np.inf)]
    return float(vals.max()) if len(vals) else None


def _max_ulp(blocks: list[Sums]) -> int | None:
    maxima = [b.max_ulp for b in blocks]
    if not maxima or any(m is None for m in maxima):
        return None
    return int(max((int(m.max()) if m is not None and len(m) else 0) for m in maxima))


def _pooled_r(cat: dict[str, np.ndarray], nf: np.ndarray, total: float) -> float | None:
    if not total:
        return None
    gx = float((nf * cat["mean_x"]).sum() / total)
    gy = float((nf * cat["mean_y"]).sum() / total)
    dx, dy = cat["mean_x"] - gx, cat["mean_y"] - gy
    sxx = float(cat["m2x"].sum() + (nf * dx * dx).sum())
    syy = float(cat["m2y"].sum() + (nf * dy * dy).sum())
    sxy = float(cat["cxy"].sum() + (nf * dx * dy).sum())
    if sxx <= 0 or syy <= 0:
        return None
    return sxy / math.sqrt(sxx * syy)
