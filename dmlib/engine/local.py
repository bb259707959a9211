"""The local engine: which tensors of many runs hold the same bytes, each tensor read about once.

:func:`group_contents` is the first step of a comparison of many runs (``dmlib.matrix``):
it sorts every tensor of every run into distinct contents, so that pairs of identical
contents are known without reading them again and full statistics are computed once per
distinct pair of contents. The step ladder uses it too.

Grouping, per tensor name, in run order: every tensor is compared byte by byte with the
first run's tensor of that name (the reference is walked once, chunk by chunk, each chunk
compared with every run still equal to it while it is in the CPU's cache; a run is dropped
at its first differing chunk, usually the first). The runs that differ are compared the
same way with the first of them, and so on for up to :data:`_BYTE_REFS` references; what
is left after that is hashed and grouped by digest (cryptographic: equal digests are taken
for equal bytes). So a study whose runs are mostly bit-identical, with a control or two,
compares bytes at memory speed and hashes nothing, and many distinct contents cost one
hash each. A hash of each
distinct content (not of each tensor) is computed when the caller wants hashes reported.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from dmlib import hashing
from dmlib.kernels import stream as K
from dmlib.tensor import Tensor


class Content:
    """One distinct content: tensors of one name whose bytes (and layout) are equal.

    ``key`` is unique in this process (every grouping draws from one counter); ``digest`` has ``result()``
    (the ``"<scheme>:<hex>"`` of the bytes) when hashes were asked for, else None.
    """

    __slots__ = ("key", "digest")

    def __init__(self, digest: Any = None) -> None:
        self.key = next(_KEYS)  # itertools.count: atomic in CPython, so safe across threads
        self.digest = digest


_KEYS = itertools.count()


def _done(value: str) -> Future[str]:
    f: Future[str] = Future()
    f.set_result(value)
    return f


def layout_key(t: Tensor) -> tuple:
    """What two tensors must share for equal bytes to mean equal tensors."""
    return (t.name, t.dtype.str, tuple(t.shape), t.nbytes, t.quantized, t.dtype_name, t.packing)


def equal_to_first(
    first: Tensor, others: list[Tensor], chunk_bytes: int, rel: K.PageReleaser
) -> list[bool]:
    """Which of ``others`` hold the same bytes as ``first`` (same layout assumed).

    Walked chunk by chunk, every candidate still equal compared with ``first``'s chunk
    while that chunk is in the CPU's cache: ``first`` is read once whatever the number
    of runs, and a candidate is dropped (not read further) at its first differing chunk.
    """
    from dmlib.kernels.pair import same_bytes

    equal = [t.nbytes == first.nbytes for t in others]
    raw0 = first.raw().view(np.ndarray)
    root0 = K.PageReleaser.root(raw0)
    raws = [t.raw().view(np.ndarray) for t in others]
    roots = [K.PageReleaser.root(r) if e else None for r, e in zip(raws, equal, strict=True)]
    for off in range(0, first.nbytes, chunk_bytes):
        if not any(equal):
            break
        if off:  # raw() checked the files before the first chunk; a shrunk map is not touched
            _check([first, *others])  # a stat per chunk (see kernels.pair._chunk_pairs)
        c0 = raw0[off : off + chunk_bytes]
        for i, r in enumerate(raws):
            if equal[i]:
                c = r[off : off + chunk_bytes]
                equal[i] = same_bytes(c0, c)
                rel.add(c, roots[i])
        rel.add(c0, root0)
    _check([first, *others])
    return equal


def _check(tensors: Iterable[Tensor], recent: bool = False) -> None:
    """Refuse ("changed while reading") if the file of any of ``tensors`` changed."""
    for t in tensors:
        t.check_unchanged(recent=recent)


#: Contents of one name told apart by comparing bytes before the rest are hashed: each
#: tensor is read at most this many times (a differing one only up to its first
#: differing chunk, usually the first), and a study with a control or two hashes nothing.
_BYTE_REFS = 3


def group_contents(
    tensors: Iterable[Tensor], chunk_bytes: int, hash_name: str | None, workers: int
) -> dict[int, Content]:
    """``id(tensor) -> Content`` for every tensor (see the module docstring).

    ``hash_name``: the scheme of the digests reported (None: none reported; differing
    tensors are then grouped by BLAKE3 digests that are not reported). Names are grouped
    side by side on ``workers`` threads.
    """
    by_name: dict[str, list[Tensor]] = {}
    for t in tensors:
        by_name.setdefault(t.name, []).append(t)
    scheme = hash_name or hashing.DEFAULT
    lock = threading.Lock()
    local = threading.local()
    releasers: list[K.PageReleaser] = []

    def one_name(ts: list[Tensor]) -> dict[int, Content]:
        rel = getattr(local, "rel", None)
        if rel is None:
            rel = local.rel = K.PageReleaser()
            with lock:
                releasers.append(rel)
        out: dict[int, Content] = {}
        # the same open tensor twice is one content
        todo = list({id(t): t for t in ts}.values())
        for _ in range(_BYTE_REFS):  # byte comparisons against a few references
            ref, todo = todo[0], todo[1:]
            out[id(ref)] = Content()
            cands = [t for t in todo if layout_key(t) == layout_key(ref)]
            for t, eq in zip(cands, equal_to_first(ref, cands, chunk_bytes, rel), strict=True):
                if eq:
                    out[id(t)] = out[id(ref)]
            todo = [t for t in todo if id(t) not in out]
            if not todo:
                break
        hashed: dict[tuple, Content] = {}  # (layout, digest) -> content, for the rest
        for t in todo:
            digest = K.hash_views([t.raw()], chunk_bytes, scheme)
            t.check_unchanged()
            key = (layout_key(t), digest)
            if key not in hashed:
                hashed[key] = Content(_done(digest) if hash_name else None)
            out[id(t)] = hashed[key]
        if hash_name is not None:  # each byte-compared content's digest, once
            for t in ts:
                if out[id(t)].digest is None:
                    out[id(t)].digest = _done(K.hash_views([t.raw()], chunk_bytes, hash_name))
                    t.check_unchanged()
        return out

    groups = list(by_name.values())
    result: dict[int, Content] = {}
    n = max(1, min(workers, len(groups)))
    pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="dmlib-group") if n > 1 else None
    try:
        for part in map(one_name, groups) if pool is None else pool.map(one_name, groups):
            result.update(part)
    finally:
        if pool is not None:  # on an error or Ctrl-C, names not yet started are dropped
            pool.shutdown(wait=True, cancel_futures=True)
        for rel in releasers:
            rel.flush()
    return result
