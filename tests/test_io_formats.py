"""safetensors, numpy and PyTorch readers; format detection; the eager ``load``."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

import dmlib
from dmlib.dtypes import SAFETENSORS_DTYPES


def _every_dtype() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    out = {}
    for name, dt in SAFETENSORS_DTYPES.items():
        if dt == np.bool_:
            arr = rng.integers(0, 2, (3, 4)).astype(bool)
        elif dt.kind in "iu":
            arr = rng.integers(0, 100, (3, 4)).astype(dt)
        else:
            arr = rng.standard_normal((3, 4)).astype(np.float32).astype(dt)
        out[f"t.{name.lower()}"] = arr
    return out


def test_safetensors_every_dtype_round_trip(tmp_path):
    arrays = _every_dtype()
    p = tmp_path / "m.safetensors"
    dmlib.write_safetensors(p, arrays, metadata={"producer": "test"})
    ts = dmlib.open_tensors(p)
    assert ts.format == "safetensors" and ts.metadata == {"producer": "test"}
    for name, arr in arrays.items():
        t = ts[name]
        assert t.dtype == arr.dtype and t.shape == arr.shape
        assert t.load().tobytes() == arr.tobytes()
    assert ts["t.bf16"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert ts["t.f8_e4m3"].dtype == np.dtype(ml_dtypes.float8_e4m3fn)


def test_safetensors_hand_built_header(tmp_path):
    """A file built byte by byte from the spec, independent of dmlib's writer."""
    data = np.array([1.5, -2.0], dtype="<f4").tobytes() + np.array([7], dtype="<i8").tobytes()
    header = {
        "b": {"dtype": "I64", "shape": [1], "data_offsets": [8, 16]},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
    }
    hb = json.dumps(header).encode()
    p = tmp_path / "h.safetensors"
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + data)
    ts = dmlib.open_tensors(p)
    assert ts["a"].load().tolist() == [1.5, -2.0]
    assert ts["b"].load().tolist() == [7]
    assert ts["a"].offset == 8 + len(hb)
    assert [t.name for t in ts.disk_order()] == ["a", "b"]


def test_sharded_safetensors_open_as_one_set(tmp_path):
    dmlib.write_safetensors(
        tmp_path / "model-00001-of-00002.safetensors", {"a": np.ones(3, np.float32)}
    )
    dmlib.write_safetensors(
        tmp_path / "model-00002-of-00002.safetensors", {"b": np.zeros(2, np.float16)}
    )
    index = {
        "metadata": {"total_size": 16},
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        },
    }
    ip = tmp_path / "model.safetensors.index.json"
    ip.write_text(json.dumps(index))
    ts = dmlib.open_tensors(ip)
    assert sorted(ts) == ["a", "b"]
    assert ts["b"].load().dtype == np.float16
    assert ts["a"].path.endswith("00001-of-00002.safetensors")


def _backed_by_mmap(arr: np.ndarray) -> bool:
    import mmap

    obj = arr
    while obj is not None:
        if isinstance(obj, mmap.mmap):
            return True
        obj = getattr(obj, "base", None)
    return False


def test_npy_is_memory_mapped_and_npz_reads(tmp_path):
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)
    np.save(tmp_path / "w.npy", arr)
    ts = dmlib.open_tensors(tmp_path / "w.npy")
    assert list(ts) == ["w"] and ts.format == "npy"
    np.testing.assert_array_equal(ts["w"].load(), arr)
    assert _backed_by_mmap(ts["w"].load())
    np.savez(tmp_path / "z.npz", x=arr, y=np.array([1, 2], np.int8))
    z = dmlib.open_tensors(tmp_path / "z.npz")
    assert sorted(z) == ["x", "y"] and z["y"].load().tolist() == [1, 2]


def test_detection_magic_before_suffix(tmp_path, burnpack_fixtures):
    # a burnpack file under a misleading suffix is still burnpack
    p = tmp_path / "weights.safetensors"
    p.write_bytes((burnpack_fixtures / "case_a.bpk").read_bytes())
    assert dmlib.detect_format(p) == "burnpack"
    assert dmlib.open_tensors(p)["zeta.w"].load().tolist() == [1, 2, 3]
    # format= overrides detection (and then fails loudly when wrong)
    with pytest.raises(dmlib.DmlibError, match="weights.safetensors"):
        dmlib.open_tensors(p, format="safetensors")


def test_load_eager_returns_writable_copies(tmp_path):
    dmlib.write_safetensors(
        tmp_path / "m.safetensors", {"a": np.ones(3, np.float32), "b": np.zeros(2, np.int32)}
    )
    out = dmlib.load(tmp_path / "m.safetensors", names=["a"])
    assert list(out) == ["a"]
    out["a"][0] = 5  # a copy: writing it cannot touch the file
    assert dmlib.load(tmp_path / "m.safetensors")["a"][0] == 1
    with pytest.raises(KeyError):
        dmlib.load(tmp_path / "m.safetensors", names=["nope"])


def test_torch_state_dict(tmp_path):
    torch = pytest.importorskip("torch", reason="torch extra not installed")
    sd = {
        "layer.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "layer.bias": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
        "nested": {"step": torch.tensor(3)},
    }
    p = tmp_path / "m.pt"
    torch.save(sd, p)
    ts = dmlib.open_tensors(p)
    assert ts.format == "torch"
    np.testing.assert_array_equal(
        ts["layer.weight"].load(), np.arange(6, dtype=np.float32).reshape(2, 3)
    )
    assert ts["layer.bias"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert ts["layer.bias"].load().astype(np.float32).tolist() == [1.0, 2.0]
    assert ts["nested.step"].load().item() == 3


class Evil:
    """An arbitrary object: weights_only loading must refuse to rebuild it."""


def test_torch_refuses_arbitrary_pickles(tmp_path):
    torch = pytest.importorskip("torch", reason="torch extra not installed")

    p = tmp_path / "evil.pt"
    torch.save({"obj": Evil()}, p)
    with pytest.raises(dmlib.FormatError, match="evil.pt"):
        dmlib.open_tensors(p)
