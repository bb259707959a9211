"""``json.dumps(obj, separators=(",", ":"))`` of plain data, in one compiled call.

A capture's manifest is thousands of small dicts of hex digests; the json module's
encoder spends its time there building string fragments (about 130 MB/s measured on a
tiny Llama capture's boundaries). :func:`compact` writes the same text in
``dmlib/localize/capture/_capture.c`` for dicts with ``str`` keys, lists, tuples, ``str``, ``int``,
``float``, ``bool`` and None (each of exactly that type, nested at most 64 deep), and
returns None for anything else, where the caller's json encoder writes it. Off with
``DMLIB_KERNELS=numpy``, like the other compiled kernels.
"""

from __future__ import annotations

from typing import Any

from dmlib.localize.capture import treehash

_ENCODE = getattr(treehash._capture, "encode_json", None)
_LINES = getattr(treehash._capture, "encode_json_lines", None)


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


def compact_lines(items: list[Any]) -> str | None:
    r"""``",\n".join(compact(x) for x in items)`` in one compiled call, or None where an item
    is not plain data (or the compiled module is not there).

    A dict met again inside the items (the same object: a capture's boundaries share the
    digests of one tensor recorded under several names) is written once and its text
    copied: the same text as writing it anew, since nothing changes it during the call.

    Examples
    --------
    >>> compact_lines([{"a": 1}, [2]]) in ('{"a":1},\n[2]', None)
    True
    """
    if _LINES is None or not treehash.USE_COMPILED or type(items) is not list:
        return None
    out: str | None = _LINES(items)
    return out


__all__ = ["compact", "compact_lines"]
