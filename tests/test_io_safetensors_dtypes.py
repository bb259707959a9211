"""safetensors dtypes beyond the classic fifteen, against files the official writer made.

Oracles: ``safetensors.torch.save_file`` writes the files; torch's own bytes and its own
float conversion (``.float()``) give the expected values; safetensors' numpy loader reads
back the dtypes it supports; float4 values come from the format's table by hand.
"""

from __future__ import annotations

import hashlib
import json
import struct

import ml_dtypes
import numpy as np
import pytest

import dmlib
from dmlib.dtypes import SAFETENSORS_DTYPES, SAFETENSORS_SUBBYTE

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")


def _torch_bytes(t) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _every_torch_dtype(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 5, generator=g) * 3
    out = {
        "f64": x.double(),
        "f32": x,
        "f16": x.half(),
        "bf16": x.bfloat16(),
        "i64": (x * 100).long(),
        "i32": (x * 100).int(),
        "i16": (x * 100).short(),
        "i8": (x * 10).to(torch.int8),
        "u8": (x.abs() * 10).to(torch.uint8),
        "bool": x > 0,
        "f8_e4m3": x.to(torch.float8_e4m3fn),
        "f8_e5m2": x.to(torch.float8_e5m2),
        "f8_e4m3fnuz": x.to(torch.float8_e4m3fnuz),
        "f8_e5m2fnuz": x.to(torch.float8_e5m2fnuz),
        "f8_e8m0": x.abs().clamp_min(1e-3).to(torch.float8_e8m0fnu),
        "c64": torch.complex(x, -x),
        "u16": (x.abs() * 100).to(torch.uint16),
        "u32": (x.abs() * 100).to(torch.uint32),
        "u64": (x.abs() * 100).to(torch.uint64),
    }
    # float4: bytes of random nibbles, two values a byte
    out["f4"] = torch.randint(0, 256, (6, 4), dtype=torch.uint8, generator=g).view(
        torch.float4_e2m1fn_x2
    )
    return out


def test_every_dtype_the_official_writer_makes_reads_bit_exactly(tmp_path):
    tensors = _every_torch_dtype()
    path = tmp_path / "all.safetensors"
    st_torch.save_file(tensors, str(path))
    with dmlib.open_tensors(path) as ts:
        assert sorted(ts) == sorted(tensors)
        assert "opaque" not in ts.layout
        for name, t in tensors.items():
            got = ts[name]
            assert got.raw().tobytes() == _torch_bytes(t), name  # the stored bytes, exactly
            if name == "f4":
                assert got.shape == (6, 8)  # the logical shape: two values per stored byte
                continue
            arr = got.load()
            assert arr.shape == tuple(t.shape)
            if t.dtype.is_floating_point and t.dtype not in (torch.float32, torch.float64):
                # torch's own conversion of each low-precision value vs ml_dtypes'
                np.testing.assert_array_equal(arr.astype(np.float32), t.float().numpy())
            elif t.dtype == torch.complex64:
                np.testing.assert_array_equal(arr, t.numpy())


def test_float4_values_by_hand(tmp_path):
    # e2m1 codes: 0x1 = 0.5, 0x2 = 1.0, 0x7 = 6.0, 0x9 = -0.5, 0xF = -6.0, 0x0 = 0
    packed = torch.tensor([0x21, 0xF7, 0x09], dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    st_torch.save_file({"w": packed}, str(tmp_path / "f4.safetensors"))
    header = json.loads(
        (tmp_path / "f4.safetensors").read_bytes()[8:][
            : struct.unpack("<Q", (tmp_path / "f4.safetensors").read_bytes()[:8])[0]
        ]
    )
    assert header["w"]["dtype"] == "F4" and header["w"]["shape"] == [6]
    with dmlib.open_tensors(tmp_path / "f4.safetensors") as ts:
        vals = ts["w"].load().astype(np.float32)
    # first value of each byte in its low nibble
    np.testing.assert_array_equal(vals, [0.5, 1.0, 6.0, -6.0, -0.5, 0.0])


def test_numpy_loader_agrees_on_its_dtypes(tmp_path):
    from safetensors.numpy import load_file

    tensors = {
        k: v
        for k, v in _every_torch_dtype(1).items()
        if k in ("f64", "f32", "f16", "i64", "u8", "bool", "c64", "u32")
    }
    path = tmp_path / "np.safetensors"
    st_torch.save_file(tensors, str(path))
    ref = load_file(str(path))
    with dmlib.open_tensors(path) as ts:
        for name, arr in ref.items():
            got = ts[name].load()
            assert got.dtype == arr.dtype and got.tobytes() == arr.tobytes()


def test_dtypes_of_the_installed_release_are_known():
    # names safetensors' torch binding maps, and the sub-byte ones of its format
    names = set(st_torch._TYPES)
    known = set(SAFETENSORS_DTYPES) | set(SAFETENSORS_SUBBYTE)
    assert names - known == set()
    assert {"F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0", "C64", "F4"} <= known


def _mx_file(path, seed: int, plant: bool = False) -> dict:
    """An MXFP8 + NVFP4-style checkpoint: fp8/fp4 weights with e8m0/e4m3 block scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(16, 32, generator=g)
    fp4 = torch.randint(0, 256, (16, 16), dtype=torch.uint8, generator=g)
    if plant:
        fp4[3, 5] ^= 0x10  # the second value of that byte: element (3, 11)
    tensors = {
        "model.layers.0.mlp.up_proj.weight": w.to(torch.float8_e4m3fn),
        "model.layers.0.mlp.up_proj.weight_scale": torch.full((16, 1), 2.0).to(
            torch.float8_e8m0fnu
        ),
        "model.layers.0.mlp.down_proj.weight": fp4.view(torch.float4_e2m1fn_x2),
        "model.layers.0.mlp.down_proj.weight_scale": torch.rand(16, 2, generator=g).to(
            torch.float8_e4m3fn
        ),
        "model.layers.0.mlp.down_proj.weight_scale_2": torch.tensor([0.5]),
        "model.norm.weight": torch.ones(32).bfloat16(),
    }
    st_torch.save_file(tensors, str(path))
    return tensors


def test_mx_style_files_open_and_compare(tmp_path):
    a = _mx_file(tmp_path / "a.safetensors", 0)
    _mx_file(tmp_path / "b.safetensors", 0, plant=True)
    with dmlib.open_tensors(tmp_path / "a.safetensors") as ts:
        assert sorted(ts) == sorted(a)
        scale = ts["model.layers.0.mlp.up_proj.weight_scale"].load()
        assert scale.dtype == np.dtype(ml_dtypes.float8_e8m0fnu)
        np.testing.assert_array_equal(scale.astype(np.float32), 2.0)
    df = dmlib.compare(tmp_path / "a.safetensors", tmp_path / "b.safetensors").set_index("name")
    row = df.loc["model.layers.0.mlp.down_proj.weight"]
    assert row["dtype"] == "float4_e2m1fn"
    assert row["n_diff"] == 1 and row["first_diff"] == (3, 11)
    # the planted flip turns code c into c ^ 1 in the high nibble of byte (3, 5)
    byte = int(a["model.layers.0.mlp.down_proj.weight"].view(torch.uint8)[3, 5])
    hi = byte >> 4
    va = float(np.array([hi], np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)[0])
    vb = float(np.array([hi ^ 1], np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)[0])
    assert row["max_abs"] == abs(va - vb)
    assert (df.drop(index="model.layers.0.mlp.down_proj.weight")["n_diff"] == 0).all()


def _raw_safetensors(path, entries: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, data = {}, b""
    for name, (dtype, shape, blob) in entries.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(blob)],
        }
        data += blob
    hb = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + data)


def test_unknown_dtype_is_an_opaque_entry_not_a_refusal(tmp_path):
    w = np.arange(6, dtype="<f4")
    blob = bytes(range(10))
    _raw_safetensors(
        tmp_path / "a.safetensors", {"w": ("F32", [6], w.tobytes()), "q": ("Q5_FUTURE", [20], blob)}
    )
    other = bytearray(blob)
    other[7] ^= 0xFF
    _raw_safetensors(
        tmp_path / "b.safetensors",
        {"w": ("F32", [6], w.tobytes()), "q": ("Q5_FUTURE", [20], bytes(other))},
    )
    with dmlib.open_tensors(tmp_path / "a.safetensors") as ts:
        assert sorted(ts) == ["q", "w"]
        np.testing.assert_array_equal(ts["w"].load(), w)
        q = ts["q"]
        assert q.opaque and q.dtype_name == "Q5_FUTURE" and ts.layout["opaque"] == ["q"]
        assert q.load().tobytes() == blob
        assert q.data_hash() == hashlib.sha256(blob).hexdigest()
    full = dmlib.compare(tmp_path / "a.safetensors", tmp_path / "b.safetensors")
    df = full.set_index("name")
    assert df.loc["q", "n_diff"] == 1 and df.loc["q", "first_diff"] == (7,)
    assert df.loc["q", "dtype"] == "Q5_FUTURE"
    assert pd_isna(df.loc["q", "rel_fro"])
    assert df.loc["w", "n_diff"] == 0
    assert dmlib.summarize(full)["identical"] is False


def pd_isna(x) -> bool:
    import pandas as pd

    return bool(pd.isna(x))


def test_six_bit_dtypes_are_opaque_with_their_size_checked(tmp_path):
    _raw_safetensors(tmp_path / "f6.safetensors", {"w": ("F6_E2M3", [8], bytes(6))})
    with dmlib.open_tensors(tmp_path / "f6.safetensors") as ts:
        assert ts["w"].opaque and ts["w"].nbytes == 6
    _raw_safetensors(tmp_path / "bad.safetensors", {"w": ("F6_E2M3", [8], bytes(7))})
    with pytest.raises(dmlib.DmlibError, match="needs 6"):
        dmlib.open_tensors(tmp_path / "bad.safetensors")
    _raw_safetensors(tmp_path / "odd.safetensors", {"w": ("F4", [3], bytes(2))})
    with pytest.raises(dmlib.DmlibError, match="not a whole number of bytes"):
        dmlib.open_tensors(tmp_path / "odd.safetensors")


def test_complex_compares_per_component(tmp_path):
    from dmlib.tensor import ArrayTensorSet

    a = (np.arange(8) + 1j * np.arange(8)).astype(np.complex64)
    b = a.copy()
    b[5] = np.complex64(complex(a[5].real, np.nextafter(np.float32(a[5].imag), np.float32(99))))
    df = dmlib.compare(ArrayTensorSet({"z": a}), ArrayTensorSet({"z": b}))
    (row,) = df.to_dict("records")
    assert row["n_diff"] == 1 and row["first_diff"] == (5,) and int(row["max_ulp"]) == 1
    assert row["frac_diff"] == 1 / 16
    big = ArrayTensorSet({"z": b.astype(">c8")})
    (row2,) = dmlib.compare(ArrayTensorSet({"z": a}), big).to_dict("records")
    assert row2["n_diff"] == 1 and int(row2["max_ulp"]) == 1
