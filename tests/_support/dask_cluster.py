"""One local Dask cluster for the engine tests, patient with a busy 2-core machine.

A worker process imports numpy and dmlib before it registers; with the suite's other work
on the same cores that took more than distributed's 30 s connect timeout once, and a
killed worker's replacement more than the 60 s the test used to wait.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# seconds a worker (or its replacement after a kill) may take to start
DASK_START_S = 300


@contextmanager
def local_client(n_workers: int = 2) -> Iterator[Any]:
    """A ``distributed.Client`` on a LocalCluster of ``n_workers`` one-thread processes."""
    import dask
    import distributed

    timeouts = {
        "distributed.comm.timeouts.connect": f"{DASK_START_S}s",
        "distributed.comm.timeouts.tcp": f"{DASK_START_S}s",
    }
    with dask.config.set(timeouts):
        cluster = distributed.LocalCluster(
            n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=":0"
        )
        client = distributed.Client(cluster, timeout=f"{DASK_START_S}s")
        try:
            client.wait_for_workers(n_workers, timeout=DASK_START_S)
            yield client
        finally:
            client.close()
            cluster.close()
