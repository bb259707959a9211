"""OCDBT databases and zarr arrays written by tensorstore, damaged: read or refused.

Two targets. Structure: an uncompressed OCDBT database (small nodes: interior B+tree
nodes) whose manifest or one B+tree node has a byte of its body changed and its CRC-32C
recomputed, so that the parser itself, not the checksum, meets the damage. Content: a
zarr v3 database with every byte covered by a check (zstd frames with checksums, shard
indexes with CRC-32C, metadata inline in CRC-checked nodes), flipped or cut anywhere: it
must read back exactly as tensorstore wrote it, or be refused.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from _support import fuzzlib
from _support.fuzzlib import read_or_refuse
from hypothesis import given
from hypothesis import strategies as st

ts_ = pytest.importorskip("tensorstore")
crc32c = pytest.importorskip("crc32c")

MAGICS = (b"\x0c\xdb\x3a\x2a", b"\x0c\xdb\x20\xde")  # manifest, B+tree node


def _write(root: Path, config: dict, arrays: dict, zarr3: bool) -> dict[str, bytes]:
    out = {}
    for name, arr in arrays.items():
        kv = {"driver": "ocdbt", "base": f"file://{root}/", "path": f"{name}/", "config": config}
        if zarr3:
            inner = [{"name": "bytes", "configuration": {"endian": "little"}},
                     {"name": "zstd", "configuration": {"level": 1, "checksum": True}}]  # fmt: skip
            index = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]
            shard = [max(1, s // 2) for s in arr.shape]
            meta = {
                "shape": list(arr.shape),
                "data_type": arr.dtype.name,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shard or []}},
                "codecs": [{"name": "sharding_indexed", "configuration": {
                    "chunk_shape": [max(1, s // 2) for s in shard], "codecs": inner,
                    "index_codecs": index}}],
            }  # fmt: skip
            spec = {"driver": "zarr3", "kvstore": kv, "metadata": meta, "create": True}
        else:
            meta = {"shape": list(arr.shape), "chunks": [max(1, s // 3) for s in arr.shape],
                    "dtype": arr.dtype.str, "compressor": None}  # fmt: skip
            spec = {"driver": "zarr", "kvstore": kv, "metadata": meta, "create": True}
        ts_.open(spec).result().write(arr).result()
        out[name] = arr.tobytes()
    return out


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _frames(root: Path) -> list[tuple[Path, int, int]]:
    """(file, start, length) of every manifest and B+tree node, found by their magic."""
    out = []
    for f in _files(root):
        raw = f.read_bytes()
        for magic in MAGICS:
            i = raw.find(magic)
            while i >= 0:
                (length,) = struct.unpack("<Q", raw[i + 4 : i + 12])
                if 18 <= length <= len(raw) - i:
                    out.append((f, i, length))
                i = raw.find(magic, i + 1)
    return out


def _restore(src: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


@pytest.fixture(scope="module")
def structure(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fuzz_ocdbt")
    orig = root / "orig"
    rng = np.random.default_rng(0)
    arrays = {
        "w": rng.standard_normal((12, 9)).astype("<f4"),
        "layer/b": rng.integers(0, 9, 7).astype("<i2"),
        "step": np.array(5, "<u4"),
    }
    config = {"compression": None, "max_decoded_node_bytes": 256, "max_inline_value_bytes": 40}
    expected = _write(orig, config, arrays, zarr3=False)
    frames = _frames(orig)
    assert any(f.name == "manifest.ocdbt" for f, _, _ in frames) and len(frames) > 3
    return orig, root / "work", expected, frames


@fuzzlib.fuzz()
@given(data=st.data())
def test_ocdbt_bodies_parsed_or_refused(structure, data: st.DataObject) -> None:
    orig, work, expected, frames = structure
    _restore(orig, work)
    got = read_or_refuse(work, "orbax-ocdbt-gen")
    assert got is not None and {k: v[0] for k, v in got.items()} == expected
    f, start, length = data.draw(st.sampled_from(frames), label="frame")
    target = work / f.relative_to(orig)
    raw = bytearray(target.read_bytes())
    # the body: after magic, length, version and compression (one byte each here)
    pos = data.draw(st.integers(start + 14, start + length - 5), label="pos")
    raw[pos] ^= data.draw(st.integers(1, 255), label="mask")
    body_end = start + length - 4
    raw[body_end : body_end + 4] = struct.pack("<I", crc32c.crc32c(bytes(raw[start:body_end])))
    target.write_bytes(bytes(raw))
    read_or_refuse(work, "orbax-ocdbt-body")


@pytest.fixture(scope="module")
def content(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fuzz_zarr3")
    orig = root / "orig"
    rng = np.random.default_rng(1)
    arrays = {
        "k": rng.standard_normal((8, 6)).astype("<f4"),
        "v": rng.standard_normal(12).astype("<f8"),
        "count": np.array(3, "<i4"),
    }
    # metadata inline in the (CRC-checked) leaf nodes, as Orbax configures it
    config = {"max_inline_value_bytes": 1024}
    return orig, root / "work", _write(orig, config, arrays, zarr3=True)


@fuzzlib.fuzz()
@given(data=st.data())
def test_zarr3_flip_or_cut_never_reads_wrong(content, data: st.DataObject) -> None:
    orig, work, expected = content
    _restore(orig, work)
    got = read_or_refuse(work, "orbax-zarr3-gen")
    assert got is not None and {k: v[0] for k, v in got.items()} == expected
    files = [p.relative_to(orig) for p in _files(orig)]
    target = work / data.draw(st.sampled_from(files), label="file")
    raw = bytearray(target.read_bytes())
    if data.draw(st.booleans(), label="cut"):
        target.write_bytes(bytes(raw[: data.draw(st.integers(0, len(raw) - 1), label="at")]))
    else:
        raw[data.draw(st.integers(0, len(raw) - 1), label="pos")] ^= data.draw(
            st.integers(1, 255), label="mask"
        )
        target.write_bytes(bytes(raw))
    got = read_or_refuse(work, "orbax-zarr3-damaged")
    if got is not None:  # whatever still reads is exactly what was written
        assert {k: v[0] for k, v in got.items()} == expected
