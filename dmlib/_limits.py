"""How much work one input may ask for: the limits every reader checks, in one place.

A checkpoint from a stranger can declare more than it holds: a compressed member that
inflates a thousandfold, a header naming a 4 TiB tensor. Readers compare what a file
asks for with these limits *before* allocating or decompressing, and refuse with one
line (exit 2) naming the file, the number it declared and the limit.

The sizes scale with this machine's memory (``/proc/meminfo``, a cgroup limit where one
is set, else ``os.sysconf``), so a large machine reads large compressed records and a
small one refuses what would exhaust it:

- :func:`max_decompressed`: the most bytes one decompressed piece (an ``.npz`` member,
  a ``.mpk.gz`` record) may take: a quarter of memory (a comparison holds two sides).
- :func:`allowed_output`: what ``n`` compressed bytes may inflate to: ``MAX_RATIO``
  times ``n``, but never less than :func:`ratio_floor` (1/64 of memory, so small
  files of zeros are always read) nor more than :func:`max_decompressed`.

Two environment variables lift them for a file the user trusts: ``DMLIB_MAX_DECOMPRESSED``
(bytes; suffixes K, M, G, T for powers of 1024) and ``DMLIB_MAX_RATIO``.

Names and counts are bounded too, since a small file can ask for them through shared
references (a pickle's memo) or long keys repeated at every level:

- :data:`MAX_NAME_CHARS`: the longest name a reader makes by joining keys with ``.``
  (a real tensor name is tens of characters);
- :func:`max_entries`: the most leaves (tensors and plain values) one file may flatten
  to, and :func:`max_containers` the most containers (empty ones included) the walk that
  flattens it may visit, both counted after shared references are expanded: memory / 8 KiB
  each (``DMLIB_MAX_ENTRIES`` lifts both);
- :func:`max_name_chars_total`: the characters of all flattened names together, 1/64 of
  memory;
- :data:`MAX_JSON_KEYS`: the most keys of one JSON object (:func:`json_pairs_hook`);
- :data:`MAX_NESTING`: how deep a document's containers may nest: a TOML file's arrays
  and tables, a JSON file's lists and objects, a msgpack file's maps and arrays
  (:func:`nesting_depth`; :func:`dmlib.safepaths.bounded_json`).

:class:`Flattening` applies the name and count limits while a reader joins keys.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

from dmlib.errors import DmlibError, FormatError
from dmlib.textsafe import escape

__all__ = [
    "DEFLATE_MAX_RATIO",
    "MAX_INT_BITS",
    "MAX_JSON_KEYS",
    "MAX_NAME_CHARS",
    "MAX_NESTING",
    "MAX_RATIO",
    "MAX_TEXT_BYTES",
    "MAX_TREE_NODE",
    "Flattening",
    "allowed_output",
    "human",
    "json_pairs_hook",
    "limit_hint",
    "max_containers",
    "max_decompressed",
    "max_entries",
    "max_name_chars_total",
    "max_ratio",
    "memory_bytes",
    "nesting_depth",
    "ratio_floor",
]

#: Default ceiling on (decompressed bytes) / (compressed bytes) above the floor. Weights
#: compress about 1.1x; only long runs of one value (zeros) come near deflate's maximum.
MAX_RATIO = 200

#: Deflate cannot inflate one byte to more than about 1032 (RFC 1951: a 258-byte match
#: per 2-bit code at best): more than that from one archive means members that overlap.
DEFLATE_MAX_RATIO = 1032

#: The most bytes one decoded OCDBT B+tree node may take, whatever the database's manifest
#: declares (tensorstore's default ``max_decoded_node_bytes`` is 8 MiB; a node is parsed
#: into Python objects, so its bound is fixed here rather than scaled with memory).
MAX_TREE_NODE = 64 << 20

#: The longest flattened name (keys joined with ``.``), in characters.
MAX_NAME_CHARS = 4096

#: The most keys one JSON object may hold. The largest objects real checkpoints carry are a
#: sharded model's ``weight_map`` (about 92,000 names for the largest public models); a
#: Trainer log entry holds tens.
MAX_JSON_KEYS = 100_000

#: How deep one document may nest its containers: a TOML file's arrays and tables (a study,
#: a mapping file), a JSON file's lists and objects (a capture manifest, Orbax and zarr
#: metadata, a Trainer state, a config), a flax msgpack file's maps and arrays. One limit
#: for all (a capture manifest dmlib writes nests at most 6).
MAX_NESTING = 64

#: The most bits of an integer a file may hold as a plain value (a step, an RNG word):
#: Python refuses to print an integer of more than 4300 digits (about 14,000 bits).
MAX_INT_BITS = 4096

#: The largest JSON or TOML text file of an input read whole (a ``trainer_state.json``, a
#: mapping file): parsed into Python objects it takes ten to twenty times its size. The
#: longest real Trainer states (a log entry every step of a long run) are a few MiB.
MAX_TEXT_BYTES = 64 << 20

_FALLBACK_MEMORY = 8 << 30
_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _meminfo_total() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_limit() -> int | None:
    for p in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(p, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge value: no limit
            return int(text)
    return None


def _sysconf_total() -> int | None:
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


@functools.lru_cache(maxsize=1)
def memory_bytes() -> int:
    """This machine's memory as a process may use it (the smaller of RAM and a cgroup limit)."""
    found = [m for m in (_meminfo_total(), _sysconf_total(), _cgroup_limit()) if m]
    return min(found) if found else _FALLBACK_MEMORY


def _env_number(name: str) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    mult = _SUFFIX.get(text[-1].upper(), 1)
    digits = text[:-1] if text[-1].upper() in _SUFFIX else text
    if not digits.isdigit() or int(digits) == 0:
        raise DmlibError(f"{name}={text!r} is not a positive whole number (K, M, G, T allowed)")
    return int(digits) * mult


def max_decompressed() -> int:
    """The most bytes one decompressed piece of an input may take (``DMLIB_MAX_DECOMPRESSED``)."""
    return _env_number("DMLIB_MAX_DECOMPRESSED") or memory_bytes() // 4


def max_ratio() -> int:
    """The compression ratio allowed above the floor (``DMLIB_MAX_RATIO``, default 200)."""
    return _env_number("DMLIB_MAX_RATIO") or MAX_RATIO


def ratio_floor() -> int:
    """Output below which no ratio is enforced: 1/64 of memory, at most :func:`max_decompressed`."""
    return min(memory_bytes() // 64, max_decompressed())


def allowed_output(compressed: int) -> int:
    """How many bytes ``compressed`` compressed bytes may decompress to."""
    return min(max_decompressed(), max(ratio_floor(), max_ratio() * max(compressed, 0)))


def max_entries() -> int:
    """The most leaves one file may flatten to: memory / 8 KiB, at least 100,000 (``DMLIB_MAX_ENTRIES``).

    Each flattened entry costs a few hundred bytes of names and tables; the bound keeps a
    file's names and tables within a small part of memory however it shares its parts.
    """
    return _env_number("DMLIB_MAX_ENTRIES") or max(memory_bytes() // 8192, 100_000)


def max_containers() -> int:
    """The most containers (maps, lists, tuples; empty ones included) a flattening may visit."""
    return max_entries()


def max_name_chars_total() -> int:
    """The characters of one file's flattened names together: 1/64 of memory, at least 64 Mi."""
    return max(memory_bytes() // 64, 64 << 20)


def _key_text(key: Any) -> str | None:
    """``str(key)`` or None where that text would be longer than any name may be."""
    if type(key) is str:
        return key
    if isinstance(key, int) and key.bit_length() > 4 * MAX_NAME_CHARS:
        return None  # more digits than a name may have (and str() refuses past 4300)
    try:
        return str(key)
    except ValueError:  # an int inside a tuple key past Python's digit limit
        return None


class Flattening:
    """What one reader's flattening of one file has made so far, refused past the limits.

    ``name(parent, key)`` joins a key to its parent's name, refusing a name longer than
    :data:`MAX_NAME_CHARS` before the joined text is made; ``leaf(name)`` counts an entry
    and its characters; ``container()`` counts a container. Each refusal is a
    :class:`FormatError` naming the file and the limit.
    """

    __slots__ = ("path", "what", "entries", "containers", "chars", "_limits")

    def __init__(self, path: str | None, what: str = "the file") -> None:
        self.path, self.what = path, what
        self.entries = self.containers = self.chars = 0
        self._limits = (max_entries(), max_containers(), max_name_chars_total())

    def _refuse(self, text: str) -> FormatError:
        return FormatError(f"{self.what} {text}; refusing to read it", path=self.path)

    def name(self, parent: str | None, key: Any) -> str:
        """``parent.key`` (``key`` alone where ``parent`` is None: the top), refused if
        longer than MAX_NAME_CHARS before it is made."""
        text = _key_text(key)
        start = "" if parent is None else parent + "."
        if text is None:
            raise self._refuse(
                f"holds a key too long to be part of a name (its text would run past "
                f"{MAX_NAME_CHARS:,} characters) under '{escape(start[:60])}'"
            )
        size = len(start) + len(text)
        if size > MAX_NAME_CHARS:
            raise self._refuse(
                f"holds a name of {size:,} characters starting '{escape((start + text[:80])[:60])}…', "
                f"longer than the {MAX_NAME_CHARS:,} a name may have"
            )
        return text if parent is None else f"{parent}.{text}"

    def leaf(self, name: str) -> None:
        """Count one flattened entry named ``name`` (refused if longer than MAX_NAME_CHARS)."""
        if len(name) > MAX_NAME_CHARS:
            raise self._refuse(
                f"holds a name of {len(name):,} characters starting '{escape(name[:60])}…', "
                f"longer than the {MAX_NAME_CHARS:,} a name may have"
            )
        self.entries += 1
        self.chars += len(name)
        if self.entries > self._limits[0]:
            raise self._refuse(
                f"flattens to more than {self._limits[0]:,} entries, the most one file may "
                "hold on this machine (set DMLIB_MAX_ENTRIES to read a file you trust)"
            )
        if self.chars > self._limits[2]:
            raise self._refuse(
                f"holds names of more than {self._limits[2]:,} characters together, the "
                "most one file's names may take on this machine"
            )

    def container(self) -> None:
        """Count one container visited (empty ones too: the walk visits them all the same)."""
        self.containers += 1
        if self.containers > self._limits[1]:
            raise self._refuse(
                f"nests more than {self._limits[1]:,} containers, the most one file may hold "
                "on this machine (set DMLIB_MAX_ENTRIES to read a file you trust)"
            )


def json_pairs_hook(
    path: str | None, what: str
) -> Callable[[list[tuple[str, Any]]], dict[str, Any]]:
    """An ``object_pairs_hook`` for ``json.load`` refusing an object of more than MAX_JSON_KEYS keys."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        if len(pairs) > MAX_JSON_KEYS:
            raise FormatError(
                f"{what}: an object of {len(pairs):,} keys, more than the {MAX_JSON_KEYS:,} "
                "one object may hold",
                path=path,
            )
        return dict(pairs)

    return hook


def nesting_depth(doc: Any, limit: int = MAX_NESTING) -> int:
    """How deep ``doc``'s dicts and lists nest (a plain value: 0), walked without recursion;
    the walk stops as soon as ``limit`` is passed (the result is then ``limit + 1``)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            kids: Any = node.values()
        elif isinstance(node, list):
            kids = node
        else:
            continue
        depth += 1
        if depth > limit:
            return limit + 1
        deepest = max(deepest, depth)
        stack.extend((k, depth) for k in kids)
    return deepest


def human(n: int) -> str:
    """``n`` bytes as a short figure with its unit (``4.6 GiB``), for messages."""
    x = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{int(x)} bytes" if unit == "bytes" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} bytes"  # pragma: no cover (the loop always returns)


def limit_hint() -> str:
    """What to set to read a trusted file past the limits (appended to refusals)."""
    return "set DMLIB_MAX_DECOMPRESSED / DMLIB_MAX_RATIO to read a file you trust"
