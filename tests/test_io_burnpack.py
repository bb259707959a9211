"""Burnpack reading and writing against Burn's own files and against generated ones."""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import pytest

import dmlib
from dmlib.io import burnpack
from dmlib.io.burnpack import BurnTensor, encode_burnpack, write_records

MNIST_SHA256 = "b63e660152b3865b1b630c97af6df1fcbc04206648d3a03b3636fcc795ecc472"  # fixtures README


def test_mnist_fixture_matches_its_readme(burnpack_fixtures):
    path = burnpack_fixtures / "mnist-model.bpk"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == MNIST_SHA256
    with dmlib.open_tensors(path) as ts:
        assert ts.format == "burnpack"
        assert len(ts) == 18
        assert all(t.dtype == np.float32 and t.param_id is not None for t in ts.values())
        assert ts.metadata == {} and ts.scalars == {}
        assert ts.layout["layout"] == "aligned"
        assert ts.layout["metadata_size"] == 1398
        assert ts.layout["data_base"] == 1536
        w = ts["conv1.conv.weight"]
        assert w.shape == (64, 1, 3, 3)
        assert w.offset == 1536 + 0 and w.nbytes == 2304
        np.testing.assert_allclose(w.load().ravel()[:3], [-0.14137, -0.30972, -0.33344], atol=5e-6)
        # the file ends exactly at D + 1,043,240 (FORMATS.md)
        assert (
            max(t.offset + t.nbytes for t in ts.values()) == 1536 + 1_043_240 == path.stat().st_size
        )
        # Burn stores Linear weights [d_input, d_output]; all fc tensors present
        assert {f"fc{i}.{p}" for i in (1, 2, 3) for p in ("weight", "bias")} <= set(ts)
        census = dmlib.padding_census(ts)
        gap = census.gaps.iloc[0]
        assert (gap["kind"], gap["nbytes"], bool(gap["zero"])) == ("after-metadata", 128, True)
        assert len(census.gaps) == 1


def test_case_a_names_dtypes_values(burnpack_fixtures):
    ts = dmlib.open_tensors(burnpack_fixtures / "case_a.bpk")
    assert sorted(ts) == ["alpha.mask", "empty", "mid.h", "u32", "zeta.w"]
    np.testing.assert_array_equal(ts["zeta.w"].load(), np.array([1, 2, 3], np.float32))
    assert ts["zeta.w"].param_id == 1
    assert ts["alpha.mask"].dtype == np.bool_ and ts["alpha.mask"].dtype_name == "Bool(Native)"
    assert list(ts["alpha.mask"].load()[:3]) == [True, False, True]
    assert (
        ts["empty"].dtype == np.int64
        and ts["empty"].shape == (0, 4)
        and ts["empty"].load().size == 0
    )
    mid = ts["mid.h"].load()
    assert mid.dtype == np.dtype(ml_dtypes.bfloat16) and mid.shape == (2, 3)
    np.testing.assert_array_equal(
        mid.astype(np.float32), np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    )
    assert ts["u32"].load().tolist() == [7] and ts["u32"].dtype == np.uint32
    assert ts.metadata == {"format": "burnpack", "producer": "burn"}
    assert ts.scalars == {"flag": False, "lr": 0.001, "neg": -3, "step": 42}
    assert ts.scalar_kinds == {"flag": "Bool", "lr": "Float", "neg": "Int", "step": "UInt"}


def test_case_b_and_c(burnpack_fixtures):
    b = dmlib.open_tensors(burnpack_fixtures / "case_b_empty.bpk")
    assert len(b) == 0 and b.layout["data_base"] == 256
    c = dmlib.open_tensors(burnpack_fixtures / "case_c_zero_last.bpk")
    assert c["a"].load().tolist() == [9, 8, 7] and c["a"].offset == 256
    assert c["b"].shape == (0,) and c["b"].dtype == np.float16 and c["b"].offset == 256 + 256


@pytest.mark.parametrize("name", ["mnist-model", "case_a", "case_b_empty", "case_c_zero_last"])
def test_fixtures_round_trip_byte_for_byte(burnpack_fixtures, tmp_path, name):
    src = burnpack_fixtures / f"{name}.bpk"
    with dmlib.open_tensors(src) as ts:
        out = tmp_path / "copy.bpk"
        dmlib.write_burnpack(out, ts)
    assert out.read_bytes() == src.read_bytes()


def test_reader_is_read_only(burnpack_fixtures):
    ts = dmlib.open_tensors(burnpack_fixtures / "case_a.bpk")
    arr = ts["zeta.w"].load()
    with pytest.raises(ValueError):
        arr[0] = 5.0
    assert not ts["zeta.w"].raw().flags.writeable


def _sample_tensors():
    rng = np.random.default_rng(0)
    return {
        "b.weight": BurnTensor(rng.standard_normal((5, 3)).astype(np.float32), param_id=11),
        "a.bias": BurnTensor(np.arange(7, dtype=np.float64), param_id=12),
        "c.half": np.arange(3, dtype=np.float16),
        "d.mask": np.array([True, False, True]),
        "e.idx": np.array([-1, 2, 3], dtype=np.int32),
    }


def test_generated_aligned_layout_rules(tmp_path):
    data = encode_burnpack(_sample_tensors(), metadata={"k": "v"}, scalars={"step": 5})
    p = tmp_path / "x.bpk"
    p.write_bytes(data)
    ts = dmlib.open_tensors(p)
    d = ts.layout["data_base"]
    assert d % 256 == 0 and d >= 10 + ts.layout["metadata_size"]
    offsets = [t.offset - d for t in ts.disk_order()]
    assert all(o % 256 == 0 for o in offsets)
    # disk order is input order; the CBOR name map is sorted
    assert [t.name for t in ts.disk_order()] == list(_sample_tensors())
    last = ts.disk_order()[-1]
    assert p.stat().st_size == last.offset + last.nbytes
    for name, v in _sample_tensors().items():
        ref = v.data if isinstance(v, BurnTensor) else v
        np.testing.assert_array_equal(ts[name].load(), ref)
    assert ts.scalars == {"step": 5} and ts.scalar_kinds == {"step": "UInt"}


def test_legacy_unaligned_layout_is_solved_and_reported(tmp_path):
    tensors = _sample_tensors()
    p = tmp_path / "legacy.bpk"
    p.write_bytes(encode_burnpack(tensors, layout="legacy-unaligned"))
    ts = dmlib.open_tensors(p)
    assert ts.layout["layout"] == "legacy-unaligned"
    assert ts.layout["data_base"] == 10 + ts.layout["metadata_size"]
    for name, v in tensors.items():
        ref = v.data if isinstance(v, BurnTensor) else v
        np.testing.assert_array_equal(ts[name].load(), ref)
    # the rewrite reproduces the legacy bytes
    assert encode_burnpack(ts, layout="legacy-unaligned") == p.read_bytes()


def test_legacy_bytes_shifted_by_the_wrong_base_are_refused(tmp_path):
    """Appending zero bytes so the aligned base would 'fit' length-wise must not yield shifted data."""
    p = tmp_path / "legacy.bpk"
    raw = encode_burnpack({"w": np.arange(64, dtype=np.float32)}, layout="legacy-unaligned")
    msize = int.from_bytes(raw[6:10], "little")
    pad = burnpack.align_up(10 + msize) - (10 + msize)
    if pad == 0:
        pytest.skip("metadata happens to end on a 256-byte boundary")
    # pretend to be aligned: the file is now exactly D_aligned + 256 long, so the aligned
    # base fits by length, but the "header padding" holds the first tensor bytes
    p.write_bytes(raw + bytes(pad))
    with pytest.raises(dmlib.LayoutError, match="ambiguous"):
        dmlib.open_tensors(p)


def test_multi_record_file_with_dirty_padding(tmp_path):
    model = {"w": np.ones((3, 5), np.float32), "b": np.zeros(3, np.float32)}
    optim = {"m.w": np.full((3, 5), 2.0, np.float32), "v.w": np.full((3, 5), 3.0, np.float32)}
    ema = {"w": np.full((3, 5), 4.0, np.float32), "b": np.ones(3, np.float32)}
    nan_word = np.array([np.nan], np.float32).tobytes()
    huge_word = np.array([3e38], np.float32).tobytes()

    planted = {"nan": 0, "huge": 0, "nonzero": 0}

    def dirty(offset: int, n: int) -> bytes:
        # first word NaN, second 3e38, rest zero: ground truth counted as we go
        words = n // 4
        out = bytearray(n)
        if words >= 1:
            out[0:4] = nan_word
            planted["nan"] += 1
            planted["nonzero"] += 1
        if words >= 2:
            out[4:8] = huge_word
            planted["huge"] += 1
            planted["nonzero"] += 1
        return bytes(out)

    recs = [
        encode_burnpack(model, pad_fill=dirty),
        encode_burnpack(optim),
        encode_burnpack(ema, pad_fill=dirty),
    ]
    p = tmp_path / "records.bpk"
    write_records(p, recs)
    ts = dmlib.open_tensors(p)
    assert len(ts.records) == 3
    assert [len(r) for r in ts.records] == [2, 2, 2]
    assert set(ts) == {"w", "b", "record1/m.w", "record1/v.w", "record2/w", "record2/b"}
    np.testing.assert_array_equal(ts["record2/w"].load(), ema["w"])
    np.testing.assert_array_equal(ts.records[1]["v.w"].load(), optim["v.w"])
    r2 = dmlib.open_tensors(p, record=2)
    np.testing.assert_array_equal(r2["b"].load(), ema["b"])
    starts = [r.start for r in ts.records]
    assert starts[0] == 0 and all(s % 256 == 0 for s in starts)
    assert all(ts.records[i].end <= starts[i + 1] for i in range(2))
    c = dmlib.padding_census(ts)
    tensor_gaps = c.gaps[c.gaps.kind == "between-tensors"]
    assert int(tensor_gaps.nan.sum()) == planted["nan"] == 2
    assert int(tensor_gaps.huge.sum()) == planted["huge"] == 2
    assert int(c.slots.padding_nonzero_slots.sum()) == planted["nonzero"] == 4
    # flat = named + padding for an all-f32 record
    for row in c.slots.itertuples():
        assert row.flat_slots == row.named_slots + row.padding_slots
    assert int(c.slots.loc[0, "named_slots"]) == 15 + 3
    assert not c.clean


def test_data_hash_ignores_param_id_and_metadata(tmp_path):
    arr = np.arange(10, dtype=np.float32)
    a, b = tmp_path / "a.bpk", tmp_path / "b.bpk"
    dmlib.write_burnpack(a, {"w": BurnTensor(arr, param_id=1)}, metadata={"run": "a"})
    dmlib.write_burnpack(b, {"w": BurnTensor(arr, param_id=2)}, metadata={"run": "b"})
    ta, tb = dmlib.open_tensors(a), dmlib.open_tensors(b)
    assert ta.file_hash() != tb.file_hash()
    assert ta.data_hash() == tb.data_hash() == hashlib.sha256(arr.tobytes()).hexdigest()
    assert ta["w"].data_hash() == hashlib.sha256(arr.tobytes()).hexdigest()


def test_float_scalars_use_shortest_lossless_width():
    from dmlib.io import cbor

    assert cbor.encode(1.5) == b"\xf9\x3e\x00"  # exact in f16
    assert cbor.encode(0.001)[:1] == b"\xfb"  # needs f64
    assert cbor.encode(float(np.float32(0.1)))[:1] == b"\xfa"  # exact in f32
    assert cbor.encode(-3) == b"\x22"
    assert cbor.encode(42) == b"\x18\x2a"


def test_table_keeps_u64_param_ids_exact(burnpack_fixtures):
    table = dmlib.open_tensors(burnpack_fixtures / "case_a.bpk").table().set_index("name")
    assert (
        int(table.loc["empty", "param_id"]) == 2**64 - 1
    )  # 18446744073709551615 in the README's file
    assert int(table.loc["mid.h", "param_id"]) == 12345678901234
