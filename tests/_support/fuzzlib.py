"""What every fuzz test checks, and the tools to build broken files.

The one property: opening a (possibly broken) file either reads it correctly (every
tensor loads, its bytes lie inside the file and equal what the file declares) or raises
a ``DmlibError`` whose one-line message names the file. Any other exception, a hang
(``ALARM_S``) or a read past the end fails the test.

Files are parsed here independently of dmlib (``cbor2``, ``json``, ``struct``) so the
expected contents do not come from the reader under test.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import struct
import tracemalloc
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cbor2
import ml_dtypes
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

import dmlib
from dmlib.errors import DmlibError
from dmlib.inspect_ import describe

PROFILE = os.environ.get("DMLIB_FUZZ_PROFILE", "fast")
if PROFILE not in ("fast", "long"):
    raise ValueError(f"DMLIB_FUZZ_PROFILE must be 'fast' or 'long', not {PROFILE!r}")

ALARM_S = 20  # one open + load of a small file takes milliseconds; this long is a hang
COUNTS: dict[str, dict[str, int]] = defaultdict(lambda: {"read": 0, "refused": 0})
LAST_ERROR: list[DmlibError] = []  # the refusal of the latest read_or_refuse call


def fuzz() -> settings:
    """The settings of the selected profile (registered in ``conftest.py``)."""
    return settings(settings.get_profile(f"dmlib-{PROFILE}"))


class Hang(Exception):
    pass


@contextlib.contextmanager
def no_hang(seconds: int = ALARM_S) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"reader still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def small_memory(limit_bytes: int = 32 << 20) -> Iterator[None]:
    """Fail if Python/numpy allocations (tracemalloc) or the RSS high-water mark grow by more than ``limit_bytes``."""
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert peak < limit_bytes, f"traced allocations peaked at {peak} bytes"
    assert rss1 - rss0 < limit_bytes, f"RSS high-water mark grew by {rss1 - rss0} bytes"


def read_or_refuse(
    path: Path, target: str, *, format: str | None = None
) -> dict[str, tuple[bytes, int | None]] | None:
    """Open and fully read ``path``: {name: (raw bytes, offset)} or None when dmlib refused it.

    Asserts the property; anything but a correct read or a ``DmlibError`` naming the file
    propagates and fails the test.
    """
    size = os.path.getsize(path)
    out: dict[str, tuple[bytes, int | None]] = {}
    try:
        with no_hang(), dmlib.open_tensors(path, format=format) as ts:
            for name, t in ts.items():
                raw = t.raw()
                assert raw.nbytes == t.nbytes, (
                    f"{name}: {raw.nbytes} bytes read, {t.nbytes} declared"
                )
                if t.offset is not None:
                    assert 0 <= t.offset and t.offset + t.nbytes <= size, (
                        f"{name} lies outside the file"
                    )
                arr = t.load()
                if not t.quantized:
                    assert arr.shape == t.shape and arr.dtype == t.dtype
                out[name] = (raw.tobytes(), t.offset)
            if ts.format == "burnpack":
                census = dmlib.padding_census(ts)
                for g in census.gaps.itertuples():
                    assert 0 <= g.start <= g.end <= size
        # what `dmlib inspect` shows must be computable for every file that reads
        with no_hang():
            json.dumps(describe(str(path), format=format), default=str)
    except DmlibError as err:
        LAST_ERROR[:] = [err]
        msg = str(err)
        assert str(path) in msg, f"message does not name the file: {msg}"
        assert "\n" not in msg, f"message is not one line: {msg!r}"
        COUNTS[target]["refused"] += 1
        return None
    COUNTS[target]["read"] += 1
    return out


# ----------------------------------------------------------------------------- generated tensors

DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U32": np.dtype("<u4"),
    "U8": np.dtype("u1"),
}
NAMES = st.text(alphabet="abcxyz._/0éλ", min_size=1, max_size=8)


@st.composite
def tensor_dicts(
    draw: Any, min_size: int = 1, max_size: int = 5, dtypes: dict[str, np.dtype] = DTYPES
) -> dict[str, np.ndarray]:
    """Ordered name -> array with random shapes (zero-size included) and random bytes (NaNs included)."""
    names = draw(st.lists(NAMES, min_size=min_size, max_size=max_size, unique=True))
    out = {}
    for name in names:
        dt = dtypes[draw(st.sampled_from(sorted(dtypes)))]
        shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        out[name] = np.frombuffer(draw(st.binary(min_size=n, max_size=n)), dtype=dt).reshape(shape)
    return out


# ----------------------------------------------------------------------------- burnpack, parsed independently

BPK_HEADER = 10


def align(n: int) -> int:
    return -(-n // 256) * 256


def bpk_split(data: bytes, layout: str = "aligned") -> tuple[int, dict[str, Any], int]:
    """(metadata_size, CBOR metadata, data base D) of a one-record burnpack image."""
    assert data[:4] == b"NRUB"
    (msize,) = struct.unpack("<I", data[6:10])
    meta = cbor2.loads(data[BPK_HEADER : BPK_HEADER + msize])
    base = align(BPK_HEADER + msize) if layout == "aligned" else BPK_HEADER + msize
    return msize, meta, base


def cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | info]) + n.to_bytes(width, "big")
    raise ValueError(n)


def bpk_build(
    meta_blob: bytes, data_section: bytes, *, version: int = 1, base: int | None = None
) -> bytes:
    """A burnpack image: header, ``meta_blob`` (raw CBOR), zero padding to ``base`` (default aligned), data."""
    head = b"NRUB" + struct.pack("<HI", version, len(meta_blob)) + meta_blob
    base = align(len(head)) if base is None else base
    return head + bytes(base - len(head)) + data_section


def bpk_tensor_bytes(data: bytes, layout: str = "aligned") -> dict[str, tuple[int, int]]:
    """name -> absolute (start, end) of each tensor of a one-record image."""
    _, meta, base = bpk_split(data, layout)
    return {
        n: (base + d["data_offsets"][0], base + d["data_offsets"][1])
        for n, d in meta["tensors"].items()
    }


# ----------------------------------------------------------------------------- safetensors, parsed independently


def st_split(data: bytes) -> tuple[dict[str, Any], int]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), 8 + n


def st_build(header_json: bytes, data_section: bytes) -> bytes:
    return struct.pack("<Q", len(header_json)) + header_json + data_section


def st_tensor_bytes(data: bytes) -> dict[str, tuple[int, int]]:
    header, base = st_split(data)
    return {
        n: (base + d["data_offsets"][0], base + d["data_offsets"][1])
        for n, d in header.items()
        if n != "__metadata__"
    }


def check_untouched(
    result: dict[str, tuple[bytes, int | None]],
    original: bytes,
    spans: dict[str, tuple[int, int]],
    touched: set[int],
) -> None:
    """Every tensor of the original file that the mutation left alone reads back as its original bytes."""
    for name, (s, e) in spans.items():
        if name in result and not any(s <= p < e for p in touched):
            got, off = result[name]
            if off == s:
                assert got == original[s:e], f"{name}: bytes differ from the original"
            else:
                # the reader placed it elsewhere: only acceptable if the header said so,
                # which a mutation outside the header cannot do
                raise AssertionError(f"{name}: read at byte {off}, the file declares {s}")
