"""dmlib.compare / summarize / ulp_long: hand-computed tables and planted differences."""

from __future__ import annotations

import hashlib
import math

import blake3
import ml_dtypes
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dmlib
from dmlib.sources import select
from dmlib.stats.compare import ULP_COLUMNS, compare, summarize, ulp_long
from dmlib.tensor import ArrayTensorSet, Tensor, TensorSet


def f32(bits: int) -> float:
    return float(np.array([bits], np.uint32).view(np.float32)[0])


def sha(x: np.ndarray | bytes) -> str:
    """The default identity hash of small data: plain BLAKE3 (one piece), named."""
    data = x if isinstance(x, bytes) else np.ascontiguousarray(x).tobytes()
    return "blake3-64MiB:" + blake3.blake3(data).hexdigest()


def one(a: np.ndarray, b: np.ndarray, **kw) -> dict:
    df = compare(ArrayTensorSet({"t": a}), ArrayTensorSet({"t": b}), **kw)
    assert len(df) == 1
    return df.iloc[0].to_dict()


# ---------------------------------------------------------------------------------------
# one float32 tensor exercising every column, expectations worked out by hand

A_BITS = [
    0x3F800000,
    0x40000000,
    0x00000000,
    0x40800000,
    0x7FC00000,
    0x7FC00000,
    0x7F800000,
    0x41000000,
    0x7FC00000,
    0x41200000,
]
B_BITS = [
    0x3F800000,
    0x40000001,
    0x80000000,
    0x40800003,
    0x7FC00001,
    0x3F800000,
    0xFF800000,
    0x41000000,
    0x7FC00000,
    0x41400000,
]
#          1 = 1       2 -> +1ulp  +0 -> -0    4 -> +3ulp  NaN payload NaN vs 1.0  +inf/-inf   8 = 8       same NaN    10 -> 12


def test_every_column_by_hand():
    a = np.array(A_BITS, np.uint32).view(np.float32).reshape(2, 5)
    b = np.array(B_BITS, np.uint32).view(np.float32).reshape(2, 5)
    r = one(a, b)
    assert (r["name"], r["dtype"], r["shape"], r["numel"]) == ("t", "float32", [2, 5], 10)
    assert r["n_diff"] == 7
    assert r["frac_diff"] == 0.7
    assert r["max_abs"] == 2.0  # 12 - 10
    # finite differing pairs: 1, 0, 3 and 10 -> 12 = 2**21 ULP (mantissa .25 -> .5 at 2**3)
    assert r["max_ulp"] == 2**21
    assert r["median_ulp"] == 2.0  # of [0, 1, 3, 2**21]
    expected_hist = {c: 0 for c in ULP_COLUMNS}
    expected_hist.update(ulp_0=1, ulp_1=1, ulp_3_4=1, ulp_gt_65536=1, ulp_nonfinite=3)
    assert {c: r[c] for c in ULP_COLUMNS} == expected_hist
    assert (r["n_nan_payload"], r["n_nan_vs_num"], r["n_signed_zero"], r["n_inf_mismatch"]) == (
        1,
        1,
        1,
        1,
    )
    # norms over pairs finite on both sides: elements 0, 1, 2, 3, 7, 9
    av = [1.0, 2.0, 0.0, 4.0, 8.0, 10.0]
    bv = [1.0, f32(0x40000001), 0.0, f32(0x40800003), 8.0, 12.0]
    diff2 = sum((x - y) ** 2 for x, y in zip(av, bv, strict=True))
    assert diff2 == 4 + 2.0**-44 + 9 * 2.0**-42
    assert r["rel_fro"] == pytest.approx(math.sqrt(diff2) / math.sqrt(185.0), rel=1e-15)
    dot = sum(x * y for x, y in zip(av, bv, strict=True))
    nb = math.sqrt(sum(y * y for y in bv))
    assert r["cosine"] == pytest.approx(dot / (math.sqrt(185.0) * nb), rel=1e-15)
    assert r["first_diff"] == (0, 1)
    assert r["data_hash_a"] == sha(a) and r["data_hash_b"] == sha(b)


@pytest.mark.parametrize("chunk", [4, 8, 12, 40, 1 << 20])
def test_chunking_changes_nothing(chunk):
    a = np.array(A_BITS, np.uint32).view(np.float32)
    b = np.array(B_BITS, np.uint32).view(np.float32)
    base = one(a, b)
    got = one(a, b, chunk_bytes=chunk)
    assert {k: v for k, v in got.items() if k != "rel_fro" and k != "cosine"} == {
        k: v for k, v in base.items() if k != "rel_fro" and k != "cosine"
    }
    assert got["rel_fro"] == pytest.approx(base["rel_fro"], rel=1e-14)


def plant(base: np.ndarray, where: dict[int, int]) -> np.ndarray:
    """Copy of positive ``base`` with element i moved up by k ULP (bit increments)."""
    out = base.copy()
    bits = out.view(np.uint32 if base.dtype == np.float32 else np.uint64).reshape(-1)
    for i, k in where.items():
        bits[i] += k
    return out


def test_planted_ulps_across_chunk_edges():
    rng = np.random.default_rng(1)
    a = rng.uniform(1.0, 2.0, 1000).astype(np.float32)  # one binade: 1 ULP = 2**-23
    # chunk of 16 bytes = 4 elements: 3|4, 7|8 straddle edges, 999 is the last element
    where = {3: 1, 4: 2, 7: 5, 8: 100, 500: 70000, 999: 3_000_000}
    b = plant(a, where)
    r = one(a, b, chunk_bytes=16)
    assert r["n_diff"] == 6
    assert r["first_diff"] == (3,)
    assert r["max_ulp"] == 3_000_000
    assert r["median_ulp"] == (5 + 100) / 2
    assert (r["ulp_1"], r["ulp_2"], r["ulp_5_8"], r["ulp_65_128"], r["ulp_gt_65536"]) == (
        1,
        1,
        1,
        1,
        2,
    )
    assert sum(r[c] for c in ULP_COLUMNS) == 6
    # planted values stay inside [1, 2) except possibly the largest move: compute exactly
    moved = b.astype(np.float64) - a.astype(np.float64)
    assert r["max_abs"] == np.max(np.abs(moved))
    assert r["data_hash_b"] == sha(b)


def test_exact_median_above_the_exact_counts():
    a = np.ones(9, np.float64)
    # median of [1, 2, 2**40 + 7, 2**40 + 9, 2**50] is 2**40 + 7; two rescans narrow to it
    b = plant(a, {0: 1, 2: 2, 4: 2**40 + 7, 6: 2**40 + 9, 8: 2**50})
    r = one(a, b, chunk_bytes=24)
    assert r["median_ulp"] == 2**40 + 7
    assert r["max_ulp"] == 2**50
    a32 = np.ones(4, np.float32)
    b32 = plant(a32, {0: 70_001, 1: 70_003, 2: 90_000, 3: 1})
    assert one(a32, b32)["median_ulp"] == (70_001 + 70_003) / 2


def test_identical_tensor():
    a = np.linspace(-3, 3, 101, dtype=np.float32)
    r = one(a, a.copy())
    assert (
        r["n_diff"],
        r["max_abs"],
        r["max_ulp"],
        r["rel_fro"],
        r["cosine"],
        r["first_diff"],
    ) == (0, 0.0, 0, 0.0, 1.0, None)
    assert pd.isna(r["median_ulp"])
    assert r["data_hash_a"] == r["data_hash_b"] == sha(a)


def test_hash_split_after_identical_prefix():
    a = np.arange(64, dtype=np.float32)
    b = a.copy()
    b[50] = 7.5  # chunks before it are identical: b's hash must still cover them
    r = one(a, b, chunk_bytes=32)
    assert r["data_hash_a"] == sha(a) and r["data_hash_b"] == sha(b)


@pytest.mark.parametrize(
    ("a", "b", "rel_fro", "cosine"),
    [
        ([0.0, 0.0], [0.0, 0.0], 0.0, 1.0),  # both zero: equal, rel 0, cosine 1
        ([0.0, 0.0], [0.0, 2.0], math.inf, 0.0),  # zero reference, b not: inf
        ([3.0, 0.0], [0.0, 0.0], 1.0, 0.0),  # ||a-b|| = ||a||; one zero vector: cosine 0
        ([3.0, 4.0], [-3.0, -4.0], 2.0, -1.0),
        ([0.0, -0.0], [-0.0, 0.0], 0.0, 1.0),  # only signed zeros differ
    ],
)
def test_zero_norms(a, b, rel_fro, cosine):
    r = one(np.array(a, np.float32), np.array(b, np.float32))
    assert r["rel_fro"] == rel_fro
    assert r["cosine"] == cosine


def test_bfloat16_and_float8():
    bf = np.dtype(ml_dtypes.bfloat16)
    a = np.array([0x3F80, 0x4000, 0xC040], np.uint16).view(bf)  # 1, 2, -3
    b = np.array([0x3F81, 0x4000, 0xC042], np.uint16).view(
        bf
    )  # +1 ULP (2**-7), -, -3 - 2 ULP (2 * 2**-6)
    r = one(a, b)
    assert (r["n_diff"], r["max_ulp"], r["median_ulp"], r["max_abs"]) == (2, 2, 1.5, 2 * 2.0**-6)
    assert r["dtype"] == "bfloat16"
    e4 = np.dtype(ml_dtypes.float8_e4m3fn)
    a = np.array([0x38, 0x7E, 0x7F, 0x00], np.uint8).view(e4)  # 1.0, 448, NaN, +0
    b = np.array([0x3A, 0x7F, 0x7F, 0x80], np.uint8).view(e4)  # 1.25, NaN, same NaN, -0
    r = one(a, b)
    assert (r["n_diff"], r["max_ulp"], r["max_abs"]) == (3, 2, 0.25)
    assert (r["n_nan_vs_num"], r["n_signed_zero"], r["ulp_nonfinite"], r["ulp_0"], r["ulp_2"]) == (
        1,
        1,
        1,
        1,
        1,
    )
    # rel_fro over finite pairs (1, +0): ||a|| = 1, ||a - b|| = 0.25
    assert r["rel_fro"] == 0.25
    e5 = np.dtype(ml_dtypes.float8_e5m2)
    r = one(
        np.array([0x7C, 0x3C], np.uint8).view(e5), np.array([0x7B, 0x3C], np.uint8).view(e5)
    )  # inf vs 57344
    assert (r["n_inf_mismatch"], r["ulp_nonfinite"], r["max_ulp"], r["max_abs"]) == (1, 1, 0, 0.0)


@pytest.mark.parametrize(
    ("a", "b", "n_diff", "max_abs", "first"),
    [
        (np.array([1, -5, 7], np.int32), np.array([1, 5, 7], np.int32), 1, 10.0, (1,)),
        (np.array([0, 255], np.uint8), np.array([255, 0], np.uint8), 2, 255.0, (0,)),
        (
            np.array([-(2**63)], np.int64),
            np.array([2**63 - 1], np.int64),
            1,
            float(2**64 - 1),
            (0,),
        ),
        (
            np.array([2**64 - 1, 3], np.uint64),
            np.array([0, 3], np.uint64),
            1,
            float(2**64 - 1),
            (0,),
        ),
        (
            np.array([[True, False], [True, True]]),
            np.array([[True, True], [False, True]]),
            2,
            1.0,
            (0, 1),
        ),
        (np.array([4, 5], np.int16), np.array([4, 5], np.int16), 0, 0.0, None),
    ],
)
def test_integers_and_bools(a, b, n_diff, max_abs, first):
    r = one(a, b, chunk_bytes=2)
    assert (r["n_diff"], r["max_abs"], r["first_diff"]) == (n_diff, max_abs, first)
    assert r["frac_diff"] == n_diff / a.size
    for col in ["max_ulp", "ulp_1", "ulp_nonfinite", "n_nan_payload"]:
        assert pd.isna(r[col])
    assert math.isnan(r["rel_fro"]) and math.isnan(r["cosine"])


def test_names_shapes_dtypes_never_crash():
    a = ArrayTensorSet(
        {
            "same": np.ones(3, np.float32),
            "shape": np.ones(4, np.float32),
            "dt": np.ones(2, np.float32),
            "only_a": np.ones(1),
        }
    )
    b = ArrayTensorSet(
        {
            "same": np.ones(3, np.float32),
            "shape": np.ones((2, 2), np.float32),
            "dt": np.ones(2, np.int32),
            "only_b": np.ones(1),
        }
    )
    df = compare(a, b)
    assert list(df["name"]) == ["same"]
    assert df.attrs["only_in_a"] == ["only_a"] and df.attrs["only_in_b"] == ["only_b"]
    mism = {m["name"]: m for m in df.attrs["mismatched"]}
    assert mism["shape"]["shape_a"] == [4] and mism["shape"]["shape_b"] == [2, 2]
    assert (mism["dt"]["dtype_a"], mism["dt"]["dtype_b"]) == ("float32", "int32")
    s = summarize(df)
    assert s["n_diff"] == 0 and s["identical"] is False
    assert s["mismatched"] == ["shape", "dt"]
    # the bit-identical part alone is identical
    assert summarize(compare(a, b, include="same"))["identical"] is True


def test_summarize_by_hand():
    a = ArrayTensorSet(
        {"x": np.ones(10, np.float32), "y": np.zeros(6, np.float32), "i": np.arange(4)}
    )
    b = ArrayTensorSet(
        {
            "x": plant(np.ones(10, np.float32), {2: 3, 3: 1}),
            "y": np.array([0, 0, 0, 0, 0, 0.5], np.float32),
            "i": np.arange(4),
        }
    )
    s = summarize(compare(a, b))
    assert (s["n_tensors"], s["numel"], s["n_diff"], s["n_tensors_diff"]) == (3, 20, 3, 2)
    assert s["frac_diff"] == 3 / 20
    assert s["worst_rel_fro"] == math.inf and s["worst_rel_fro_name"] == "y"  # zero reference
    assert s["max_ulp_name"] == "y"  # 0 -> 0.5 is 0x3F000000 ULP
    assert s["max_ulp"] == 0x3F000000
    assert s["identical"] is False
    same = summarize(compare(a, a))
    assert same["identical"] is True and same["n_diff"] == 0 and same["worst_rel_fro_name"] is None


def test_metadata_and_param_ids():
    def ts(pids, meta):
        arrs = {"w": np.ones(2, np.float32), "v": np.zeros(2, np.float32)}
        tensors = {
            n: Tensor(n, a.dtype, a.shape, nbytes=a.nbytes, source=a, param_id=p)
            for (n, a), p in zip(arrs.items(), pids, strict=True)
        }
        return TensorSet(tensors, metadata=meta, scalars={"step": 0})

    df = compare(
        ts([1, 2], {"k": "x", "same": "s"}),
        ts([1, 9], {"k": "y", "same": "s", "new": "n"}),
        file_hashes=True,
    )
    assert df.attrs["param_id_diff"] == {"v": [2, 9]}
    assert df.attrs["metadata_diff"] == {"k": ["x", "y"], "new": [None, "n"]}
    assert df.attrs["scalars_diff"] == {}
    assert summarize(df)["identical"] is True  # data identical though the metadata is not
    assert df.attrs["data_section_hash_a"] == df.attrs["data_section_hash_b"]


def test_include_exclude():
    names = ["factors.0.u", "factors.0.v", "embed.weight", "factors.1.u"]
    assert select(names, "re:^factors\\.") == ["factors.0.u", "factors.0.v", "factors.1.u"]
    assert select(names, "*.u") == ["factors.0.u", "factors.1.u"]
    assert select(names, exclude=["*.u", "re:embed"]) == ["factors.0.v"]
    assert select(names, ["embed.*", "*.v"], exclude="re:\\.0\\.") == ["embed.weight"]
    with pytest.raises(dmlib.DmlibError, match="regular expression"):
        select(names, "re:(")


def test_ulp_long():
    a = ArrayTensorSet({"x": np.ones(4, np.float32), "i": np.arange(3)})
    b = ArrayTensorSet({"x": plant(np.ones(4, np.float32), {0: 1, 1: 6}), "i": np.arange(3)})
    long = ulp_long(compare(a, b))
    assert set(long["name"]) == {"x"}  # integer rows have no histogram
    assert len(long) == len(ULP_COLUMNS)
    got = dict(zip(long["bucket"].astype(str), long["count"], strict=True))
    assert got["ulp_1"] == 1 and got["ulp_5_8"] == 1 and sum(got.values()) == 2
    row = long[long["bucket"] == "ulp_5_8"].iloc[0]
    assert (row["ulp_lo"], row["ulp_hi"]) == (5, 8)


def test_files_with_planted_differences(tmp_path):
    rng = np.random.default_rng(7)
    tensors = {
        "layer.0.w": rng.uniform(1, 2, (64, 33)).astype(np.float32),
        "layer.0.b": rng.uniform(1, 2, 33).astype(np.float32),
        "step": np.array([5], np.int64),
        "mask": rng.integers(0, 2, 17).astype(bool),
    }
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    dmlib.write_safetensors(pa, tensors, metadata={"run": "a"})
    other = {k: v.copy() for k, v in tensors.items()}
    other["layer.0.w"] = plant(tensors["layer.0.w"], {5 * 33 + 2: 4, 40 * 33 + 32: 1})
    other["mask"][16] = not other["mask"][16]
    dmlib.write_safetensors(pb, other, metadata={"run": "b"})
    df = compare(pa, pb, chunk_bytes=1000, file_hashes=True)
    rows = df.set_index("name")
    assert set(rows.index) == set(tensors)
    w = rows.loc["layer.0.w"]
    assert (w["n_diff"], w["max_ulp"], w["median_ulp"], w["first_diff"]) == (2, 4, 2.5, (5, 2))
    assert (w["ulp_1"], w["ulp_3_4"]) == (1, 1)
    assert rows.loc["mask", "n_diff"] == 1 and rows.loc["mask", "first_diff"] == (16,)
    assert rows.loc["layer.0.b", "n_diff"] == 0 and rows.loc["step", "n_diff"] == 0
    for name in tensors:
        assert rows.loc[name, "data_hash_a"] == sha(tensors[name])
        assert rows.loc[name, "data_hash_b"] == sha(other[name])
    at = df.attrs
    assert at["file_hash_a"] == sha(pa.read_bytes())
    assert at["file_hash_b"] == sha(pb.read_bytes())
    assert at["metadata_diff"] == {"run": ["a", "b"]} and at["hash"] == "blake3-64MiB"
    # SHA-256 on request: every hash against hashlib (and the bare sha256 of data_hash())
    s256 = compare(pa, pb, chunk_bytes=1000, file_hashes=True, hash="sha256")
    assert s256.attrs["hash"] == "sha256"
    assert s256.attrs["file_hash_a"] == "sha256:" + hashlib.sha256(pa.read_bytes()).hexdigest()
    assert s256.attrs["file_hash_b"] == "sha256:" + hashlib.sha256(pb.read_bytes()).hexdigest()
    for r in s256.itertuples():
        assert r.data_hash_a == "sha256:" + hashlib.sha256(tensors[r.name].tobytes()).hexdigest()
        assert r.data_hash_b == "sha256:" + hashlib.sha256(other[r.name].tobytes()).hexdigest()
    with dmlib.open_tensors(pa) as ta, dmlib.open_tensors(pb) as tb:
        assert s256.attrs["data_section_hash_a"] == "sha256:" + ta.data_hash()
        assert s256.attrs["data_section_hash_b"] == "sha256:" + tb.data_hash()
        section_a = b"".join(t.raw().tobytes() for t in ta.disk_order())
        section_b = b"".join(t.raw().tobytes() for t in tb.disk_order())
    assert at["data_section_hash_a"] == sha(section_a)
    assert at["data_section_hash_b"] == sha(section_b)
    # a filtered comparison hashes the data section separately, with the same result
    sub = compare(pa, pb, include="layer.*", file_hashes=True)
    assert sub.attrs["data_section_hash_a"] == at["data_section_hash_a"]
    assert sub.attrs["data_section_hash_b"] == at["data_section_hash_b"]
    plain = compare(pa, pb)  # whole-file hashes are opt-in; per-tensor hashes are not
    assert plain.attrs["file_hash_a"] is None and plain.attrs["data_section_hash_b"] is None
    assert list(plain["data_hash_b"]) == list(df["data_hash_b"])
    assert summarize(df)["identical"] is False


def test_bad_inputs(tmp_path):
    with pytest.raises(dmlib.DmlibError, match="path or a TensorSet"):
        compare(np.ones(3), ArrayTensorSet({}))
    with pytest.raises(dmlib.DmlibError, match="missing"):
        compare(tmp_path / "missing.safetensors", ArrayTensorSet({}))
    with pytest.raises(dmlib.DmlibError, match="chunk_bytes"):
        compare(ArrayTensorSet({}), ArrayTensorSet({}), chunk_bytes=0)


def test_burnpack_param_ids_move_data_does_not(tmp_path):
    """Two processes, same parameters: different files (param_id), same data section."""
    from dmlib.io.burnpack import BurnTensor, write_burnpack

    rng = np.random.default_rng(11)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    u = rng.standard_normal(5).astype(np.float32)
    pa, pb = tmp_path / "d3a.bpk", tmp_path / "d3d.bpk"
    write_burnpack(pa, {"w": BurnTensor(w, param_id=1), "u": BurnTensor(u, param_id=2)})
    write_burnpack(pb, {"w": BurnTensor(w, param_id=101), "u": BurnTensor(u, param_id=102)})
    df = compare(pa, pb, file_hashes=True)
    at = df.attrs
    assert at["param_id_diff"] == {"w": [1, 101], "u": [2, 102]}
    assert at["file_hash_a"] != at["file_hash_b"]
    assert (
        at["data_section_hash_a"]
        == at["data_section_hash_b"]
        == sha(np.concatenate([w.ravel(), u]))
    )
    assert summarize(df)["identical"] is True


def test_quantized_tensors_compare_bytes():
    def ts(raw):
        t = Tensor(
            "q",
            np.uint8,
            (2, 3),
            nbytes=raw.nbytes,
            source=raw,
            quantized=True,
            dtype_name="QFloat",
        )
        return TensorSet({"q": t})

    a = np.arange(10, dtype=np.uint8)
    b = a.copy()
    b[[4, 9]] = 0
    r = compare(ts(a), ts(b)).iloc[0]
    assert (r["dtype"], r["numel"], r["n_diff"], r["first_diff"]) == ("QFloat", 6, 2, (4,))
    assert r["frac_diff"] == 2 / 10  # of the stored bytes
    assert math.isnan(r["max_abs"]) and pd.isna(r["max_ulp"])


def test_progress_only_on_a_terminal(monkeypatch, capsys):
    from dmlib.kernels import stream as K

    clock = iter([0.0, 5.0, 5.1, 6.0])
    monkeypatch.setattr(K.time, "monotonic", lambda: next(clock))
    p = K.Progress(1 << 30, enabled=True)  # t0 = 0
    p.advance(1 << 29)  # 5 s in: shown
    p.advance(1 << 28)  # 0.1 s later: too soon to redraw
    p.finish()
    err = capsys.readouterr().err
    assert "50.0%" in err and "75.0%" not in err
    quiet = K.Progress(1 << 30, enabled=None)  # stderr captured by pytest: not a terminal
    quiet.advance(1 << 30)
    assert capsys.readouterr().err == ""


@given(
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=60),
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=60),
    st.integers(4, 64),
)
@settings(max_examples=40, deadline=None)
def test_properties_against_ulp_distance(xs, ys, chunk):
    """Any bit patterns: chunking changes nothing, n_diff/max_ulp agree with ulp_distance."""
    n = min(len(xs), len(ys))
    a = np.array(xs[:n], np.uint32).view(np.float32)
    b = np.array(ys[:n], np.uint32).view(np.float32)
    whole = one(a, b)
    small = one(a, b, chunk_bytes=chunk)
    for col in ["n_diff", "max_ulp", "max_abs", "first_diff", *ULP_COLUMNS, "n_nan_vs_num"]:
        assert small[col] == whole[col] or (pd.isna(small[col]) and pd.isna(whole[col]))
    assert small["median_ulp"] == whole["median_ulp"] or (
        pd.isna(small["median_ulp"]) and pd.isna(whole["median_ulp"])
    )
    ua, ub = a.view(np.uint32), b.view(np.uint32)
    assert whole["n_diff"] == int(np.count_nonzero(ua != ub))
    d = dmlib.ulp_distance(a, b)
    nan = np.isnan(a) | np.isnan(b)
    fin = np.isfinite(a) & np.isfinite(b)
    assert whole["max_ulp"] == (int(d[fin].max()) if fin.any() else 0)
    diff_fin = fin & (ua != ub)
    if diff_fin.any():
        assert whole["median_ulp"] == float(np.median(d[diff_fin].astype(np.float64)))
    assert whole["ulp_nonfinite"] == int(np.count_nonzero((ua != ub) & ~fin))
    assert whole["n_nan_vs_num"] == int(np.count_nonzero(np.isnan(a) ^ np.isnan(b)))
    assert sum(whole[c] for c in ULP_COLUMNS) == whole["n_diff"]
    assert not nan.all() or whole["max_abs"] == 0.0


def test_real_burn_checkpoint(burnpack_fixtures, tmp_path):
    """Burn's MNIST checkpoint against a rewrite of it with one planted ULP and new param_ids."""
    from dmlib.io.burnpack import BurnTensor, write_burnpack

    src = burnpack_fixtures / "mnist-model.bpk"
    with dmlib.open_tensors(src) as ts:
        arrays = {n: ts[n].load().copy() for n in ts}
        pids = {n: ts[n].param_id for n in ts}
    name = next(n for n, a in arrays.items() if a.size > 100)
    moved = {n: a.copy() for n, a in arrays.items()}
    moved[name].view(np.uint32).reshape(-1)[100] += 1
    out = tmp_path / "moved.bpk"
    write_burnpack(
        out, {n: BurnTensor(a, param_id=1000 + i) for i, (n, a) in enumerate(moved.items())}
    )
    df = compare(src, out)
    assert len(df) == 18
    rows = df.set_index("name")
    assert int(rows["n_diff"].sum()) == 1
    r = rows.loc[name]
    assert (r["n_diff"], r["max_ulp"], r["ulp_1"]) == (1, 1, 1)
    assert r["first_diff"] == tuple(int(i) for i in np.unravel_index(100, arrays[name].shape))
    assert set(df.attrs["param_id_diff"]) == set(arrays)
    assert all(v[0] == pids[n] for n, v in df.attrs["param_id_diff"].items())
    assert summarize(compare(src, src))["identical"] is True


def test_real_mixed_dtypes(burnpack_fixtures):
    df = compare(burnpack_fixtures / "case_a.bpk", burnpack_fixtures / "case_a.bpk")
    assert set(df["dtype"]) >= {"float32", "bool", "int64", "bfloat16", "uint32"}
    assert int(df["n_diff"].sum()) == 0 and summarize(df)["identical"] is True


def test_summarize_refuses_partial_frames_and_empty_selections():
    a = ArrayTensorSet({"x": np.array([1, 2], np.float32), "y": np.ones(2, np.float32)})
    b = ArrayTensorSet({"x": np.array([1, 3], np.float32), "y": np.ones(2, np.float32)})
    df = compare(a, b)
    assert summarize(df)["complete"] is True
    part = summarize(df[df["n_diff"] == 0])  # pandas carries attrs onto the filtered frame
    assert part["complete"] is False and part["identical"] is False
    assert summarize(df.sort_values("name"))["complete"] is True  # reordering loses nothing
    with pytest.raises(dmlib.DmlibError, match="'no-such-name' matches no tensor name"):
        compare(a, b, include="no-such-name")  # a verdict over nothing is refused
    empty = summarize(compare(ArrayTensorSet({}), ArrayTensorSet({})))
    assert empty["identical"] is True  # two sets without tensors: nothing differs


def test_two_npy_files_compare_as_one_tensor(tmp_path):
    a = np.arange(10, dtype=np.float32)
    b = a.copy()
    b[3] = np.nextafter(b[3], np.float32(np.inf))  # one element, one ULP
    np.save(tmp_path / "run_a.npy", a)
    np.save(tmp_path / "run_b.npy", b)
    df = dmlib.compare(tmp_path / "run_a.npy", tmp_path / "run_b.npy")
    assert list(df["name"]) == ["run_a"]
    assert int(df["n_diff"].iloc[0]) == 1 and int(df["max_ulp"].iloc[0]) == 1
    assert df.attrs["only_in_a"] == [] and df.attrs["only_in_b"] == []


# ---------------------------------------------------------------------------------------
# tensors compared side by side on threads; identity hashes only when asked for


def _many_tensors(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Float32, bfloat16, float64 and int tensors; about half differ, some with NaN/inf."""
    rng = np.random.default_rng(seed)
    a: dict[str, np.ndarray] = {}
    for i in range(24):
        n = int(rng.integers(1, 50_000))
        dt = [np.float32, ml_dtypes.bfloat16, np.float64, np.int32][i % 4]
        if dt is np.int32:
            a[f"layer.{i}.w"] = rng.integers(-1000, 1000, n).astype(np.int32)
        else:
            a[f"layer.{i}.w"] = rng.standard_normal(n).astype(dt)
    b = {k: v.copy() for k, v in a.items()}
    for i, v in enumerate(b.values()):
        if i % 2:
            continue
        where = rng.choice(v.size, size=max(1, v.size // 7), replace=False)
        bits = v.view(f"u{v.dtype.itemsize}")
        bits[where] += 1  # one ULP (or one unit) at each planted place
        if i % 8 == 0 and v.dtype.kind == "f":
            v[0], v[-1] = np.inf, np.nan  # non-finite pairs, counted apart
    return a, b


def test_rows_do_not_depend_on_the_number_of_threads(monkeypatch):
    import dmlib.stats.compare as C

    a, b = _many_tensors(11)
    assert (
        min(v.nbytes for v in a.values())
        < C.THREADED_PAIR_BYTES
        < max(v.nbytes for v in a.values())
    )
    rows = {}
    # threads: none; two and five, with small pairs on the calling thread (the default
    # threshold: a mix) or every pair on the pool (threshold 0)
    for n, threshold in ((1, None), (2, None), (5, None), (2, 0), (5, 0)):
        monkeypatch.setattr(C, "pair_workers", lambda n=n: n)
        if threshold is not None:
            monkeypatch.setattr(C, "THREADED_PAIR_BYTES", threshold)
        df = compare(ArrayTensorSet(a), ArrayTensorSet(b), chunk_bytes=16_384)
        rows[n, threshold] = df.to_dict("records")
        monkeypatch.undo()
    rows[5] = rows[5, None]
    rows[1] = rows[1, None]
    # bit for bit: each pair is walked by one thread in chunk order, whatever the count
    for n in ((2, None), (5, None), (2, 0), (5, 0)):
        assert len(rows[n]) == len(rows[1])
        for r1, rn in zip(rows[1], rows[n], strict=True):
            for col, v in r1.items():
                w = rn[col]
                if isinstance(v, float) and math.isnan(v):
                    assert isinstance(w, float) and math.isnan(w), col
                else:
                    assert v == w or (pd.isna(v) and pd.isna(w)), (col, v, w)
    # and the rows are the data's (numpy as the oracle), in a's order
    assert [r["name"] for r in rows[5]] == list(a)
    for r in rows[5]:
        x, y = a[r["name"]], b[r["name"]]
        bits = f"u{x.dtype.itemsize}"
        assert r["n_diff"] == int(np.count_nonzero(x.view(bits) != y.view(bits)))


def test_hash_none_same_rows_no_hashes():
    a, b = _many_tensors(12)
    hashed = compare(ArrayTensorSet(a), ArrayTensorSet(b))
    bare = compare(ArrayTensorSet(a), ArrayTensorSet(b), hash="none")
    assert bare.attrs["hash"] is None and hashed.attrs["hash"] == "blake3-64MiB"
    assert bare["data_hash_a"].isna().all() and bare["data_hash_b"].isna().all()
    cols = [c for c in bare.columns if not c.startswith("data_hash")]
    pd.testing.assert_frame_equal(bare[cols], hashed[cols])
    assert summarize(bare) == summarize(hashed)
    # the hashes that are computed are of each side's bytes (BLAKE3 as the oracle)
    for r in hashed.to_dict("records"):
        assert r["data_hash_a"] == sha(a[r["name"]]) and r["data_hash_b"] == sha(b[r["name"]])
    with pytest.raises(dmlib.DmlibError, match="whole-file hashes .* need a hash scheme"):
        compare(ArrayTensorSet(a), ArrayTensorSet(b), hash="none", file_hashes=True)
    same = compare(ArrayTensorSet(a), ArrayTensorSet(a), hash="none")
    assert summarize(same)["identical"] is True
