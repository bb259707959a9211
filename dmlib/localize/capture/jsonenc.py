"""A capture's boundaries and row map as ``json.dumps(obj, separators=(",", ":"))`` writes
them, at orjson's speed.

A capture's manifest is hundreds of small dicts of hex digests, where the json module's
encoder spends its time building string fragments (6-10 ms for the 243 boundaries of a
tiny Llama's ops capture). orjson writes them in 0.18 ms, as fast as the C writer dmlib
carried for them before (0.17 ms; 0.09 against 0.11 ms on a hidden-512 capture's 132
boundaries; ``benchmarks/bench_capture_json.py``), so that writer is gone.

For data without floats (what a capture's boundaries and row maps hold: ``str``, ``int``,
``bool``, None, lists, tuples and dicts with ``str`` keys) orjson's text is the json
module's wherever it is ASCII without DEL (tests/test_kernels_jsonenc.py). Anything else comes back
as None and the caller's json encoder writes it: text with a character past ASCII or DEL
(the json module escapes them: the manifest stays byte for byte what it was), an int past 64
bits, a key that is no ``str``, nesting past orjson's limit. Floats are the caller's to
keep out: orjson writes ``1e-05`` as ``1e-5`` and NaN as null (the manifest's metadata and
op arguments, which may hold them, go to the json module). ``DMLIB_KERNELS=numpy`` (the
switch of the compiled paths) and a missing orjson take the json module's path.
"""

from __future__ import annotations

from typing import Any

from dmlib.localize.capture import treehash

try:
    import orjson
except ImportError:  # pragma: no cover - a dependency; the json module writes without it
    orjson = None  # type: ignore[assignment]

_DUMPS = None if orjson is None else orjson.dumps
_ERROR: type[Exception] = TypeError if orjson is None else orjson.JSONEncodeError


def _as_json_module(raw: bytes) -> bool:
    """Whether orjson's bytes are the json module's text: ASCII, and no DEL (0x7f), which
    the json module escapes as ``\\u007f``."""
    return raw.isascii() and b"\x7f" not in raw


def compact(obj: Any) -> str | None:
    """``json.dumps(obj, separators=(",", ":"))`` of float-free data, or None where the
    json module must write it (see the module's docstring).

    Examples
    --------
    >>> compact({"a": [1, None, "x"]}) in ('{"a":[1,null,"x"]}', None)
    True
    """
    if _DUMPS is None or not treehash.USE_COMPILED:
        return None
    try:
        raw: bytes = _DUMPS(obj)
    except _ERROR:
        return None
    return raw.decode() if _as_json_module(raw) else None


def compact_lines(items: list[Any]) -> str | None:
    r"""``",\n".join(compact(x) for x in items)`` in one pass, or None where one item is
    not for orjson (see the module's docstring).

    Examples
    --------
    >>> compact_lines([{"a": 1}, [2]]) in ('{"a":1},\n[2]', None)
    True
    """
    if _DUMPS is None or not treehash.USE_COMPILED or type(items) is not list:
        return None
    try:
        raw = b",\n".join(map(_DUMPS, items))
    except _ERROR:
        return None
    return raw.decode() if _as_json_module(raw) else None


__all__ = ["compact", "compact_lines"]
