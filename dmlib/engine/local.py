"""The local engine: identity hashes of many tensors on a thread pool, each tensor once.

:func:`hash_tensors` is the first step of a comparison of many runs (``dmlib.matrix``):
hash every tensor of every run once, so that pairs of identical contents are known
without reading them again and full statistics are computed once per distinct pair.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from dmlib.stats import _kernels as K
from dmlib.tensor import Tensor


def hash_tensors(
    pool: ThreadPoolExecutor,
    tensors: Iterable[Tensor],
    chunk_bytes: int,
    hash_name: str,
    cache: dict[int, Future[str]],
) -> dict[int, Future[str]]:
    """Submit one hash per tensor not yet in ``cache`` (keyed by ``id(tensor)``); returns ``cache``."""
    for t in tensors:
        if id(t) not in cache:
            cache[id(t)] = pool.submit(K.hash_views, [t.raw()], chunk_bytes, hash_name)
    return cache
