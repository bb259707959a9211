"""Hostile Orbax checkpoints, built by hand for the bounds and confinement tests.

Each builder writes one small item folder (``_METADATA``, zarr metadata, chunks or an
OCDBT database) that declares far more than it holds, nests its JSON deeply, or leads out
of itself through a symlink. The layouts follow what orbax-checkpoint 0.12 writes (see
``../shared/fixtures/jax/README.md``) and the OCDBT encoding tensorstore documents
(manifest, B+tree node, data file table); nothing here is produced by dmlib.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

GIB = 1 << 30


def zstd_zeros(n: int, *, content_size: bool = True) -> bytes:
    """One zstd frame of ``n`` zero bytes, streamed (never ``n`` bytes in memory)."""
    import zstandard

    c = zstandard.ZstdCompressor(level=1, write_content_size=content_size)
    obj = c.compressobj(size=n if content_size else -1)
    block = bytes(16 << 20)
    out = []
    left = n
    while left:
        take = min(left, len(block))
        out.append(obj.compress(block[:take] if take < len(block) else block))
        left -= take
    out.append(obj.flush())
    return b"".join(out)


def gzip_zeros(n_mib: int) -> bytes:
    """One gzip member of ``n_mib`` MiB of zeros (deflate blocks repeated: about 1 KiB per MiB)."""
    from _support.bombs import deflate_zeros

    data, crc, size = deflate_zeros(b"", n_mib)
    trailer = struct.pack("<II", crc, size & 0xFFFFFFFF)
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + data + trailer


def metadata(names: list[str], **extra: Any) -> dict[str, Any]:
    """An Orbax ``_METADATA`` naming one np.ndarray leaf per name."""
    tree = {
        f"('{n}',)": {
            "key_metadata": [{"key": n, "key_type": 2}],
            "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False},
        }
        for n in names
    }
    return {"tree_metadata": tree, **extra}


def zarray(shape: list[int], chunks: list[int], dtype: str = "<f4", **extra: Any) -> dict:
    """A zarr v2 ``.zarray`` as Orbax writes it (zstd unless ``compressor`` is given)."""
    md = {
        "chunks": chunks, "compressor": {"id": "zstd", "level": 1}, "dimension_separator": ".",
        "dtype": dtype, "fill_value": None, "filters": None, "order": "C", "shape": shape,
        "zarr_format": 2,
    }  # fmt: skip
    md.update(extra)
    return md


def zarr_json(shape: list[int], chunks: list[int], codecs: list[Any], dtype: str = "float32"):
    """A zarr v3 ``zarr.json`` with a regular grid and the default chunk key encoding."""
    return {
        "zarr_format": 3, "node_type": "array", "shape": shape, "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
        "chunk_key_encoding": {"name": "default"}, "fill_value": 0, "codecs": codecs,
    }  # fmt: skip


BYTES = {"name": "bytes", "configuration": {"endian": "little"}}


def item(
    root: Path,
    arrays: dict[str, dict],
    chunks: dict[str, bytes] | None = None,
    *,
    md: dict | None = None,
) -> Path:
    """A no-OCDBT item folder: ``_METADATA``, each array's metadata file, chunk files."""
    root.mkdir(parents=True, exist_ok=True)
    meta = md if md is not None else metadata(sorted(arrays))
    (root / "_METADATA").write_text(json.dumps(meta))
    for name, m in arrays.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        fname = ".zarray" if m.get("zarr_format") == 2 else "zarr.json"
        (root / name / fname).write_text(json.dumps(m))
    for key, data in (chunks or {}).items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return root


# ----------------------------------------------------------------------------- the cases


def zarr2_zstd_bomb(root: Path, declared: int = 2 * GIB) -> Path:
    """A zstd chunk of ``declared`` zeros (about 64 KiB stored) for a float32 array that
    declares exactly that many bytes: the chunk is honest about its size."""
    n = declared // 4
    return item(root, {"w": zarray([n], [n])}, {"w/0": zstd_zeros(declared)})


def zarr3_zstd_bomb(root: Path, declared: int = 2 * GIB) -> Path:
    n = declared // 4
    codecs = [BYTES, {"name": "zstd", "configuration": {"level": 1, "checksum": False}}]
    return item(root, {"w": zarr_json([n], [n], codecs)}, {"w/c/0": zstd_zeros(declared)})


def zarr3_gzip_bomb(root: Path, declared: int = 2 * GIB) -> Path:
    n = declared // 4
    codecs = [BYTES, {"name": "gzip", "configuration": {"level": 1}}]
    return item(root, {"w": zarr_json([n], [n], codecs)}, {"w/c/0": gzip_zeros(declared >> 20)})


def absent_chunks(root: Path, declared: int = 2 * GIB, fill: Any = 1.5) -> Path:
    """No chunk stored, the writer's word that absent chunks hold the fill value."""
    n = declared // 4
    md = metadata(["w"], store_array_data_equal_to_fill_value=False)
    return item(root, {"w": zarray([n], [1 << 20], fill_value=fill)}, md=md)


def huge_grid(root: Path, shape: list[int], chunks: list[int]) -> Path:
    """A uint8 array whose chunk grid has ``prod(shape / chunks)`` chunks, one stored."""
    first = "w/" + ".".join("0" for _ in shape)
    md = metadata(["w"], store_array_data_equal_to_fill_value=False)
    raw = bytes(max(1, _prod(chunks)))
    return item(root, {"w": zarray(shape, chunks, "|u1", compressor=None)}, {first: raw}, md=md)


def deep_json(depth: int = 100_000) -> str:
    return '{"a": ' + "[" * depth + "]" * depth + "}"


def deep_metadata(root: Path) -> Path:
    """``_METADATA`` whose JSON nests lists ``100,000`` deep."""
    item(root, {"w": zarray([2], [2], compressor=None)}, {"w/0": bytes(8)})
    (root / "_METADATA").write_text(deep_json()[:-1] + ', "tree_metadata": {}}')
    return root


def deep_zarray(root: Path) -> Path:
    item(root, {"w": zarray([2], [2], compressor=None)}, {"w/0": bytes(8)})
    md = json.loads((root / "w/.zarray").read_text())
    text = json.dumps(md)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (root / "w/.zarray").write_text(text)
    return root


def tib_shard(root: Path) -> Path:
    """A zarr v3 array of 1 TiB in one ``sharding_indexed`` shard of 1-byte inner chunks."""
    n = 1 << 40
    shard = {"name": "sharding_indexed", "configuration": {
        "chunk_shape": [1], "codecs": [BYTES], "index_codecs": [BYTES, {"name": "crc32c"}]}}  # fmt: skip
    return item(root, {"w": zarr_json([n], [n], [shard], "uint8")}, {"w/c/0": bytes(64)})


# ----------------------------------------------------------------------------- OCDBT by hand


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def frame(magic: int, body: bytes, *, zstd: bool = False) -> bytes:
    """An OCDBT manifest or node: magic, length, version 0, compression, body, CRC-32C."""
    import crc32c

    head_len = 4 + 8 + 2
    out = struct.pack(">I", magic) + struct.pack("<Q", head_len + len(body) + 4)
    out += b"\x00" + (b"\x01" if zstd else b"\x00") + body
    return out + struct.pack("<I", crc32c.crc32c(out))


def table(paths: list[bytes]) -> bytes:
    out = varint(len(paths)) + b"".join(varint(0) for _ in paths[1:])
    out += b"".join(varint(len(p)) for p in paths) + b"".join(varint(0) for _ in paths)
    return out + b"".join(paths)


def manifest(path: bytes, off: int, length: int, height: int, nkeys: int, *, node_max: int):
    body = bytes(16) + varint(0) + varint(100) + varint(node_max) + b"\x04" + varint(0)
    body += table([path]) + varint(1) + varint(1) + bytes([height]) + varint(0)
    body += varint(off) + varint(length) + varint(nkeys) + varint(length) + varint(0)
    return frame(0x0CDB3A2A, body + struct.pack("<Q", 0) + varint(0))


def ocdbt_node_bomb(root: Path, declared: int = 3 * GIB, *, content_size: bool = True) -> Path:
    """An OCDBT database whose manifest allows 2**32-byte nodes and whose root node is a
    zstd frame of ``declared`` zero bytes (about 100 KiB stored)."""
    root.mkdir(parents=True, exist_ok=True)
    node = frame(0x0CDB20DE, zstd_zeros(declared, content_size=content_size), zstd=True)
    (root / "d").mkdir(exist_ok=True)
    (root / "d" / "f").write_bytes(node)
    (root / "manifest.ocdbt").write_bytes(manifest(b"d/f", 0, len(node), 0, 1, node_max=1 << 32))
    return root


def ocdbt_key_bomb(root: Path, n: int = 60_000) -> Path:
    """An OCDBT database of one uncompressed leaf node (about 400 KiB) holding ``n`` keys of
    64 KiB each: every key shares all but its last byte or two with the one before it, so
    the node spells ``n`` x 64 KiB of keys (3.9 GB for 60,000) in a few bytes per key."""
    root.mkdir(parents=True, exist_ok=True)
    width = 1 << 16
    keeps, suffixes, tail = [], [], bytearray()
    prev_hi = -1
    for i in range(n):
        hi, lo = divmod(i, 255)
        lo += 1
        if i == 0:
            suffix = b"a" * (width - 2) + bytes([hi, lo])
        elif hi == prev_hi:
            keeps.append(width - 1)
            suffix = bytes([lo])
        else:
            keeps.append(width - 2)
            suffix = bytes([hi, lo])
        prev_hi = hi
        suffixes.append(len(suffix))
        tail += suffix
    body = b"\x00" + table([]) + varint(n)
    body += b"".join(map(varint, keeps)) + b"".join(map(varint, suffixes)) + bytes(tail)
    body += varint(0) * n + varint(0) * n  # value lengths, kinds (inline)
    node = frame(0x0CDB20DE, body)
    (root / "d").mkdir(exist_ok=True)
    (root / "d" / "f").write_bytes(node)
    (root / "manifest.ocdbt").write_bytes(manifest(b"d/f", 0, len(node), 0, n, node_max=1 << 23))
    return root


def _prod(xs: list[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out
