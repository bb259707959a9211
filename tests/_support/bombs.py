"""Decompression bombs built for the tests and benchmarks/bench_bombs.py, written fast.

A deflate stream of zeros is made of one compressed block of zeros repeated: after a
full flush a deflate compressor starts afresh (no history), so compressing the same chunk
again yields the same bytes (checked as the block is built). Gigabytes of declared zeros
cost a few megabytes and well under a second to write; the zip and gzip containers are
written here by hand (their layouts from APPNOTE.TXT and RFC 1952), so the file is exactly
what a hostile writer would produce, with honest sizes and CRCs unless asked otherwise.
"""

from __future__ import annotations

import functools
import io
import struct
import zlib
from pathlib import Path

import numpy as np

BLOCK = 1 << 20  # bytes of zeros per repeated deflate block


@functools.lru_cache(maxsize=1)
def _zero_block() -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    one = c.compress(bytes(BLOCK)) + c.flush(zlib.Z_FULL_FLUSH)
    two = c.compress(bytes(BLOCK)) + c.flush(zlib.Z_FULL_FLUSH)
    assert one == two, "deflate blocks of zeros differ after a full flush"
    return one


def _crc_zeros(prefix: bytes, n_blocks: int) -> int:
    crc = zlib.crc32(prefix)
    zeros = bytes(BLOCK)
    for _ in range(n_blocks):
        crc = zlib.crc32(zeros, crc)
    return crc


def deflate_zeros(prefix: bytes, n_blocks: int) -> tuple[bytes, int, int]:
    """(raw deflate stream, CRC-32, length) of ``prefix`` followed by ``n_blocks`` MiB of zeros."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = c.compress(prefix) + c.flush(zlib.Z_FULL_FLUSH)
    stream = head + _zero_block() * n_blocks + c.flush(zlib.Z_FINISH)
    return stream, _crc_zeros(prefix, n_blocks), len(prefix) + n_blocks * BLOCK


def npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        f, {"descr": dtype, "fortran_order": False, "shape": shape}
    )
    return f.getvalue()


def write_zip(path: Path, members: list[tuple[str, bytes, int, int]]) -> None:
    """A zip of deflated members ``(name, deflate stream, crc, uncompressed size)``."""
    out, central = bytearray(), bytearray()
    for name, data, crc, size in members:
        fname = name.encode()
        offset = len(out)
        out += struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0x21, crc, len(data), size, len(fname), 0
        )
        out += fname + data
        central += struct.pack(
            "<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0x21, crc, len(data), size,
            len(fname), 0, 0, 0, 0, 0, offset,
        )  # fmt: skip
        central += fname
    eocd = struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, len(members), len(members), len(central), len(out), 0
    )
    path.write_bytes(bytes(out + central + eocd))


def npz_zeros(path: Path, members: int, mib_each: int) -> int:
    """An npz of ``members`` float32 arrays of ``mib_each`` MiB of zeros; returns the bytes declared."""
    header = npy_header("<f4", (mib_each * BLOCK // 4,))
    data, crc, size = deflate_zeros(header, mib_each)
    write_zip(path, [(f"w{i}.npy", data, crc, size) for i in range(members)])
    return members * size


def mpk_record_prefix(nbytes: int) -> bytes:
    """A Burn record ``{"metadata": ..., "item": {"w": {"id", "param"}}}`` up to its tensor bytes,
    whose ``bin 32`` of ``nbytes`` follows (MessagePack spec: 0xc6, big-endian length)."""
    import msgpack

    p = msgpack.packb
    meta = {"float": "f32", "int": "i64", "format": "dmlib-test", "version": "0.14", "settings": ""}
    return (
        b"\x82" + p("metadata") + p(meta) + p("item") + b"\x81" + p("w") + b"\x82"
        + p("id") + p(1) + p("param") + b"\x83" + p("shape") + p([nbytes // 4])
        + p("dtype") + p("F32") + p("bytes") + b"\xc6" + struct.pack(">I", nbytes)
    )  # fmt: skip


def mpk_gz_zeros(path: Path, mib: int, isize: int | None = None) -> int:
    """A ``.mpk.gz`` whose one F32 tensor is ``mib`` MiB of zeros; returns the bytes it inflates to.

    ``isize``: the length the gzip trailer states (default: the true one, modulo 2**32).
    """
    prefix = mpk_record_prefix(mib * BLOCK)
    data, crc, size = deflate_zeros(prefix, mib)
    trailer = struct.pack("<II", crc, (size if isize is None else isize) & 0xFFFFFFFF)
    path.write_bytes(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + data + trailer)
    return size
