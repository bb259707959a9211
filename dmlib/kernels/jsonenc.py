"""``json.dumps(obj, separators=(",", ":"))`` of plain data, in one compiled call.

A capture's manifest is thousands of small dicts of hex digests; the json module's
encoder spends its time there building string fragments (about 130 MB/s measured on a
tiny Llama capture's boundaries). :func:`compact` writes the same text in
``dmlib/kernels/_fused.c`` for dicts with ``str`` keys, lists, tuples, ``str``, ``int``,
``float``, ``bool`` and None (each of exactly that type, nested at most 64 deep), and
returns None for anything else, where the caller's json encoder writes it. Off with
``DMLIB_KERNELS=numpy``, like the other compiled kernels.
"""

from __future__ import annotations

from typing import Any

from dmlib.kernels import treehash

_ENCODE = getattr(treehash._fused, "encode_json", None)


def compact(obj: Any) -> str | None:
    """``json.dumps(obj, separators=(",", ":"))``, or None where ``obj`` is not plain data
    (or the compiled module is not there).

    Examples
    --------
    >>> compact({"a": [1, 2.5, None, "é"]}) in ('{"a":[1,2.5,null,"\\\\u00e9"]}', None)
    True
    """
    if _ENCODE is None or not treehash.USE_COMPILED:
        return None
    out: str | None = _ENCODE(obj)
    return out


__all__ = ["compact"]
