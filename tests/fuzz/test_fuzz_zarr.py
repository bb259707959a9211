"""Orbax item folders of zarr v2 and v3 arrays, mutated: read as tensorstore reads them, or refused.

Two sources: small arrays written here by tensorstore (zarr v2 with zstd, zlib, gzip or no
compressor, C and F order, a 0-d array; zarr v3 with zstd, gzip and a ``sharding_indexed``
shard), and a copy of the real Orbax checkpoint in ``../shared/fixtures/jax``
(``orbax_no_ocdbt``: one zarr v2 folder per leaf, written by orbax-checkpoint). Each case
changes one thing: a field of an array's metadata (shape, chunks, dtype, fill value,
codecs...) set to a drawn value, the writer's word on absent chunks, a chunk's bytes
flipped or cut, a chunk removed, moved to another key or copied to one, a chunk replaced
by a symlink to a copy inside or outside the checkpoint.

The property: dmlib either refuses the folder with a ``DmlibError`` (one line naming it)
or reads every tensor; each tensor it reads equals what tensorstore (the oracle) reads
for that array, wherever tensorstore reads it too. No other exception, no hang
(``fuzzlib.no_hang``), and nothing read from outside the checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from _support import fuzzlib
from hypothesis import given
from hypothesis import strategies as st

import dmlib
from dmlib.errors import DmlibError

ts_ = pytest.importorskip("tensorstore")
pytest.importorskip("zstandard")
pytest.importorskip("crc32c")

JAX = (Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "jax").resolve()
ORACLE_MAX = 16 << 20  # tensorstore is asked to read only what declares at most this much

# values a metadata field is set to: small, machine-exceeding, of the wrong type
NUMBERS = st.sampled_from([0, 1, 2, 3, 4, 7, -1, 300, 10**12, 1 << 40, 1 << 62, 1 << 64])
SCALARS = st.one_of(
    NUMBERS,
    st.sampled_from([None, True, 1.5, -2.0, 1e300, 1e-300, "NaN", "Infinity", "-Infinity"]),
    st.sampled_from(["0x7fc00000", "0x3fc0", "0x01", "0xzz", "", "abc", "1e999"]),
    st.sampled_from(["<f4", ">f4", "<f8", "<i2", "|u1", "|b1", "<c8", "bfloat16", "float8_e4m3fn"]),
    st.sampled_from(["float32", "int8", "uint16", "float16", "C", "F", ".", "/", "zstd", "v2"]),
)
VALUES = st.one_of(
    SCALARS,
    st.lists(NUMBERS, max_size=3),
    st.lists(SCALARS, max_size=2),
    st.dictionaries(st.sampled_from(["id", "name", "configuration", "level"]), SCALARS, max_size=2),
)


# ----------------------------------------------------------------------------- the sources


def _v3_meta(arr: np.ndarray, chunks: list[int], codecs: list[Any]) -> dict[str, Any]:
    return {
        "shape": list(arr.shape),
        "data_type": arr.dtype.name,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunks}},
        "codecs": codecs,
    }


def _small_arrays() -> list[tuple[str, str, np.ndarray, dict[str, Any]]]:
    """(leaf, tensorstore driver, values, metadata) of the tensorstore-written source."""
    rng = np.random.default_rng(7)
    le = {"name": "bytes", "configuration": {"endian": "little"}}
    shard = {"name": "sharding_indexed", "configuration": {
        "chunk_shape": [2, 3], "codecs": [le, {"name": "zstd"}],
        "index_codecs": [le, {"name": "crc32c"}]}}  # fmt: skip
    a = rng.standard_normal((5, 7)).astype("<f4")
    b = rng.integers(-999, 999, 9).astype("<i2")
    c = rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16)
    e = rng.standard_normal((4, 3))
    f = rng.standard_normal((6, 5)).astype("<f4")
    g = rng.integers(0, 255, 10).astype("u1")
    h = rng.standard_normal((8, 6)).astype("<f2")
    v2 = {"dimension_separator": "."}
    return [
        ("a2", "zarr", a, {**v2, "chunks": [2, 3], "dtype": "<f4", "compressor": {"id": "zstd"}}),
        ("b2", "zarr", b, {**v2, "chunks": [4], "dtype": "<i2", "compressor": {"id": "zlib"}}),
        (
            "c2",
            "zarr",
            c,
            {**v2, "chunks": [3, 4], "dtype": "bfloat16", "compressor": {"id": "gzip"}},
        ),  # fmt: skip
        (
            "d2",
            "zarr",
            np.array(5, "<i4"),
            {**v2, "chunks": [], "dtype": "<i4", "compressor": None},
        ),
        (
            "e2",
            "zarr",
            e,
            {**v2, "chunks": [3, 2], "dtype": "<f8", "compressor": None, "order": "F"},
        ),  # fmt: skip
        ("f3", "zarr3", f, _v3_meta(f, [4, 4], [le, {"name": "zstd"}])),
        ("g3", "zarr3", g, _v3_meta(g, [4], [le, {"name": "gzip"}])),
        ("h3", "zarr3", h, _v3_meta(h, [4, 6], [shard])),
    ]


def _item_metadata(leaves: list[str]) -> dict[str, Any]:
    tree = {
        f"('{n}',)": {
            "key_metadata": [{"key": n, "key_type": 2}],
            "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False},
        }
        for n in leaves
    }
    return {"tree_metadata": tree}


def _spec(item: Path, leaf: str, driver: str) -> dict[str, Any]:
    return {"driver": driver, "kvstore": {"driver": "file", "path": f"{item}/{leaf}/"}}


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("fuzz_zarr_small")
    item = root / "orig"
    drivers = {}
    for leaf, driver, arr, meta in _small_arrays():
        spec = {**_spec(item, leaf, driver), "metadata": {"shape": list(arr.shape), **meta},
                "create": True}  # fmt: skip
        ts_.open(spec).result().write(arr).result()
        assert _oracle(item, leaf, driver).tobytes() == arr.tobytes()
        drivers[leaf] = driver
    (item / "_METADATA").write_text(json.dumps(_item_metadata(sorted(drivers))))
    return item, root, drivers


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory):
    src = JAX / "orbax_no_ocdbt" / "A_step10" / "default"
    if not src.is_dir():
        pytest.skip(f"real JAX fixtures not found at {JAX}")
    root = tmp_path_factory.mktemp("fuzz_zarr_real")
    item = root / "orig"
    shutil.copytree(src, item)
    leaves = [p.name for p in item.iterdir() if (p / ".zarray").is_file()]
    return item, root, {leaf: "zarr" for leaf in leaves}


# ----------------------------------------------------------------------------- the oracle


def _oracle(item: Path, leaf: str, driver: str) -> np.ndarray | None:
    """What tensorstore reads for ``leaf``; None where it refuses or declares too much."""
    try:
        t = ts_.open(_spec(item, leaf, driver)).result()
        if int(np.prod(t.shape, dtype=object)) * t.dtype.numpy_dtype.itemsize > ORACLE_MAX:
            return None
        return np.asarray(t.read().result())
    except Exception:  # noqa: BLE001 (any refusal of the oracle's is "no reading")
        return None


def _same(got: np.ndarray, want: np.ndarray) -> bool:
    if got.shape != want.shape:
        return False
    g = np.ascontiguousarray(got)
    if g.dtype.byteorder not in ("=", "|") and g.dtype != want.dtype:
        g = g.astype(g.dtype.newbyteorder("="))  # a byte swap: the bits are kept
    return g.dtype == want.dtype and g.tobytes() == np.ascontiguousarray(want).tobytes()


def _read(item: Path, target: str) -> dict[str, np.ndarray] | None:
    """Every tensor dmlib reads from ``item`` (copies), or None when it refuses."""
    try:
        with fuzzlib.no_hang(), dmlib.open_tensors(item) as ts:
            out = {name: np.array(t.load()) for name, t in ts.items()}
    except DmlibError as err:
        msg = str(err)
        assert str(item) in msg, f"message does not name the folder: {msg}"
        assert "\n" not in msg, f"message is not one line: {msg!r}"
        fuzzlib.COUNTS[target]["refused"] += 1
        return None
    fuzzlib.COUNTS[target]["read"] += 1
    return out


# ----------------------------------------------------------------------------- the mutations


def _meta_file(item: Path, leaf: str) -> Path:
    return item / leaf / (".zarray" if (item / leaf / ".zarray").exists() else "zarr.json")


def _chunks(item: Path, leaf: str) -> list[Path]:
    return sorted(
        p for p in (item / leaf).rglob("*") if p.is_file() and not p.name.startswith(".")
        and p.name != "zarr.json"
    )  # fmt: skip


def _set_field(data: st.DataObject, item: Path, leaf: str) -> None:
    path = _meta_file(item, leaf)
    md = json.loads(path.read_text())
    # a top-level field, or one inside a nested object (codecs, chunk grid, compressor)
    places: list[tuple[Any, Any]] = [(md, k) for k in md]
    for v in md.values():
        if isinstance(v, dict):
            places += [(v, k) for k in v]
            for w in v.values():
                if isinstance(w, dict):
                    places += [(w, k) for k in w]
        if isinstance(v, list):
            places += [(v, i) for i in range(len(v))]
            for w in v:
                if isinstance(w, dict):
                    places += [(w, k) for k in w]
    holder, key = data.draw(st.sampled_from(places), label="field")
    holder[key] = data.draw(VALUES, label="value")
    path.write_text(json.dumps(md))


def _touch_chunk(data: st.DataObject, item: Path, leaf: str, root: Path) -> None:
    chunks = _chunks(item, leaf)
    if not chunks:
        return
    c = data.draw(st.sampled_from(chunks), label="chunk")
    how = data.draw(
        st.sampled_from(["flip", "cut", "extend", "remove", "move", "copy", "link-in", "link-out"]),
        label="how",
    )
    raw = bytearray(c.read_bytes())
    if how == "flip" and raw:
        raw[data.draw(st.integers(0, len(raw) - 1), label="pos")] ^= data.draw(
            st.integers(1, 255), label="mask"
        )
        c.write_bytes(bytes(raw))
    elif how == "cut":
        c.write_bytes(bytes(raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)), label="at")]))
    elif how == "extend":
        c.write_bytes(bytes(raw) + data.draw(st.binary(min_size=1, max_size=64), label="tail"))
    elif how == "remove":
        c.unlink()
    elif how in ("move", "copy"):
        key = data.draw(st.sampled_from(["0", "1", "0.1", "1.0", "9.9", "0.0.0", "c/0", "c/1/0"]))
        dst = item / leaf / key
        try:  # not where a file or folder already is
            dst.parent.mkdir(parents=True, exist_ok=True)
            if not dst.exists():
                (shutil.move if how == "move" else shutil.copy)(str(c), str(dst))
        except (FileExistsError, NotADirectoryError):
            pass
    elif how == "link-in":
        kept = item / f"kept-{c.name}"
        shutil.copy(c, kept)
        c.unlink()
        c.symlink_to(kept)
    else:
        away = root / "outside" / f"{leaf}-{c.name}"
        away.parent.mkdir(exist_ok=True)
        shutil.copy(c, away)
        c.unlink()
        c.symlink_to(away)


def _mutate(data: st.DataObject, item: Path, root: Path, leaves: list[str]) -> None:
    leaf = data.draw(st.sampled_from(leaves), label="leaf")
    what = data.draw(st.sampled_from(["field", "field", "chunk", "chunk", "absent"]), label="what")
    if what == "field":
        _set_field(data, item, leaf)
    elif what == "chunk":
        _touch_chunk(data, item, leaf, root)
    else:  # the writer's word that chunks equal to the fill value were not stored
        md_path = item / "_METADATA"
        md = json.loads(md_path.read_text())
        md["store_array_data_equal_to_fill_value"] = data.draw(st.sampled_from([False, True]))
        md_path.write_text(json.dumps(md))
        if data.draw(st.booleans(), label="and-a-chunk"):
            _touch_chunk(data, item, leaf, root)


def _check(source, data: st.DataObject, target: str) -> None:
    orig, root, drivers = source
    work = root / "work"
    if work.exists():
        shutil.rmtree(work)
    shutil.rmtree(root / "outside", ignore_errors=True)
    shutil.copytree(orig, work, symlinks=True)
    leaves = sorted(drivers)
    _mutate(data, work, root, leaves)
    got = _read(work, target)
    if got is None:
        return
    links_out = (root / "outside").exists()
    assert not links_out, "a chunk outside the checkpoint was read"
    for leaf in leaves:
        want = _oracle(work, leaf, drivers[leaf])
        if want is not None and leaf in got:
            assert _same(got[leaf], want), f"{leaf}: dmlib reads other values than tensorstore"


@fuzzlib.fuzz()
@given(data=st.data())
def test_tensorstore_arrays_mutated_read_as_tensorstore_reads_or_refused(small, data) -> None:
    _check(small, data, "zarr-small-mutated")


@fuzzlib.fuzz()
@given(data=st.data())
def test_real_orbax_folder_mutated_reads_as_tensorstore_reads_or_refused(real, data) -> None:
    _check(real, data, "zarr-real-mutated")


# ----------------------------------------------------------------------------- real OCDBT


@pytest.fixture(scope="module")
def real_ocdbt(tmp_path_factory: pytest.TempPathFactory):
    """The real zarr v2 and v3 checkpoints in OCDBT (orbax-checkpoint's default layout)."""
    out = []
    for layout, driver in (("orbax_ocdbt_zarr2", "zarr"), ("orbax_ocdbt_zarr3", "zarr3")):
        src = JAX / layout / "A_step10" / "default"
        if not src.is_dir():
            pytest.skip(f"real JAX fixtures not found at {JAX}")
        root = tmp_path_factory.mktemp(f"fuzz_{layout}")
        shutil.copytree(src, root / "orig")
        kv = _kv(root / "orig")
        meta = ".zarray" if driver == "zarr" else "zarr.json"
        leaves = [
            k.decode()[: -len(meta) - 1] for k in kv.list().result() if k.endswith(meta.encode())
        ]
        out.append((root / "orig", root, {leaf: driver for leaf in leaves}))
    return out


def _kv(item: Path):
    return ts_.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()


def _ocdbt_oracle(item: Path, leaf: str, driver: str) -> np.ndarray | None:
    spec = {"driver": driver, "kvstore": {"driver": "ocdbt", "base": f"file://{item}/",
                                          "path": f"{leaf}/"}}  # fmt: skip
    try:
        t = ts_.open(spec).result()
        if int(np.prod(t.shape, dtype=object)) * t.dtype.numpy_dtype.itemsize > ORACLE_MAX:
            return None
        return np.asarray(t.read().result())
    except Exception:  # noqa: BLE001 (any refusal of the oracle's is "no reading")
        return None


def _mutate_ocdbt(data: st.DataObject, item: Path, leaves: list[str], driver: str) -> None:
    """One change, written by tensorstore into the database (a new version), or one byte
    of a data file flipped (the checksums then refuse it, or it reads as tensorstore reads)."""
    kv = _kv(item)
    leaf = data.draw(st.sampled_from(leaves), label="leaf")
    keys = [k.decode() for k in kv.list().result() if k.decode().startswith(leaf + "/")]
    meta = f"{leaf}/.zarray" if driver == "zarr" else f"{leaf}/zarr.json"
    chunks = [k for k in keys if k != meta]
    how = data.draw(st.sampled_from(["field", "remove", "copy", "flip"]), label="how")
    if how == "field":
        md = json.loads(kv.read(meta).result().value)
        places = [(md, k) for k in md] + [
            (v, k) for v in md.values() if isinstance(v, dict) for k in v
        ]
        holder, key = data.draw(st.sampled_from(places), label="field")
        holder[key] = data.draw(VALUES, label="value")
        kv.write(meta, json.dumps(md).encode()).result()
    elif how in ("remove", "copy") and chunks:
        c = data.draw(st.sampled_from(chunks), label="chunk")
        if how == "remove":
            kv.delete_range(ts_.KvStore.KeyRange(c, c + "\0")).result()
        else:
            other = data.draw(st.sampled_from(["0", "1.0", "0.1", "c/0/1", "c/1", "9"]))
            kv.write(f"{leaf}/{other}", kv.read(c).result().value).result()
    else:
        files = sorted(p for p in item.rglob("*") if p.is_file() and p.parent.name == "d")
        f = data.draw(st.sampled_from(files), label="file")
        raw = bytearray(f.read_bytes())
        raw[data.draw(st.integers(0, len(raw) - 1), label="pos")] ^= data.draw(
            st.integers(1, 255), label="mask"
        )
        f.write_bytes(bytes(raw))


@fuzzlib.fuzz()
@given(data=st.data())
def test_real_ocdbt_checkpoints_mutated_read_as_tensorstore_reads_or_refused(
    real_ocdbt, data
) -> None:
    orig, root, drivers = data.draw(st.sampled_from(real_ocdbt), label="layout")
    work = root / "work"
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(orig, work)
    leaves = sorted(drivers)
    driver = drivers[leaves[0]]
    _mutate_ocdbt(data, work, leaves, driver)
    got = _read(work, "zarr-ocdbt-real-mutated")
    if got is None:
        return
    for leaf in leaves:
        want = _ocdbt_oracle(work, leaf, driver)
        if want is not None and leaf in got:
            assert _same(got[leaf], want), f"{leaf}: dmlib reads other values than tensorstore"


def test_the_sources_read_as_tensorstore_reads_them(small, real, real_ocdbt) -> None:
    for orig, _, drivers in real_ocdbt:
        got = _read(orig, "zarr-sources")
        assert got is not None and sorted(got) == sorted(drivers)
        for leaf, driver in drivers.items():
            want = _ocdbt_oracle(orig, leaf, driver)
            assert want is not None and _same(got[leaf], want), leaf
    for orig, _, drivers in (small, real):
        got = _read(orig, "zarr-sources")
        assert got is not None and sorted(got) == sorted(drivers)
        for leaf, driver in drivers.items():
            want = _oracle(orig, leaf, driver)
            assert want is not None and _same(got[leaf], want), leaf
    assert os.path.isdir(JAX)
