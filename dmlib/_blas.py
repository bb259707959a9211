"""One BLAS thread for the few float64 products and norms whose bits a result quotes.

A multi-threaded BLAS splits a matrix product (and a long dot product) differently with
the number of threads, and the last bits of the result move with it: measured here,
the rel_fro of an effective weight ``U diag(s) V^T`` of ``data/qr_init`` changed in its
13th digit between 2 BLAS threads and 1. A Dask worker runs with one BLAS thread
(Dask's default), a user's machine with as many as it has cores; so every such product
runs on one thread, here and on a worker, and gives the same bits on the same kind of CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

_controller: Any = None


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Limit the loaded BLAS libraries to one thread inside the block."""
    global _controller
    if _controller is None:  # inspecting the loaded libraries costs milliseconds: once
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    with _controller.limit(limits=1, user_api="blas"):
        yield
