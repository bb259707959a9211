"""Burn NamedMpk records (.mpk, .mpk.gz) written with msgpack in the layout Burn's recorder uses.

The files are built here from a tiny torch model's parameters, in the structure Burn's
source defines (``BurnRecord {metadata, item}``, ``Param {id, param}``, ``TensorData
{bytes, shape, dtype}``); numpy on the same arrays is the oracle.
"""

from __future__ import annotations

import gzip

import ml_dtypes
import numpy as np
import pytest

import dmlib

msgpack = pytest.importorskip("msgpack")
torch = pytest.importorskip("torch")

META = {
    "float": "f32",
    "int": "i64",
    "format": "burn::record::file::NamedMpkFileRecorder<burn::record::settings::FullPrecisionSettings>",
    "version": "0.16.0",
    "settings": "DebugRecordSettings { float: f32, int: i64 }",
}


def _param(arr: np.ndarray, pid: str, dtype=None) -> dict:
    names = {
        np.dtype("<f4"): "F32",
        np.dtype("<f2"): "F16",
        np.dtype("<i8"): "I64",
        np.dtype(ml_dtypes.bfloat16): "BF16",
    }
    return {
        "id": pid,
        "param": {
            "bytes": np.ascontiguousarray(arr).tobytes(),
            "shape": list(arr.shape),
            "dtype": dtype or names[arr.dtype],
        },
    }


def _model_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    torch.manual_seed(seed)
    enc = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Linear(9, 9))
    head = torch.nn.Linear(9, 3)
    # Burn keeps a Linear weight as [d_input, d_output]: the transpose of torch's
    out = {}
    for i, layer in enumerate(enc):
        out[f"encoder.layers.{i}.weight"] = layer.weight.detach().numpy().T.copy()
        out[f"encoder.layers.{i}.bias"] = layer.bias.detach().numpy().copy()
    out["head.weight"] = head.weight.detach().numpy().T.copy()
    return out


def _record(arrays: dict[str, np.ndarray], *, extra: dict | None = None) -> dict:
    layers = []
    for i in range(2):
        layers.append({
            "weight": _param(arrays[f"encoder.layers.{i}.weight"], f"w{i}"),
            "bias": _param(arrays[f"encoder.layers.{i}.bias"], f"b{i}"),
        })  # fmt: skip
    item = {
        "encoder": {"layers": layers},
        "head": {"weight": _param(arrays["head.weight"], "hw"), "bias": None},
        "dropout": {"prob": 0.1},
        "_b": None,
    }
    item.update(extra or {})
    return {"metadata": META, "item": item}


def _write(path, record: dict, gz: bool = False) -> None:
    blob = msgpack.packb(record, use_bin_type=True)
    path.write_bytes(gzip.compress(blob) if gz else blob)


@pytest.mark.parametrize("gz", [False, True])
def test_reads_a_named_mpk_record(tmp_path, gz):
    arrays = _model_arrays()
    path = tmp_path / ("model.mpk.gz" if gz else "model.mpk")
    _write(path, _record(arrays), gz=gz)
    assert dmlib.detect_format(path) == "burn-mpk"
    with dmlib.open_tensors(path) as ts:
        assert sorted(ts) == sorted(arrays)
        for name, arr in arrays.items():
            np.testing.assert_array_equal(ts[name].load(), arr)
            assert ts[name].raw().tobytes() == arr.tobytes()
        assert ts["encoder.layers.1.bias"].param_id == "b1"
        assert ts.metadata["version"] == "0.16.0"
        assert ts.scalars == {"dropout.prob": 0.1}


def test_dtypes_as_maps_half_precision_and_quantized(tmp_path):
    w16 = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)
    extra = {
        "half": _param(w16.astype(np.float16), "h", dtype={"F16": None}),
        "bf": _param(w16.astype(ml_dtypes.bfloat16), "bf"),
        "steps": _param(np.arange(5, dtype="<i8"), "s"),
        "q": {
            "id": "q",
            "param": {
                "bytes": bytes(range(20)),
                "shape": [4, 4],
                "dtype": {"QFloat": {"level": "Tensor"}},
            },
        },
    }
    _write(tmp_path / "m.mpk", _record(_model_arrays(), extra=extra))
    with dmlib.open_tensors(tmp_path / "m.mpk") as ts:
        np.testing.assert_array_equal(ts["half"].load(), w16.astype(np.float16))
        np.testing.assert_array_equal(
            ts["bf"].load().astype(np.float32), w16.astype(ml_dtypes.bfloat16).astype(np.float32)
        )
        np.testing.assert_array_equal(ts["steps"].load(), np.arange(5))
        assert (
            ts["q"].opaque
            and ts["q"].dtype_name == "QFloat"
            and ts["q"].raw().tobytes() == bytes(range(20))
        )
        assert ts.layout["opaque"] == ["q"]


def test_records_before_burn_0_14(tmp_path):
    w = np.array([[0.5, -1.25], [2.0, 3.0]], np.float32)
    record = {
        "metadata": META,
        "item": {
            "lin": {"weight": {"id": "x", "param": {"value": w.ravel().tolist(), "shape": [2, 2]}}}
        },
    }
    _write(tmp_path / "old.mpk", record)
    with dmlib.open_tensors(tmp_path / "old.mpk") as ts:
        np.testing.assert_array_equal(ts["lin.weight"].load(), w)
        assert ts["lin.weight"].dtype == np.float32


def test_compare_mpk_with_mpk_and_with_safetensors(tmp_path):
    arrays = _model_arrays(1)
    _write(tmp_path / "a.mpk", _record(arrays))
    changed = {k: v.copy() for k, v in arrays.items()}
    changed["encoder.layers.1.weight"][4, 2] = np.nextafter(
        changed["encoder.layers.1.weight"][4, 2], np.float32(9)
    )
    _write(tmp_path / "b.mpk.gz", _record(changed), gz=True)
    df = dmlib.compare(tmp_path / "a.mpk", tmp_path / "b.mpk.gz").set_index("name")
    assert df.loc["encoder.layers.1.weight", "n_diff"] == 1
    assert df.loc["encoder.layers.1.weight", "first_diff"] == (4, 2)
    assert int(df.loc["encoder.layers.1.weight", "max_ulp"]) == 1
    assert int((df["n_diff"] > 0).sum()) == 1
    from dmlib.io.safetensors import write_safetensors

    write_safetensors(tmp_path / "same.safetensors", arrays)
    same = dmlib.compare(tmp_path / "a.mpk", tmp_path / "same.safetensors")
    # the record's module setting (dropout.prob) has no place in safetensors: not compared,
    # so not identical, until the comparison leaves it out by name
    assert same.attrs["scalars_only_in_a"] == ["dropout.prob"]
    assert dmlib.summarize(same)["identical"] is False
    same = dmlib.compare(tmp_path / "a.mpk", tmp_path / "same.safetensors", exclude="dropout.prob")
    assert dmlib.summarize(same)["identical"] is True


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: b[: len(b) // 2], "not a readable MessagePack record"),
        (lambda b: b + b"\x00", "bytes after the record"),
        (lambda b: msgpack.packb({"metadata": META}), "no top-level 'item'"),
    ],
)
def test_malformed_records_are_refused_naming_the_file(tmp_path, mutate, match):
    blob = msgpack.packb(_record(_model_arrays()), use_bin_type=True)
    path = tmp_path / "bad.mpk"
    path.write_bytes(mutate(blob))
    with pytest.raises(dmlib.DmlibError, match=match) as info:
        dmlib.open_tensors(path)
    assert str(path) in str(info.value)


def test_wrong_byte_length_and_damaged_gzip(tmp_path):
    rec = _record(_model_arrays())
    rec["item"]["head"]["weight"]["param"]["shape"] = [9, 4]
    _write(tmp_path / "len.mpk", rec)
    with pytest.raises(dmlib.DmlibError, match="needs 144"):
        dmlib.open_tensors(tmp_path / "len.mpk")
    _write(tmp_path / "ok.mpk.gz", _record(_model_arrays()), gz=True)
    raw = (tmp_path / "ok.mpk.gz").read_bytes()
    (tmp_path / "cut.mpk.gz").write_bytes(raw[:-12])
    with pytest.raises(dmlib.DmlibError, match="gzip") as info:
        dmlib.open_tensors(tmp_path / "cut.mpk.gz")
    assert "cut.mpk.gz" in str(info.value)
