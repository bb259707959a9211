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


# -- pickles and torch files written opcode by opcode (pickletools' opcode table) ----------------
#
# Each pickle below is built by hand so that what it shares through the memo is exactly what the
# test says: one key stored once and referred to at every level, one list referred to twice at
# every level. The torch zip around it is written with zipfile (stored members, as torch.save).


def p_str(s: str) -> bytes:
    """BINUNICODE: a 4-byte length, then the UTF-8 bytes."""
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def p_int(n: int) -> bytes:
    """BININT1 / BININT for small ints, LONG1 / LONG4 (little-endian two's complement) otherwise."""
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if -(1 << 31) <= n < 1 << 31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    if len(raw) < 256:
        return b"\x8a" + bytes([len(raw)]) + raw
    return b"\x8b" + struct.pack("<i", len(raw)) + raw


def p_put(i: int) -> bytes:
    return b"r" + struct.pack("<I", i)  # LONG_BINPUT


def p_get(i: int) -> bytes:
    return b"j" + struct.pack("<I", i)  # LONG_BINGET


def p_global(module: str, name: str) -> bytes:
    return b"c" + f"{module}\n{name}\n".encode()


PROTO2 = b"\x80\x02"
STOP = b"."


def torch_zip(path: Path, pickle_bytes: bytes, storages: dict[str, bytes] | None = None) -> None:
    """A torch.save-shaped zip: ``archive/data.pkl``, ``byteorder``, ``version``, ``data/<key>``."""
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", pickle_bytes)
        z.writestr("archive/byteorder", b"little")
        z.writestr("archive/version", b"3\n")
        for key, data in (storages or {}).items():
            z.writestr(f"archive/data/{key}", data)


def pickle_long_key_nest(key_len: int, levels: int, leaves: int) -> bytes:
    """``{K: {K: ... {K: {"a0": 0, ..., "aN": 0}}}}``: one ``key_len``-character key K stored
    once (memo 0) and used at ``levels`` levels; the innermost map holds ``leaves`` small ints.
    Flattened, every leaf's name repeats K ``levels`` times."""
    out = bytearray(PROTO2 + b"}")  # EMPTY_DICT: the root
    out += p_str("k" * key_len) + p_put(0) + b"}"
    for _ in range(levels - 1):
        out += p_get(0) + b"}"
    out += b"("  # MARK: the innermost map's items
    for i in range(leaves):
        out += p_str(f"a{i}") + p_int(0)
    out += b"u"  # SETITEMS
    out += b"s" * levels  # SETITEM closes each level into its parent
    return bytes(out + STOP)


def pickle_empty_doubling(levels: int) -> bytes:
    """``{"x": x_n}`` with ``x_0 = []`` and ``x_{i+1} = [x_i, x_i]``: no leaf at all, yet the
    flattened walk visits 2**(n+1) - 1 lists. A few bytes per level (memo reuse)."""
    out = bytearray(PROTO2 + b"]" + p_put(0) + b"0")  # EMPTY_LIST, memo 0, POP
    for i in range(levels):
        out += b"](" + p_get(i) + p_get(i) + b"e" + p_put(i + 1) + b"0"  # [x_i, x_i]
    out += b"}" + p_str("x") + p_get(levels) + b"s"
    return bytes(out + STOP)


def pickle_shared_leaves(n: int, refs: int) -> bytes:
    """``{"x": [L] * refs}``, ``L`` a list of ``n`` Nones stored once: ``n * refs`` leaves from
    ``n + refs`` stored items (one byte per None)."""
    out = bytearray(PROTO2 + b"](" + b"N" * n + b"e" + p_put(0) + b"0")
    out += b"}" + p_str("x") + b"](" + p_get(0) * refs + b"es"
    return bytes(out + STOP)


def pickle_tensor(size: tuple[int, ...], stride: tuple[int, ...], offset: int = 0,
                  numel: int = 1, dtype_storage: str = "FloatStorage") -> bytes:  # fmt: skip
    """``{"w": _rebuild_tensor_v2(storage "0" of ``numel`` elements, offset, size, stride)}``."""

    def tup(xs: tuple[int, ...]) -> bytes:
        return b"(" + b"".join(p_int(x) for x in xs) + b"t"

    pid = b"(" + p_str("storage") + p_global("torch", dtype_storage) + p_str("0")
    pid += p_str("cpu") + p_int(numel) + b"tQ"  # TUPLE, BINPERSID
    args = b"(" + pid + p_int(offset) + tup(size) + tup(stride) + b"\x89"  # NEWFALSE
    args += p_global("collections", "OrderedDict") + b")R" + b"t"  # OrderedDict(), TUPLE
    call = p_global("torch._utils", "_rebuild_tensor_v2") + args + b"R"
    return PROTO2 + b"}" + p_str("w") + call + b"s" + STOP


# -- flax msgpack ------------------------------------------------------------------------------


def flax_long_key_nest(key_len: int, levels: int, leaves: int) -> bytes:
    """A flax msgpack map nesting ``levels`` maps, each under its own ``key_len``-character key,
    the innermost holding ``leaves`` small ints: every leaf's name is ``levels * key_len`` long."""
    import msgpack

    out = bytearray()
    for i in range(levels):
        out += b"\x81" + msgpack.packb(chr(ord("a") + i % 26) * key_len)  # fixmap of one entry
    out += b"\xde" + struct.pack(">H", leaves)  # map 16
    for i in range(leaves):
        out += msgpack.packb(f"{i}") + b"\x00"
    return b"\x81" + msgpack.packb("params") + bytes(out)


# -- zips read two ways -----------------------------------------------------------------------


def zip_local_header(raw: bytes, name: str) -> int:
    """Where the local header of member ``name`` starts (read through zipfile's central directory)."""
    import zipfile

    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        return z.getinfo(name).header_offset


def torch_zip_duplicate_storage(path: Path, first: bytes, last: bytes) -> None:
    """A torch zip whose ``archive/data/0`` is there twice: ``first``, then ``last`` (float32 x n)."""
    import warnings
    import zipfile

    n = len(first) // 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate name it writes
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
            z.writestr("archive/data.pkl", pickle_tensor((n,), (1,), numel=n))
            z.writestr("archive/byteorder", b"little")
            z.writestr("archive/version", b"3\n")
            z.writestr("archive/data/0", first)
            z.writestr("archive/data/0", last)


def patched_local_header(raw: bytes, name: str, field: str, value: int) -> bytes:
    """``raw`` with one field of member ``name``'s local header set to ``value`` (APPNOTE 4.3.7):
    ``method`` (offset 8, 2 bytes), ``crc`` (14), ``csize`` (18), ``usize`` (22)."""
    at, width = {"method": (8, 2), "crc": (14, 4), "csize": (18, 4), "usize": (22, 4)}[field]
    h = zip_local_header(raw, name)
    out = bytearray(raw)
    out[h + at : h + at + width] = value.to_bytes(width, "little")
    return bytes(out)


def renamed_local_header(raw: bytes, name: str, new: str) -> bytes:
    """``raw`` with member ``name``'s local header naming ``new`` instead (same length)."""
    assert len(new) == len(name)
    h = zip_local_header(raw, name)
    out = bytearray(raw)
    out[h + 30 : h + 30 + len(name)] = new.encode()
    return bytes(out)


def two_archives(path: Path, storage: bytes) -> None:
    """A zip holding two torch archives, ``a/`` and ``b/``, each with its own ``data.pkl``."""
    import zipfile

    n = len(storage) // 4
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for prefix in ("a", "b"):
            z.writestr(f"{prefix}/data.pkl", pickle_tensor((n,), (1,), numel=n))
            z.writestr(f"{prefix}/byteorder", b"little")
            z.writestr(f"{prefix}/version", b"3\n")
            z.writestr(f"{prefix}/data/0", storage)
