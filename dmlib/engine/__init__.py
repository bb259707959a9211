"""Execution engines: where the per-tensor work of a comparison runs.

``local`` (the default) runs it on threads of this process. The work is split so that
another engine can run the same pieces elsewhere and combine them exactly: identity
hashes are defined over fixed pieces (:mod:`dmlib.hashing`), statistics are exact
counts and sums per chunk.
"""

from __future__ import annotations

ENGINES = ("local", "dask")


def check_engine(engine: str) -> str:
    """``engine`` when it is one dmlib runs; a DmlibError naming the choices otherwise."""
    from dmlib.errors import DmlibError

    if engine not in ENGINES:
        raise DmlibError(f"unknown engine {engine!r}: use one of {', '.join(ENGINES)}")
    return engine
