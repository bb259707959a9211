"""PyTorch checkpoints under any name, sharded like Hugging Face's, with every dtype torch saves.

Oracles: ``torch.save`` writes every file; torch's own tensors (bytes, ``.float()``,
``int_repr()``, ``q_scale()``, sparse indices) are what dmlib must reproduce.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import dmlib

torch = pytest.importorskip("torch")


def _bytes(t) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class TinyHead(torch.nn.Module):
    """Not data/'s shapes: an embedding, a pooled head, a model. prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.proj = torch.nn.Linear(6, 5)
        self.head = torch.nn.Linear(5, 3)


def _state(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {f"model.{k}": v for k, v in TinyHead().state_dict().items()}


@pytest.mark.parametrize("name", ["checkpoint.pth.tar", "ckpt", "weights.data"])
def test_torch_zip_detected_by_content(tmp_path, name):
    sd = _state()
    path = tmp_path / name
    torch.save(sd, path)
    assert dmlib.detect_format(path) == "torch"
    with dmlib.open_tensors(path) as ts:
        assert sorted(ts) == sorted(sd)
        for k, v in sd.items():
            assert ts[k].raw().tobytes() == _bytes(v)


def test_legacy_torch_file_detected_by_content(tmp_path):
    sd = _state(1)
    path = tmp_path / "old_checkpoint"
    torch.save(sd, path, _use_new_zipfile_serialization=False)
    assert dmlib.detect_format(path) == "torch"
    with dmlib.open_tensors(path) as ts:
        np.testing.assert_array_equal(
            ts["model.head.weight"].load(), sd["model.head.weight"].numpy()
        )


def test_a_zip_that_is_neither_torch_nor_npz_is_unrecognised(tmp_path):
    import zipfile

    path = tmp_path / "archive.data"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("notes.txt", "hello")
    with pytest.raises(dmlib.DmlibError, match="unrecognised"):
        dmlib.open_tensors(path)


def _shard(tmp_path, sd: dict, n: int = 2, prefix: str = "pytorch_model") -> dict:
    names = sorted(sd)
    wmap = {}
    for i in range(n):
        part = {k: sd[k] for k in names[i::n]}
        fname = f"{prefix}-{i + 1:05d}-of-{n:05d}.bin"
        torch.save(part, tmp_path / fname)
        wmap.update({k: fname for k in part})
    index = {
        "metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
        "weight_map": wmap,
    }
    (tmp_path / f"{prefix}.bin.index.json").write_text(json.dumps(index))
    return wmap


def test_hf_sharded_pytorch_checkpoint(tmp_path):
    sd = _state(2)
    _shard(tmp_path, sd)
    idx = tmp_path / "pytorch_model.bin.index.json"
    assert dmlib.detect_format(idx) == "torch"
    with dmlib.open_tensors(idx) as ts:
        assert ts.format == "torch" and len(ts.layout["shards"]) == 2
        assert sorted(ts) == sorted(sd)
        for k, v in sd.items():
            np.testing.assert_array_equal(ts[k].load(), v.numpy())
        assert ts.metadata["total_size"] == str(sum(v.numel() * 4 for v in sd.values()))


def test_compare_two_sharded_pytorch_checkpoints(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    sd = _state(3)
    _shard(a, sd)
    sd2 = {k: v.clone() for k, v in sd.items()}
    sd2["model.proj.weight"][2, 4] += 0.25
    _shard(b, sd2)
    df = dmlib.compare(
        a / "pytorch_model.bin.index.json", b / "pytorch_model.bin.index.json"
    ).set_index("name")
    assert df.loc["model.proj.weight", "n_diff"] == 1
    assert df.loc["model.proj.weight", "first_diff"] == (2, 4)
    want = abs(float(sd2["model.proj.weight"][2, 4]) - float(sd["model.proj.weight"][2, 4]))
    assert df.loc["model.proj.weight", "max_abs"] == pytest.approx(want, rel=1e-6)
    assert int((df["n_diff"] > 0).sum()) == 1


def test_mixed_shard_formats_are_refused(tmp_path):
    (tmp_path / "m.index.json").write_text(
        json.dumps({"weight_map": {"a": "x.bin", "b": "y.safetensors"}})
    )
    with pytest.raises(dmlib.DmlibError, match="more than one format"):
        dmlib.open_tensors(tmp_path / "m.index.json")


def test_new_float_dtypes(tmp_path):
    x = torch.randn(5, 4) * 4
    sd = {
        "e4m3fnuz": x.to(torch.float8_e4m3fnuz),
        "e5m2fnuz": x.to(torch.float8_e5m2fnuz),
        "e8m0": x.abs().clamp_min(1e-3).to(torch.float8_e8m0fnu),
        "fp4": torch.tensor([[0x21, 0xF7], [0x09, 0x3C]], dtype=torch.uint8).view(
            torch.float4_e2m1fn_x2
        ),
        "c64": torch.complex(x, -x),
        "c128": torch.complex(x, x).to(torch.complex128),
    }
    torch.save(sd, tmp_path / "f.pt")
    with dmlib.open_tensors(tmp_path / "f.pt") as ts:
        for k in ("e4m3fnuz", "e5m2fnuz", "e8m0"):
            assert ts[k].raw().tobytes() == _bytes(sd[k])
            np.testing.assert_array_equal(ts[k].load().astype(np.float32), sd[k].float().numpy())
        assert ts["e8m0"].dtype == np.dtype(ml_dtypes.float8_e8m0fnu)
        fp4 = ts["fp4"]
        assert fp4.shape == (2, 4) and fp4.raw().tobytes() == bytes([0x21, 0xF7, 0x09, 0x3C])
        # e2m1 codes by hand: 1=0.5 2=1 7=6 F=-6 9=-0.5 0=0 C=-2 3=1.5 (low nibble first)
        np.testing.assert_array_equal(
            fp4.load().astype(np.float32), [[0.5, 1.0, 6.0, -6.0], [-0.5, 0.0, -2.0, 1.5]]
        )
        np.testing.assert_array_equal(ts["c64"].load(), sd["c64"].numpy())
        np.testing.assert_array_equal(ts["c128"].load(), sd["c128"].numpy())


def test_complex32_as_real_imaginary_pairs(tmp_path):
    with pytest.warns(UserWarning, match="ComplexHalf"):
        z = torch.complex(torch.arange(3.0), -torch.arange(3.0)).to(torch.complex32)
    torch.save({"z": z}, tmp_path / "z.pt")
    with dmlib.open_tensors(tmp_path / "z.pt") as ts:
        arr = ts["z"].load()
    assert arr.shape == (3, 2) and arr.dtype == np.float16
    np.testing.assert_array_equal(arr, [[0, 0], [1, -1], [2, -2]])


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated:UserWarning")
def test_quantized_tensors_as_named_parts(tmp_path):
    x = torch.randn(4, 6)
    qt = torch.quantize_per_tensor(x, 0.05, 3, torch.qint8)
    qc = torch.quantize_per_channel(
        x,
        torch.tensor([0.1, 0.2, 0.05, 0.4], dtype=torch.float64),
        torch.tensor([0, 1, 2, 3]),
        0,
        torch.quint8,
    )
    torch.save({"layer.q": qt, "layer.qc": qc}, tmp_path / "q.pt")
    with dmlib.open_tensors(tmp_path / "q.pt") as ts:
        assert sorted(ts) == sorted(
            ["layer.q.int_repr", "layer.q.scale", "layer.q.zero_point",
             "layer.qc.int_repr", "layer.qc.scales", "layer.qc.zero_points", "layer.qc.axis"]
        )  # fmt: skip
        np.testing.assert_array_equal(ts["layer.q.int_repr"].load(), qt.int_repr().numpy())
        assert float(ts["layer.q.scale"].load()) == qt.q_scale()
        assert int(ts["layer.q.zero_point"].load()) == qt.q_zero_point()
        np.testing.assert_array_equal(ts["layer.qc.int_repr"].load(), qc.int_repr().numpy())
        np.testing.assert_array_equal(
            ts["layer.qc.scales"].load(), qc.q_per_channel_scales().numpy()
        )
        np.testing.assert_array_equal(
            ts["layer.qc.zero_points"].load(), qc.q_per_channel_zero_points().numpy()
        )
        assert int(ts["layer.qc.axis"].load()) == 0
    # a changed scale is found on its own part
    qt2 = torch.quantize_per_tensor(x, 0.06, 3, torch.qint8)
    torch.save({"layer.q": qt2, "layer.qc": qc}, tmp_path / "q2.pt")
    df = dmlib.compare(tmp_path / "q.pt", tmp_path / "q2.pt").set_index("name")
    assert df.loc["layer.q.scale", "n_diff"] == 1
    assert df.loc["layer.q.int_repr", "n_diff"] == int((qt.int_repr() != qt2.int_repr()).sum())
    assert (df.loc[[n for n in df.index if n.startswith("layer.qc")], "n_diff"] == 0).all()


def test_sparse_tensors_as_named_parts(tmp_path):
    torch.manual_seed(4)
    dense = torch.randn(5, 7).masked_fill(torch.rand(5, 7) < 0.6, 0)
    coo = dense.to_sparse()
    with pytest.warns(UserWarning, match="Sparse CSR"):
        csr = dense.to_sparse_csr()
    torch.save({"emb.coo": coo, "emb.csr": csr}, tmp_path / "s.pt")
    with dmlib.open_tensors(tmp_path / "s.pt") as ts:
        assert sorted(ts) == sorted(
            ["emb.coo.indices", "emb.coo.values", "emb.coo.shape",
             "emb.csr.crow_indices", "emb.csr.col_indices", "emb.csr.values", "emb.csr.shape"]
        )  # fmt: skip
        np.testing.assert_array_equal(ts["emb.coo.indices"].load(), coo._indices().numpy())
        np.testing.assert_array_equal(ts["emb.coo.values"].load(), coo._values().numpy())
        np.testing.assert_array_equal(ts["emb.coo.shape"].load(), [5, 7])
        np.testing.assert_array_equal(ts["emb.csr.crow_indices"].load(), csr.crow_indices().numpy())
        np.testing.assert_array_equal(ts["emb.csr.col_indices"].load(), csr.col_indices().numpy())
        np.testing.assert_array_equal(ts["emb.csr.values"].load(), csr.values().numpy())


def test_zip_content_beats_the_suffix(tmp_path):
    np.savez(tmp_path / "arrays.npz", w=np.arange(3.0))
    (tmp_path / "arrays.npz").rename(tmp_path / "weights.bin")  # a torch suffix, numpy's archive
    assert dmlib.detect_format(tmp_path / "weights.bin") == "npz"
    torch.save({"w": torch.arange(3.0)}, tmp_path / "model.npz")  # and the other way round
    assert dmlib.detect_format(tmp_path / "model.npz") == "torch"
