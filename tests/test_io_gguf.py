"""GGUF files written by llama.cpp's own ``gguf`` package, read by dmlib's parser.

Oracles: ``gguf.GGUFWriter`` writes; ``gguf.GGUFReader`` reads the same file (bytes,
values, key/values); ``gguf.quants.dequantize`` gives the dequantized values;
``gguf.constants.GGML_QUANT_SIZES`` the block sizes.
"""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import pytest

import dmlib
from dmlib.io.gguf import GGML_TYPES, open_gguf

gguf = pytest.importorskip("gguf")
quants = pytest.importorskip("gguf.quants")
constants = pytest.importorskip("gguf.constants")
Q = constants.GGMLQuantizationType
GGML_QUANT_SIZES = constants.GGML_QUANT_SIZES


def test_block_table_matches_the_gguf_package():
    theirs = {int(q): (q.name, *GGML_QUANT_SIZES[q]) for q in GGML_QUANT_SIZES}
    ours = {k: v[:3] for k, v in GGML_TYPES.items()}
    assert {k: v for k, v in theirs.items() if k in ours} == ours
    assert set(theirs) - set(ours) == set(), "a ggml type the installed gguf knows is missing"


def _write(path, *, seed: int = 0, endian=None, plant: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    kw = {} if endian is None else {"endianess": endian}
    w = gguf.GGUFWriter(str(path), "llama", **kw)
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_string("general.name", "tiny-pooled")
    w.add_array("tokenizer.ggml.scores", [0.5, -1.25, 3.0])
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    emb = rng.standard_normal((5, 64)).astype(np.float32)
    if plant:
        emb[3, 17] = np.nextafter(emb[3, 17], np.float32(9))
    tensors = {
        "token_embd.weight": emb,
        "blk.0.attn_norm.weight": rng.standard_normal(64).astype(np.float16),
        "blk.0.ffn_up.weight": rng.standard_normal((3, 64))
        .astype(np.float32)
        .astype(ml_dtypes.bfloat16),
        "pos.ids": np.arange(7, dtype=np.int32),
    }
    q8 = quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q.Q8_0)
    q4k = rng.integers(0, 256, (2, 144), dtype=np.uint8)  # two raw Q4_K blocks of 256 values
    q4k[:, 0:4] = np.frombuffer(
        np.array([0.01, 0.002], np.float16).tobytes(), np.uint8
    )  # finite d, dmin
    if plant:
        q4k[1, 100] ^= 0x01
    for name, arr in tensors.items():
        if arr.dtype == ml_dtypes.bfloat16:
            w.add_tensor(name, arr.view(np.uint16), raw_shape=arr.shape, raw_dtype=Q.BF16)
        else:
            w.add_tensor(name, arr)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=Q.Q8_0)
    w.add_tensor("blk.1.ffn_down.weight", q4k, raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {**tensors, "blk.0.attn_q.weight": q8, "blk.1.ffn_down.weight": q4k}


def test_reads_what_gguf_writes_bit_exactly(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path)
    ref = gguf.GGUFReader(str(path))
    assert dmlib.detect_format(path) == "gguf"
    with dmlib.open_tensors(path) as ts:
        assert sorted(ts) == sorted(t.name for t in ref.tensors)
        for rt in ref.tensors:
            got = ts[rt.name]
            assert got.raw().tobytes() == np.asarray(rt.data).tobytes(), rt.name
            assert got.offset == rt.data_offset
            assert got.dtype_name == rt.tensor_type.name
            if rt.tensor_type in (Q.F32, Q.F16):
                np.testing.assert_array_equal(got.load(), rt.data)
        assert ts["token_embd.weight"].shape == (5, 64)
        assert ts["blk.0.attn_q.weight"].quantized and ts["blk.0.attn_q.weight"].shape == (4, 64)
        assert ts["blk.1.ffn_down.weight"].dtype_name == "Q4_K" and ts[
            "blk.1.ffn_down.weight"
        ].shape == (2, 256)
        assert ts["blk.0.ffn_up.weight"].load().dtype == np.dtype(ml_dtypes.bfloat16)
        assert ts.metadata["general.name"] == "tiny-pooled"
        assert ts.metadata["llama.context_length"] == "128"
        assert ts.metadata["tokenizer.ggml.scores"] == "[0.5, -1.25, 3.0]"
        tokens = ref.fields["tokenizer.ggml.tokens"]
        raw = b"".join(bytes(tokens.parts[i]) for i in range(len(tokens.parts)))[
            sum(p.nbytes for p in tokens.parts[:5]) :
        ]
        assert ts.metadata["tokenizer.ggml.tokens"] == (
            f"<array of 300 str, sha256 {hashlib.sha256(raw).hexdigest()[:16]}>"
        )


def test_dequantized_on_request(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write(path)
    ref = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    with open_gguf(path, dequantize=True) as ts:
        for name in ("blk.0.attn_q.weight", "blk.1.ffn_down.weight"):
            want = quants.dequantize(np.asarray(ref[name].data), ref[name].tensor_type)
            got = ts[name].load()
            assert got.dtype == np.float32 and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_compare_names_the_quant_type(tmp_path):
    _write(tmp_path / "a.gguf")
    _write(tmp_path / "b.gguf", plant=True)
    df = dmlib.compare(tmp_path / "a.gguf", tmp_path / "b.gguf").set_index("name")
    assert df.loc["blk.1.ffn_down.weight", "dtype"] == "Q4_K"
    assert df.loc["blk.1.ffn_down.weight", "n_diff"] == 1  # one byte of the stored blocks
    assert df.loc["blk.1.ffn_down.weight", "first_diff"] == (144 + 100,)
    assert (
        df.loc["token_embd.weight", "n_diff"] == 1
        and int(df.loc["token_embd.weight", "max_ulp"]) == 1
    )
    assert df.loc["token_embd.weight", "first_diff"] == (3, 17)
    assert df.loc["blk.0.attn_q.weight", "n_diff"] == 0
    # on dequantized values, with the same oracle
    a, b = (
        open_gguf(tmp_path / "a.gguf", dequantize=True),
        open_gguf(tmp_path / "b.gguf", dequantize=True),
    )
    dq = dmlib.compare(a, b).set_index("name")
    ra = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "a.gguf")).tensors}[
        "blk.1.ffn_down.weight"
    ]
    rb = {t.name: t for t in gguf.GGUFReader(str(tmp_path / "b.gguf")).tensors}[
        "blk.1.ffn_down.weight"
    ]
    va, vb = (quants.dequantize(np.asarray(r.data), Q.Q4_K) for r in (ra, rb))
    assert dq.loc["blk.1.ffn_down.weight", "n_diff"] == int((va != vb).sum())
    assert dq.loc["blk.1.ffn_down.weight", "max_abs"] == float(
        np.max(np.abs(vb.astype(np.float64) - va))
    )


def test_big_endian_file(tmp_path):
    _write(tmp_path / "le.gguf")
    want = _write(tmp_path / "be.gguf", endian=gguf.GGUFEndian.BIG)
    with dmlib.open_tensors(tmp_path / "be.gguf") as ts:
        assert ts.layout["byte_order"] == ">"
        np.testing.assert_array_equal(ts["token_embd.weight"].load(), want["token_embd.weight"])
        np.testing.assert_array_equal(ts["pos.ids"].load(), want["pos.ids"])
        np.testing.assert_array_equal(
            ts["blk.0.ffn_up.weight"].load().astype(np.float32),
            want["blk.0.ffn_up.weight"].astype(np.float32),
        )
    df = dmlib.compare(tmp_path / "le.gguf", tmp_path / "be.gguf").set_index("name")
    assert (df["n_diff"] == 0).all()  # the same values in the other byte order
    assert (
        df.loc["blk.0.ffn_up.weight", "data_hash_a"] != df.loc["blk.0.ffn_up.weight", "data_hash_b"]
    )


@pytest.mark.parametrize(
    ("cut", "match"),
    [
        (10, "shorter than the 24-byte"),
        (40, "cannot fit"),
        (230, "needs|cannot fit in the bytes left"),
        (-3, "past the end"),
    ],
)
def test_truncated_files_are_refused_naming_them(tmp_path, cut, match):
    _write(tmp_path / "ok.gguf")
    raw = (tmp_path / "ok.gguf").read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(raw[:cut])
    with pytest.raises(dmlib.DmlibError, match=match) as info:
        dmlib.open_tensors(bad)
    assert str(bad) in str(info.value)


def test_version_1_is_refused(tmp_path):
    _write(tmp_path / "ok.gguf")
    raw = bytearray((tmp_path / "ok.gguf").read_bytes())
    raw[4:8] = (1).to_bytes(4, "little")
    (tmp_path / "v1.gguf").write_bytes(bytes(raw))
    with pytest.raises(dmlib.UnsupportedError, match="version 1"):
        dmlib.open_tensors(tmp_path / "v1.gguf")
