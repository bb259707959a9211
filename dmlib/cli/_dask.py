"""``--dask ADDRESS|local:N``: the engine of a command, shared by every heavy subcommand."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator


def add_dask(p: argparse.ArgumentParser) -> None:
    """``--dask ADDRESS|local:N``: run the command on a Dask cluster."""
    p.add_argument(
        "--dask",
        metavar="ADDRESS|local:N",
        help="run on Dask: the scheduler at ADDRESS, or local:N (a LocalCluster of N worker "
        "processes for this command); every worker must see the files at the same paths",
    )


@contextlib.contextmanager
def engine(args: argparse.Namespace) -> Iterator[str]:
    """``"local"``, or ``"dask"`` with a client to ``--dask`` active until the block ends."""
    if not getattr(args, "dask", None):
        yield "local"
        return
    from dmlib.engine.dask import client_for, close_client

    client = client_for(args.dask)
    try:
        yield "dask"
    finally:
        close_client(client)
