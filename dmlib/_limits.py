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
"""

from __future__ import annotations

import functools
import os

from dmlib.errors import DmlibError

__all__ = [
    "DEFLATE_MAX_RATIO",
    "MAX_RATIO",
    "MAX_TREE_NODE",
    "allowed_output",
    "human",
    "limit_hint",
    "max_decompressed",
    "max_ratio",
    "memory_bytes",
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
