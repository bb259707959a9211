"""Orbax checkpoints (OCDBT + zarr v2/v3, no-OCDBT folders), read without tensorstore.

Oracles: the real files of ``../shared/fixtures/jax`` (orbax-checkpoint 0.12.8) against
their reference ``.npz`` (numpy), and stores written here by tensorstore, read back by
tensorstore. Corrupted copies are made of the real files.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import dmlib
from dmlib.cli import main
from dmlib.errors import DmlibError

# ../shared/fixtures beside the checkout, as tests/conftest.py locates it
JAX = (Path(__file__).resolve().parent.parent / ".." / "shared" / "fixtures" / "jax").resolve()

LAYOUTS = [
    ("orbax_ocdbt_zarr2/A_step10", "A_step_10"),
    ("orbax_ocdbt_zarr2/A_step0", "A_step_0"),
    ("orbax_ocdbt_zarr2/B_step10", "B_step_10"),
    ("orbax_ocdbt_zarr2/D_step10", "D_step_10"),
    ("orbax_ocdbt_zarr2/A_step10/default", "A_step_10"),
    ("orbax_ocdbt_zarr2/A_step10/default/_METADATA", "A_step_10"),
    ("orbax_ocdbt_zarr3/A_step10", "A_step_10"),
    ("orbax_no_ocdbt/A_step10", "A_step_10"),
]


@pytest.fixture
def jax_fixtures() -> Path:
    if not JAX.is_dir():
        pytest.skip(
            f"real JAX fixtures not found at {JAX} (../shared/fixtures beside the checkout)"
        )
    return JAX


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for dirpath, dirs, files in os.walk(dst):
        for n in dirs + files:
            os.chmod(os.path.join(dirpath, n), 0o755 if n in dirs else 0o644)
    os.chmod(dst, 0o755)
    return dst


@pytest.mark.parametrize(("layout", "ref"), LAYOUTS)
def test_every_layout_equals_its_reference_npz(jax_fixtures, layout, ref):
    z = np.load(jax_fixtures / "reference" / f"{ref}.npz")
    with dmlib.open_tensors(jax_fixtures / layout) as ts:
        assert ts.format == "orbax"
        # Orbax names are the pytree paths joined with '.'; an nnx.State leaf ends in 'value'
        by_ref = {n.removesuffix(".value"): n for n in ts}
        assert sorted(by_ref) == sorted(z.files)
        for name in z.files:
            want, t = z[name], ts[by_ref[name]]
            got = t.load()
            assert (t.shape, t.dtype) == (want.shape, want.dtype), name
            assert got.shape == want.shape and got.tobytes() == want.tobytes(), name
        # 0-d leaves stay 0-d; the step is the checkpoint's own record of it
        assert ts[by_ref["optimizer.step"]].shape == ()
        assert ts[by_ref["optimizer.opt_state.0.count"]].shape == ()
        assert ts.scalars["step"] == int(z["optimizer.step"])


def test_reading_is_lazy_and_never_writes(jax_fixtures, tmp_path, monkeypatch):
    step = _copy(jax_fixtures / "orbax_ocdbt_zarr2/A_step10", tmp_path / "10")
    before = {p: p.stat().st_mtime_ns for p in step.rglob("*")}
    from dmlib.io import zarr_

    calls = []
    real = zarr_.read_array
    monkeypatch.setattr(
        zarr_, "read_array", lambda *a, **k: calls.append(a[0].name) or real(*a, **k)
    )
    with dmlib.open_tensors(step) as ts:
        opened = list(calls)  # the 0-d step leaves only (the recorded step)
        ts["model.l2.kernel.value"].load()
    assert set(opened) <= {"optimizer.step.value", "optimizer.opt_state.0.count.value"}
    assert calls[len(opened) :] == ["model.l2.kernel.value"]
    assert {p: p.stat().st_mtime_ns for p in step.rglob("*")} == before


def test_layout_facts(jax_fixtures, capsys):
    with dmlib.open_tensors(jax_fixtures / "orbax_ocdbt_zarr3/A_step10") as ts:
        lay = ts.layout
    assert lay["layout"] == "orbax-ocdbt" and lay["zarr_format"] == 3
    assert lay["ocdbt_version"] == 0 and lay["btree_height"] == 0 and lay["keys"] == 40
    arr = lay["arrays"]["model.l1.kernel"]
    assert arr["chunks"] == [16, 64] and arr["grid"] == [1, 1]
    assert arr["compressor"] == "sharding_indexed[zstd]+crc32c index"
    assert main(["inspect", str(jax_fixtures / "orbax_ocdbt_zarr2/A_step10")]) == 0
    out = capsys.readouterr().out
    assert "orbax" in out and "zarr_format=2" in out and "btree_height=0" in out
    assert "model.l1.kernel.value" in out and "16x64" in out and "zstd" in out


# ----------------------------------------------------------------------------- the questions


def test_cli_same_seed_identical_other_seed_different(jax_fixtures, capsys):
    d = jax_fixtures / "orbax_ocdbt_zarr2"
    assert main(["compare", str(d / "A_step10"), str(d / "B_step10")]) == 0
    assert "IDENTICAL" in capsys.readouterr().out
    assert main(["compare", str(d / "A_step10"), str(d / "D_step10")]) == 1
    assert "DIFFERENT" in capsys.readouterr().out
    # the same state in three layouts and in flax msgpack
    for other in (
        jax_fixtures / "orbax_ocdbt_zarr3/A_step10",
        jax_fixtures / "orbax_no_ocdbt/A_step10",
        jax_fixtures / "msgpack/A_step_10.msgpack",
        jax_fixtures / "reference/A_step_10.npz",
    ):
        assert main(["compare", str(d / "A_step10"), str(other)]) == 0, other
        out = capsys.readouterr().out
        assert "0 of 20 compared tensors differ" in out, other


def test_matrix_verdict(jax_fixtures, capsys):
    d = jax_fixtures / "orbax_ocdbt_zarr2"
    argv = ["matrix", f"A={d / 'A_step10'}", f"B={d / 'B_step10'}", f"D={d / 'D_step10'}"]
    assert main([*argv, "--control", "D", "--json"]) == 1
    v = json.loads(capsys.readouterr().out)["verdict"]
    assert v["identical_pairs"] == ["A/B"] and v["control"] == "D"
    # the control's distance, recomputed with numpy from the reference files
    za, zd = (np.load(jax_fixtures / "reference" / f"{r}_step_10.npz") for r in "AD")
    worst = max(
        float(
            np.linalg.norm(za[n].astype(np.float64) - zd[n])
            / np.linalg.norm(za[n].astype(np.float64))
        )
        for n in za.files
        if za[n].dtype.kind == "f" and np.linalg.norm(za[n]) > 0
    )
    assert v["control_rel_fro"] == pytest.approx(worst, rel=1e-6)


def test_manager_folder_is_a_ladder(jax_fixtures, tmp_path, capsys):
    d = jax_fixtures / "orbax_ocdbt_zarr2"
    for run, last in (("A", "A_step10"), ("B", "B_step10"), ("D", "D_step10")):
        _copy(d / "A_step0", tmp_path / run / "0")
        _copy(d / last, tmp_path / run / "10")
    with pytest.raises(DmlibError, match="CheckpointManager folder .*steps 0, 10"):
        dmlib.open_tensors(tmp_path / "A")
    argv = ["ladder", *(f"{r}={tmp_path / r}" for r in "ABD"), "--json"]
    assert main(argv) == 1
    doc = json.loads(capsys.readouterr().out)
    checks = doc["checks"]
    assert {c["status"] for c in checks} == {"ok"}
    assert sorted({(c["run"], c["step"], c["recorded_step"]) for c in checks}) == [
        (r, s, s) for r in "ABD" for s in (0, 10)
    ]
    assert main(["ladder", *(f"{r}={tmp_path / r}" for r in "ABD")]) == 1
    out = capsys.readouterr().out
    assert "A/B: bit-identical at every step" in out
    assert "A/D: first diverges at step 10" in out


def test_study_init_finds_orbax_runs(jax_fixtures, tmp_path):
    from dmlib.report.study import load_study
    from dmlib.report.studyfile import init_from_folder

    d = jax_fixtures / "orbax_ocdbt_zarr2"
    _copy(d / "A_step0", tmp_path / "A" / "0")
    _copy(d / "A_step10", tmp_path / "A" / "10")
    _copy(d / "D_step10", tmp_path / "D" / "step_10")
    (tmp_path / "study.toml").write_text(init_from_folder(tmp_path))
    study = load_study(tmp_path / "study.toml")
    assert study.runs["A"].checkpoints == {0: tmp_path / "A" / "0", 10: tmp_path / "A" / "10"}
    assert study.runs["D"].checkpoints == {10: tmp_path / "D" / "step_10"}
    # provenance hashes the files inside checkpoint folders
    inputs = study.input_files()
    assert tmp_path / "A/10/default/manifest.ocdbt" in inputs
    assert all(p.is_file() for p in inputs)
    # the resolved study a report writes lists a run's checkpoints: folders are accepted
    (tmp_path / "listed.toml").write_text('[runs]\nA = ["A/0", "A/10"]\n')
    listed = load_study(tmp_path / "listed.toml")
    assert listed.runs["A"].checkpoints == {0: tmp_path / "A/0", 10: tmp_path / "A/10"}


def test_step_from_folder_name_when_the_state_has_none(tmp_path):
    ts_ = pytest.importorskip("tensorstore")
    item = tmp_path / "step_7" / "default"
    _ts_write(ts_, item, "w", np.arange(6, dtype="<f4").reshape(2, 3), chunks=[2, 3])
    (tmp_path / "step_7" / "_CHECKPOINT_METADATA").write_text("{}")
    with dmlib.open_tensors(tmp_path / "step_7") as ts:
        assert ts.scalars["step"] == 7 and "folder" in ts.layout["step_from"]


# ----------------------------------------------------------------------------- damaged copies


def _refused(path: Path, capsys, *words: str) -> str:
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert str(path) in err, err
    for w in words:
        assert w in err, err
    return err


def test_truncated_data_file(jax_fixtures, tmp_path, capsys):
    step = _copy(jax_fixtures / "orbax_ocdbt_zarr2/A_step10", tmp_path / "10")
    biggest = max((step / "default/ocdbt.process_0/d").iterdir(), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    _refused(step, capsys, "beyond the file")


def test_flipped_crc_byte(jax_fixtures, tmp_path, capsys):
    step = _copy(jax_fixtures / "orbax_ocdbt_zarr2/A_step10", tmp_path / "10")
    m = step / "default/manifest.ocdbt"
    raw = bytearray(m.read_bytes())
    raw[-2] ^= 0x10
    m.write_bytes(bytes(raw))
    _refused(step, capsys, "CRC-32C")
    # a B+tree node (the top-level one, in default/d/)
    step = _copy(jax_fixtures / "orbax_ocdbt_zarr2/A_step10", tmp_path / "10b")
    (node,) = (step / "default/d").iterdir()
    raw = bytearray(node.read_bytes())
    raw[-1] ^= 0x01
    node.write_bytes(bytes(raw))
    _refused(step, capsys, "CRC-32C")


def test_flipped_shard_index_crc(jax_fixtures, tmp_path, capsys):
    pytest.importorskip("tensorstore")
    step = _copy(jax_fixtures / "orbax_ocdbt_zarr3/A_step10", tmp_path / "10")
    from dmlib.io.ocdbt import open_store

    db = open_store(step / "default")
    ref = db.keys["model.l2.kernel/c/0/0"]
    assert not isinstance(ref, bytes)  # 16 KiB: stored out of line
    f = step / "default" / ref.path
    raw = bytearray(f.read_bytes())
    raw[ref.offset + ref.length - 1] ^= 0x01  # the last byte of the shard: its index CRC
    f.write_bytes(bytes(raw))
    with dmlib.open_tensors(step) as ts:  # the metadata is intact: the error comes on load
        ts["model.l1.kernel"].load()
        with pytest.raises(DmlibError, match="shard index CRC-32C mismatch"):
            ts["model.l2.kernel"].load()
    assert main(["compare", str(step), str(jax_fixtures / "orbax_ocdbt_zarr3/A_step10")]) == 2
    assert "CRC-32C" in capsys.readouterr().err


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _reencode_manifest(path: Path, edit) -> None:
    """Rewrite ``manifest.ocdbt`` with ``edit(body) -> body`` and a valid CRC (crc32c package)."""
    import crc32c
    import zstandard

    raw = path.read_bytes()
    assert raw[12:14] == b"\x00\x01"  # version 0, zstd
    body = edit(zstandard.ZstdDecompressor().decompress(raw[14:-4]))
    comp = zstandard.ZstdCompressor().compress(body)
    head = raw[:4] + struct.pack("<Q", 14 + len(comp) + 4) + b"\x00\x01"
    out = head + comp
    path.write_bytes(out + struct.pack("<I", crc32c.crc32c(out)))


def test_node_reference_out_of_bounds(jax_fixtures, tmp_path, capsys):
    pytest.importorskip("crc32c")
    step = _copy(jax_fixtures / "orbax_ocdbt_zarr2/A_step10", tmp_path / "10")
    (node,) = (step / "default/d").iterdir()
    size = node.stat().st_size
    # the root reference ends the version entry: ... data_file_id, offset, length, ...; the
    # top-level manifest names one data file (d/<hex>) and one version at offset 0
    name = f"d/{node.name}".encode()

    def edit(body: bytes) -> bytes:
        i = body.index(name) + len(name)
        # num_versions=1, generation (1 byte), root height, file id 0, offset 0, length
        assert body[i] == 1 and body[i + 3 : i + 5] == b"\x00\x00", body[i : i + 8].hex()
        length = _varint(size)
        assert body[i + 5 : i + 5 + len(length)] == length
        return body[: i + 4] + _varint(size - 10) + body[i + 5 :]

    _reencode_manifest(step / "default/manifest.ocdbt", edit)
    _refused(step, capsys, "beyond the file")


def test_missing_and_stray_chunks(jax_fixtures, tmp_path, capsys):
    step = _copy(jax_fixtures / "orbax_no_ocdbt/A_step10", tmp_path / "10")
    leaf = step / "default/model.l2.kernel"
    (leaf / "1.0").write_bytes((leaf / "0.0").read_bytes())
    _refused(step, capsys, "model.l2.kernel/1.0", "not a chunk of its grid")
    (leaf / "1.0").unlink()
    (leaf / "0.0").unlink()
    with dmlib.open_tensors(step) as ts:
        with pytest.raises(DmlibError, match="chunk model.l2.kernel/0.0 is missing"):
            ts["model.l2.kernel"].load()


def test_step_folder_with_two_items(jax_fixtures, tmp_path):
    step = _copy(jax_fixtures / "orbax_ocdbt_zarr2/A_step10", tmp_path / "10")
    _copy(jax_fixtures / "orbax_no_ocdbt/A_step10/default", step / "ema")
    z = np.load(jax_fixtures / "reference/A_step_10.npz")
    with dmlib.open_tensors(step) as ts:
        assert ts.layout["items_read"] == ["default", "ema"]
        assert len(ts) == 2 * len(z.files)
        assert ts["ema.model.l1.kernel"].load().tobytes() == z["model.l1.kernel"].tobytes()
        assert (
            ts["default.model.l1.kernel.value"].load().tobytes() == z["model.l1.kernel"].tobytes()
        )


def test_v1_layout_marker_and_other_checkpointables(jax_fixtures, tmp_path):
    """Orbax's V1 API: a checkpoint folder marked by an empty ``orbax.checkpoint`` file,
    checkpointables in subfolders (``pytree/``, and others that hold no arrays)."""
    from dmlib.io.orbax import step_folders

    ck = tmp_path / "run" / "7"
    _copy(jax_fixtures / "orbax_ocdbt_zarr2/A_step10/default", ck / "pytree")
    (ck / "orbax.checkpoint").write_bytes(b"")
    (ck / "dataset").mkdir()
    (ck / "dataset" / "state.json").write_text("{}")
    z = np.load(jax_fixtures / "reference/A_step_10.npz")
    for path in (ck, ck / "orbax.checkpoint"):
        with dmlib.open_tensors(path) as ts:
            assert ts.layout["items_read"] == ["pytree"]
            assert ts.layout["items_not_read"] == ["dataset"]
            assert ts["model.l3.kernel.value"].load().tobytes() == z["model.l3.kernel"].tobytes()
    assert step_folders(tmp_path / "run") == {7: str(ck)}
    assert step_folders(tmp_path) == {}  # run/ holds checkpoints; it is not one


def test_missing_dependency_names_the_extra(jax_fixtures, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "zstandard", None)
    assert main(["inspect", str(jax_fixtures / "orbax_ocdbt_zarr2/A_step10")]) == 2
    assert "pip install 'dmlib[formats]'" in capsys.readouterr().err


def test_non_array_leaves_are_listed(jax_fixtures, tmp_path, capsys):
    step = _copy(jax_fixtures / "orbax_no_ocdbt/A_step10", tmp_path / "10")
    md_path = step / "default/_METADATA"
    md = json.loads(md_path.read_text())
    md["tree_metadata"]["('note\x1b[2J',)"] = {
        "key_metadata": [{"key": "note\x1b[2J", "key_type": 2}],
        "value_metadata": {"value_type": "string"},
    }
    md_path.write_text(json.dumps(md))
    with dmlib.open_tensors(step) as ts:
        assert ts.layout["not_read"] == {"note\x1b[2J": "string"} and len(ts) == 20
    assert main(["inspect", str(step), "--no-hash"]) == 0
    out = capsys.readouterr().out
    assert "not read: 'note\\x1b[2J' ('string', not an array)" in out and "\x1b" not in out


def test_unknown_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "x").mkdir()
    assert main(["inspect", str(tmp_path / "x")]) == 2
    assert "directory" in capsys.readouterr().err


# ----------------------------------------------------------------------------- written by tensorstore


def _kv(root: Path, path: str, **config) -> dict:
    kv = {"driver": "ocdbt", "base": f"file://{root}/", "path": f"{path}/"}
    if config:
        kv["config"] = config
    return kv


def _ts_write(ts_, root, name, arr, *, chunks, zarr3=None, fill=None, **config):
    """Write ``arr`` with tensorstore (zarr v2 + zstd, or the zarr v3 metadata given) into
    the OCDBT database at ``root``; what tensorstore reads back."""
    meta: dict = {"shape": list(arr.shape)}
    if zarr3:
        meta.update(zarr3)
        driver = "zarr3"
    else:
        # ml_dtypes types (numpy kind 'V') by name, the others by their numpy string
        ml = arr.dtype.kind == "V" or arr.dtype.type.__module__.startswith("ml_dtypes")
        dt = arr.dtype.name if ml else arr.dtype.str
        meta.update(chunks=chunks, dtype=dt, compressor={"id": "zstd", "level": 1})
        if fill is not None:
            meta["fill_value"] = fill
        driver = "zarr"
    spec = {
        "driver": driver,
        "kvstore": _kv(root, name, **config),
        "metadata": meta,
        "create": True,
    }
    ts_.open(spec).result().write(arr).result()
    return ts_.open({"driver": driver, "kvstore": _kv(root, name)}).result().read().result()


def test_many_chunks_and_interior_nodes_against_tensorstore(tmp_path):
    ts_ = pytest.importorskip("tensorstore")
    rng = np.random.default_rng(0)
    a = rng.standard_normal((300, 200)).astype("<f4")
    want = _ts_write(ts_, tmp_path, "big", a, chunks=[8, 8], max_decoded_node_bytes=1024)
    b = rng.integers(-9, 9, (7, 5, 3)).astype("<i8")
    want_b = _ts_write(ts_, tmp_path, "nest/b", b, chunks=[2, 2, 2])
    with dmlib.open_tensors(tmp_path) as ts:
        assert ts.layout["btree_height"] >= 2 and ts.layout["btree_nodes"] > 10
        assert ts.layout["arrays"]["big"]["grid"] == [38, 25]  # edge chunks overhang
        assert ts["big"].load().tobytes() == np.asarray(want).tobytes() == a.tobytes()
        assert ts["nest/b"].load().tobytes() == np.asarray(want_b).tobytes()


@pytest.mark.parametrize(
    "dtype",
    ["bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
     "float8_e4m3b11fnuz", "int4", "<f2", "<f8", ">f4", "|b1", "<u2", "<c8"],
)  # fmt: skip
def test_dtypes_against_tensorstore(tmp_path, dtype):
    ts_ = pytest.importorskip("tensorstore")
    rng = np.random.default_rng(1)
    dt = np.dtype(getattr(ml_dtypes, dtype)) if dtype[0] not in "<>|" else np.dtype(dtype)
    x = rng.standard_normal((5, 3)).astype(dt) if dt.kind != "b" else rng.random((5, 3)) > 0.5
    want = np.asarray(_ts_write(ts_, tmp_path, "x", x, chunks=[2, 2]))
    with dmlib.open_tensors(tmp_path) as ts:
        t = ts["x"]
        got = t.load()
        assert t.shape == (5, 3) and got.dtype.newbyteorder("=") == want.dtype
        assert got.astype(want.dtype).tobytes() == want.tobytes()


def test_scalar_against_tensorstore(tmp_path):
    ts_ = pytest.importorskip("tensorstore")
    want = _ts_write(ts_, tmp_path, "count", np.array(7, "<i4"), chunks=[])
    with dmlib.open_tensors(tmp_path) as ts:
        assert ts["count"].shape == () and ts["count"].load() == np.asarray(want) == 7
        assert ts.scalars["step"] == 7  # optax's count, the only step record here


def test_zarr3_sharded_against_tensorstore(tmp_path):
    ts_ = pytest.importorskip("tensorstore")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((96, 80)).astype(ml_dtypes.bfloat16)
    codec = {
        "name": "sharding_indexed",
        "configuration": {
            "chunk_shape": [16, 16],
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "zstd"}],
            "index_codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "crc32c"},
            ],
        },
    }
    z3 = {
        "data_type": "bfloat16",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [64, 64]}},
        "codecs": [codec],
    }
    want = _ts_write(ts_, tmp_path, "w", x, chunks=None, zarr3=z3)
    with dmlib.open_tensors(tmp_path) as ts:
        assert ts.layout["arrays"]["w"]["grid"] == [2, 2]
        assert ts["w"].load().tobytes() == np.asarray(want).tobytes() == x.tobytes()


@pytest.mark.parametrize("fill", [0, 2.5])
def test_absent_chunks_need_the_writers_word(tmp_path, fill):
    """tensorstore skips chunks equal to the fill value: absent is an error unless
    ``_METADATA`` says such chunks were not stored (then they hold the fill value)."""
    ts_ = pytest.importorskip("tensorstore")
    x = np.full((4, 6), fill, "<f4")
    x[:2, :3] = 1.5
    want = np.asarray(_ts_write(ts_, tmp_path, "w", x, chunks=[2, 3], fill=fill))
    assert want.tobytes() == x.tobytes()
    with dmlib.open_tensors(tmp_path) as ts:
        with pytest.raises(DmlibError, match="chunk w/0.1 is missing"):
            ts["w"].load()
    md = {
        "tree_metadata": {
            "('w',)": {"key_metadata": [{"key": "w", "key_type": 2}],
                       "value_metadata": {"value_type": "np.ndarray"}},
        },
        "store_array_data_equal_to_fill_value": False,
    }  # fmt: skip
    (tmp_path / "_METADATA").write_text(json.dumps(md))
    with dmlib.open_tensors(tmp_path) as ts:
        assert ts["w"].load().tobytes() == want.tobytes()


def test_no_ocdbt_written_by_tensorstore(tmp_path):
    ts_ = pytest.importorskip("tensorstore")
    x = np.arange(60, dtype="<i4").reshape(6, 10)
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": f"{tmp_path}/item/w/"},
        "metadata": {"shape": [6, 10], "chunks": [4, 4], "dtype": "<i4", "compressor": None,
                     "dimension_separator": "/"},
        "create": True,
    }  # fmt: skip
    ts_.open(spec).result().write(x).result()
    md = {
        "tree_metadata": {
            "('w',)": {
                "key_metadata": [{"key": "w"}],
                "value_metadata": {"value_type": "np.ndarray"},
            }
        }
    }
    (tmp_path / "item" / "_METADATA").write_text(json.dumps(md))
    with dmlib.open_tensors(tmp_path / "item") as ts:
        assert ts.layout["layout"] == "orbax-zarr-dirs"
        assert ts["w"].load().tobytes() == x.tobytes()


def test_zstd_output_is_bounded_without_a_content_size():
    zstandard = pytest.importorskip("zstandard")
    from dmlib.io.ocdbt import zstd_decompress

    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(8 << 20))
    assert len(bomb) < 4096
    with pytest.raises(DmlibError, match="more than 1048576 bytes"):
        zstd_decompress(bomb, 1 << 20, "node", "x")
    sized = zstandard.ZstdCompressor().compress(bytes(8 << 20))
    with pytest.raises(DmlibError, match="claims 8388608 bytes"):
        zstd_decompress(sized, 1 << 20, "node", "x")
    assert zstd_decompress(bomb, 8 << 20, "node", "x") == bytes(8 << 20)


def test_fill_value_spellings():
    from dmlib.io.zarr_ import ZarrArray, _fill_value

    def fill(dtype, v):
        return _fill_value(ZarrArray("x", 3, (1,), np.dtype(dtype), (1,), fill=v), "p")

    assert fill(ml_dtypes.bfloat16, "0x3fc0").astype(np.float32) == 1.5  # 0 01111111 1000000
    assert np.isnan(fill("<f4", "NaN")) and fill("<f8", "-Infinity") == -np.inf
    assert fill("<i4", None) == 0 and fill("<u2", 7) == 7
    with pytest.raises(DmlibError, match="fill_value"):
        fill("<f4", "not a number")
    # a number its dtype cannot hold is refused, never wrapped or rounded to another value
    for dtype, v in (("u1", 300), ("u1", -1), ("<i4", 1.5), ("|b1", 2), ("<f4", 1e300),
                     ("<f2", 70000.0), (ml_dtypes.bfloat16, 1e300), ("<f8", 10**400)):  # fmt: skip
        with pytest.raises(DmlibError, match="is not a value of"):
            fill(dtype, v)
    assert fill("<i4", 2.0) == 2 and fill("<f4", 1e-300) == 0.0  # exact; an underflow to 0


# ----------------------------------------------------------------------------- a database built by hand
# (encodings of tensorstore's OCDBT format description: uncompressed nodes, one data file)


def _frame(magic: int, body: bytes) -> bytes:
    import crc32c

    out = struct.pack(">I", magic) + struct.pack("<Q", 14 + len(body) + 4) + b"\x00\x00" + body
    return out + struct.pack("<I", crc32c.crc32c(out))


def _table(paths: list[bytes]) -> bytes:
    out = _varint(len(paths)) + b"".join(_varint(0) for _ in paths[1:])
    out += b"".join(_varint(len(p)) for p in paths) + b"".join(_varint(0) for _ in paths)
    return out + b"".join(paths)


def _keys(ks: list[bytes], common: list[int] | None = None) -> bytes:
    out = b"".join(_varint(0) for _ in ks[1:]) + b"".join(_varint(len(k)) for k in ks)
    out += b"".join(_varint(c) for c in common or [])
    return out + b"".join(ks)


def _leaf(items: list[tuple[bytes, bytes]]) -> bytes:
    body = b"\x00" + _table([]) + _varint(len(items)) + _keys([k for k, _ in items])
    body += b"".join(_varint(len(x)) for _, x in items) + b"".join(_varint(0) for _ in items)
    return _frame(0x0CDB20DE, body + b"".join(x for _, x in items))


def _interior(entries: list[tuple[bytes, int, int, int, int]], path: bytes) -> bytes:
    """entries: (key, subtree common prefix length, offset, length, keys below)."""
    body = b"\x01" + _table([path]) + _varint(len(entries))
    body += _keys([e[0] for e in entries], [e[1] for e in entries])
    zeros = [0] * len(entries)
    for col in (zeros, [e[2] for e in entries], [e[3] for e in entries],
                [e[4] for e in entries], [e[3] for e in entries], zeros):  # fmt: skip
        body += b"".join(_varint(c) for c in col)
    return _frame(0x0CDB20DE, body)


def _manifest(path: bytes, off: int, length: int, height: int, nkeys: int) -> bytes:
    body = bytes(16) + _varint(0) + _varint(100) + _varint(1 << 23) + b"\x04" + _varint(0)
    body += _table([path]) + _varint(1) + _varint(1) + bytes([height]) + _varint(0)
    body += _varint(off) + _varint(length) + _varint(nkeys) + _varint(length) + _varint(0)
    return _frame(0x0CDB3A2A, body + struct.pack("<Q", 0) + _varint(0))


def test_a_node_shared_by_three_parents(tmp_path, monkeypatch):
    """The format lets several interior entries point at one node (each adding its own key
    prefix): read once, its keys under every prefix, as tensorstore reads them."""
    pytest.importorskip("crc32c")
    ts_ = pytest.importorskip("tensorstore")
    lf = _leaf([(b"x", b"1"), (b"y", b"22")])
    entries = [(k, 1, 0, len(lf), 2) for k in (b"a", b"b", b"cq")]
    root = _interior(entries, b"d/f")
    (tmp_path / "d").mkdir()
    (tmp_path / "d/f").write_bytes(lf + root)
    (tmp_path / "manifest.ocdbt").write_bytes(_manifest(b"d/f", len(lf), len(root), 1, 6))
    kv = ts_.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/"}).result()
    want = {k.decode(): kv.read(k).result().value for k in kv.list().result()}
    assert want == {"ax": b"1", "ay": b"22", "bx": b"1", "by": b"22", "cx": b"1", "cy": b"22"}
    from dmlib.io import ocdbt

    db = ocdbt.open_store(tmp_path)
    assert {k: db.get(k) for k in db.keys} == want and db.nodes == 2 and db.height == 1
    # the entries visited over all paths are bounded (here: 4 + 3 x 3)
    monkeypatch.setattr(ocdbt, "_MAX_ENTRIES", 12)
    with pytest.raises(DmlibError, match="visits more than 12 entries"):
        ocdbt.open_store(tmp_path)
    # a child reference past the end of its file
    bad = _interior([(b"a", 1, 0, len(lf) + 50, 2)], b"d/f")
    (tmp_path / "d/f").write_bytes(lf + bad)
    (tmp_path / "manifest.ocdbt").write_bytes(_manifest(b"d/f", len(lf), len(bad), 1, 2))
    with pytest.raises(DmlibError, match="child 0 at d/f"):
        ocdbt.open_store(tmp_path)
    # a data file path leaving the database folder
    (tmp_path / "manifest.ocdbt").write_bytes(_manifest(b"../f", 0, len(lf), 0, 2))
    with pytest.raises(DmlibError, match="not a plain relative path"):
        ocdbt.open_store(tmp_path)


def test_a_key_joined_from_its_levels_prefixes_is_bounded(tmp_path):
    """An interior entry's subtree prefix is joined to every key below it: a full key longer
    than 64 KiB (no real key comes near) is refused before it is made."""
    pytest.importorskip("crc32c")
    from dmlib.io import ocdbt

    lf = _leaf([(b"x", b"1")])
    (tmp_path / "d").mkdir()
    for width, ok in ((1 << 16) - 1, True), (1 << 16, False):
        root = _interior([(b"k" * width, width, 0, len(lf), 1)], b"d/f")
        (tmp_path / "d/f").write_bytes(lf + root)
        (tmp_path / "manifest.ocdbt").write_bytes(_manifest(b"d/f", len(lf), len(root), 1, 1))
        if ok:
            assert list(ocdbt.open_store(tmp_path).keys) == ["k" * width + "x"]
        else:
            with pytest.raises(DmlibError, match=f"a key of {width + 1} bytes"):
                ocdbt.open_store(tmp_path)


def test_a_nul_in_a_data_file_path_or_a_leaf_name_is_refused(tmp_path):
    """Found by the fuzz target: a path with a NUL byte made os.path.realpath raise ValueError."""
    pytest.importorskip("crc32c")
    from dmlib.io import ocdbt

    lf = _leaf([(b"x", b"1")])
    (tmp_path / "d").mkdir()
    (tmp_path / "d/f").write_bytes(lf)
    (tmp_path / "manifest.ocdbt").write_bytes(_manifest(b"d/\x00f", 0, len(lf), 0, 1))
    with pytest.raises(DmlibError, match="not a plain relative path"):
        ocdbt.open_store(tmp_path)
    item = tmp_path / "item"
    item.mkdir()
    md = {"tree_metadata": {"x": {"key_metadata": [{"key": "w\x00"}],
                                  "value_metadata": {"value_type": "np.ndarray"}}}}  # fmt: skip
    (item / "_METADATA").write_text(json.dumps(md))
    with pytest.raises(DmlibError, match="not a plain relative path"):
        dmlib.open_tensors(item)
