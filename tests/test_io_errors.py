"""The bad-input table: every way a checkpoint can be broken, and the error dmlib must give.

Each row builds one broken file by hand (from the format's specification, not through the
reader) and names the ``DmlibError`` subclass and a fragment of the message saying what
is wrong. Every message must also name the file and fit on one line.
"""

from __future__ import annotations

import io
import json
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import dmlib
from dmlib.errors import (
    DmlibError,
    FormatError,
    LayoutError,
    TensorNotFoundError,
    TruncatedError,
    UnknownFormatError,
    UnsupportedError,
)
from dmlib.io import cbor
from dmlib.io.burnpack import encode_burnpack

# ----------------------------------------------------------------------------- burnpack builders

W = np.arange(6, dtype="<f4").reshape(2, 3)  # 24 bytes at data offset 0
B = np.array([1, 2], dtype="<i8")  # 16 bytes at data offset 256


def _bpk() -> bytes:
    return encode_burnpack({"w": W, "b": B}, scalars={"step": 3})


def _msize(raw: bytes) -> int:
    return int.from_bytes(raw[6:10], "little")


def _base(raw: bytes) -> int:
    return -(-(10 + _msize(raw)) // 256) * 256


def _bpk_meta(tensors: dict, extra: dict | None = None) -> dict:
    return {"tensors": tensors, **(extra or {"scalars": {"step": {"UInt": 3}}})}


def _bpk_from_meta(meta: dict | bytes, data: bytes) -> bytes:
    blob = meta if isinstance(meta, bytes) else cbor.encode(meta)
    head = b"NRUB" + struct.pack("<HI", 1, len(blob)) + blob
    return head + bytes(-len(head) % 256) + data


def _desc(dtype: object, shape: list, start: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


DATA = W.tobytes() + bytes(256 - 24) + B.tobytes()  # the data section of _bpk()
GOOD_W = _desc("F32", [2, 3], 0, 24)
GOOD_B = _desc("I64", [2], 256, 272)


def _dup_names() -> bytes:
    w = cbor.encode("w") + cbor.encode(GOOD_W)
    tensors = b"\xa3" + w + cbor.encode("b") + cbor.encode(GOOD_B) + w  # 'w' twice
    blob = b"\xa2" + cbor.encode("tensors") + tensors + cbor.encode("scalars") + cbor.encode({"step": {"UInt": 3}})
    return _bpk_from_meta(blob, DATA)


def _with(raw: bytes, at: int, new: bytes) -> bytes:
    return raw[:at] + new + raw[at + len(new) :]


# (id, file name, bytes builder, error class, message fragment)
BURNPACK: list[tuple[str, str, Callable[[], bytes], type[DmlibError], str]] = [
    ("empty", "e.bpk", lambda: b"", TruncatedError, "empty file"),
    ("header-cut", "h.bpk", lambda: _bpk()[:7], TruncatedError, "shorter than the 10-byte"),
    ("metadata-cut", "m.bpk", lambda: _bpk()[: 10 + _msize(_bpk()) // 2], TruncatedError, "metadata_size"),
    ("cut-at-data-base", "d.bpk", lambda: _bpk()[: _base(_bpk())], LayoutError, "past the end"),
    ("cut-inside-tensor", "t.bpk", lambda: _bpk()[: _base(_bpk()) + 10], LayoutError, "past the end"),
    ("cut-in-padding", "p.bpk", lambda: _bpk()[: _base(_bpk()) + 100], LayoutError, "past the end"),
    ("one-byte-short", "s.bpk", lambda: _bpk()[:-1], LayoutError, "past the end"),
    ("trailing-bytes", "x.bpk", lambda: _bpk() + b"\x00" * 7, LayoutError, "not another record"),
    ("wrong-magic", "w.bpk", lambda: b"BURN" + _bpk()[4:], FormatError, "bad magic"),
    ("version-2", "v.bpk", lambda: _with(_bpk(), 4, b"\x02\x00"), UnsupportedError, "version 2"),
    ("version-0", "v0.bpk", lambda: _with(_bpk(), 4, b"\x00\x00"), UnsupportedError, "version 0"),
    ("metadata-size-past-end", "ms.bpk", lambda: _with(_bpk(), 6, struct.pack("<I", 10**9)), TruncatedError, "metadata_size 1000000000"),
    ("metadata-size-short", "mss.bpk", lambda: _with(_bpk(), 6, struct.pack("<I", _msize(_bpk()) - 1)), FormatError, "corrupt CBOR"),
    ("corrupt-cbor", "c.bpk", lambda: _with(_bpk(), 10, b"\xff\xff\xff"), FormatError, "corrupt CBOR"),
    ("cbor-trailing", "ct.bpk", lambda: _bpk_from_meta(cbor.encode(_bpk_meta({"w": GOOD_W, "b": GOOD_B})) + b"\x00", DATA), FormatError, "trailing"),
    ("cbor-not-a-map", "cn.bpk", lambda: _bpk_from_meta(cbor.encode([1, 2]), DATA), FormatError, "'tensors' map"),
    ("cbor-tag", "tag.bpk", lambda: _bpk_from_meta(b"\xc1\x00", DATA), FormatError, "tag 1"),
    ("cbor-claims-2**60-items", "big.bpk", lambda: _bpk_from_meta(b"\x9b" + (2**60).to_bytes(8, "big"), DATA), FormatError, "needs 1152921504606846976 bytes"),
    ("duplicate-name", "dup.bpk", _dup_names, FormatError, "duplicate map key 'w'"),
    ("offsets-past-eof", "o.bpk", lambda: _bpk_from_meta(_bpk_meta({"w": GOOD_W, "b": _desc("I64", [2], 512, 528)}), DATA), LayoutError, "past the end"),
    ("overlap", "ov.bpk", lambda: _bpk_from_meta(_bpk_meta({"w": _desc("F32", [2, 3], 0, 24), "b": _desc("I64", [2], 16, 32)}), DATA), LayoutError, "overlap"),
    ("shifted-by-256", "sh.bpk", lambda: _bpk_from_meta(_bpk_meta({"w": _desc("F32", [2, 3], 256, 280), "b": _desc("I64", [2], 512, 528)}), bytes(256) + DATA), LayoutError, "gap of"),
    ("length-vs-dtype-x-shape", "l.bpk", lambda: _bpk_from_meta(_bpk_meta({"w": _desc("F32", [2, 2], 0, 24), "b": GOOD_B}), DATA), LayoutError, "needs 16"),
    ("unknown-dtype", "u.bpk", lambda: _bpk_from_meta(_bpk_meta({"w": _desc("F128", [2, 3], 0, 24), "b": GOOD_B}), DATA), UnsupportedError, "unknown dtype 'F128'"),
    ("shape-not-ints", "si.bpk", lambda: _bpk_from_meta(_bpk_meta({"w": _desc("F32", [2, "3"], 0, 24), "b": GOOD_B}), DATA), FormatError, "non-negative integers"),
    ("shape-2**63-elements", "sz.bpk", lambda: _bpk_from_meta(_bpk_meta({"w": _desc("F32", [0, 2**63], 0, 0), "b": _desc("I64", [2], 0, 16)}), B.tobytes()), FormatError, "more than 2**63 bytes"),
    ("offsets-reversed", "r.bpk", lambda: _bpk_from_meta(_bpk_meta({"w": _desc("F32", [2, 3], 24, 0), "b": GOOD_B}), DATA), FormatError, "0 <= start <= end"),
    ("descriptor-missing-key", "k.bpk", lambda: _bpk_from_meta(_bpk_meta({"w": {"dtype": "F32", "shape": [2, 3]}, "b": GOOD_B}), DATA), FormatError, "lacks 'data_offsets'"),
    ("bad-scalar", "sc.bpk", lambda: _bpk_from_meta(_bpk_meta({"w": GOOD_W, "b": GOOD_B}, {"scalars": {"step": {"UInt": -1}}}), DATA), FormatError, "scalar 'step'"),
    ("metadata-not-strings", "md.bpk", lambda: _bpk_from_meta(_bpk_meta({"w": GOOD_W, "b": GOOD_B}, {"metadata": {"a": 1}}), DATA), FormatError, "'metadata'"),
]


# ----------------------------------------------------------------------------- safetensors builders


def _st(header: dict | bytes, data: bytes) -> bytes:
    hb = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(hb)) + hb + data


SDATA = W.tobytes() + B.tobytes()  # 40 bytes
S_W = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
S_B = {"dtype": "I64", "shape": [2], "data_offsets": [24, 40]}


def _st_good() -> bytes:
    return _st({"w": S_W, "b": S_B}, SDATA)


def _st_hlen(raw: bytes) -> int:
    return struct.unpack("<Q", raw[:8])[0]


SAFETENSORS: list[tuple[str, str, Callable[[], bytes], type[DmlibError], str]] = [
    ("empty", "e.safetensors", lambda: b"", TruncatedError, "empty file"),
    ("length-cut", "c.safetensors", lambda: _st_good()[:5], TruncatedError, "shorter than the 8-byte"),
    ("header-cut", "hc.safetensors", lambda: _st_good()[:20], TruncatedError, "runs past the end"),
    ("cut-at-data", "cd.safetensors", lambda: _st_good()[: 8 + _st_hlen(_st_good())], TruncatedError, "past the end"),
    ("cut-inside-tensor", "ct.safetensors", lambda: _st_good()[:-3], TruncatedError, "past the end"),
    ("trailing-bytes", "tb.safetensors", lambda: _st_good() + b"\x00" * 8, LayoutError, "after the last tensor"),
    ("wrong-magic", "w.safetensors", lambda: b"GARBAGE!" * 8, FormatError, "exceeds the"),
    ("header-length-2**63", "hl.safetensors", lambda: struct.pack("<Q", 2**63) + _st_good()[8:], FormatError, "exceeds the"),
    ("corrupt-json", "j.safetensors", lambda: _st(b'{"w": {"dtype": "F32",', SDATA), FormatError, "corrupt JSON"),
    ("json-not-object", "jo.safetensors", lambda: _st(b"[1, 2]", SDATA), FormatError, "not an object"),
    ("json-bad-utf8", "ju.safetensors", lambda: _st(b'{"\xff": 1}', SDATA), FormatError, "corrupt JSON"),
    ("json-too-deep", "jd.safetensors", lambda: _st(b'{"w": ' + b"[" * 50000 + b"]" * 50000 + b"}", SDATA), FormatError, "nests too deeply"),
    ("duplicate-name", "dup.safetensors", lambda: _st(b'{"w": ' + json.dumps(S_W).encode() + b', "b": ' + json.dumps(S_B).encode() + b', "w": ' + json.dumps(S_W).encode() + b"}", SDATA), FormatError, "names 'w' twice"),
    ("offsets-past-eof", "o.safetensors", lambda: _st({"w": S_W, "b": {**S_B, "data_offsets": [40, 56]}}, SDATA), TruncatedError, "past the end"),
    ("overlap", "ov.safetensors", lambda: _st({"w": S_W, "b": {**S_B, "data_offsets": [16, 32]}}, SDATA[:32]), LayoutError, "overlap"),
    ("gap", "g.safetensors", lambda: _st({"w": S_W, "b": {**S_B, "data_offsets": [32, 48]}}, SDATA + bytes(8)), LayoutError, "belong to no tensor"),
    ("length-vs-dtype-x-shape", "l.safetensors", lambda: _st({"w": {**S_W, "shape": [3, 3]}, "b": S_B}, SDATA), LayoutError, "needs 36"),
    ("unknown-dtype", "u.safetensors", lambda: _st({"w": {**S_W, "dtype": "F128"}, "b": S_B}, SDATA), UnsupportedError, "unknown dtype 'F128'"),
    ("shape-2**63-elements", "sz.safetensors", lambda: _st({"z": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}, "w": S_W}, SDATA[:24]), FormatError, "more than 2**63 bytes"),
    ("descriptor-missing-key", "k.safetensors", lambda: _st({"w": {"dtype": "F32", "shape": [2, 3]}, "b": S_B}, SDATA), FormatError, "must have dtype, shape, data_offsets"),
    ("metadata-not-strings", "m.safetensors", lambda: _st({"__metadata__": {"a": 1}, "w": S_W, "b": S_B}, SDATA), FormatError, "__metadata__"),
]


# ----------------------------------------------------------------------------- numpy and torch builders


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def _npy_header(header: str, data: bytes) -> bytes:
    h = header.encode("latin1")
    h += b" " * (-(10 + len(h) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + data


def _zip(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for k, v in members.items():
            z.writestr(k, v)
    return buf.getvalue()


HUGE_NPY = "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }"  # claims 4 TiB

OTHERS: list[tuple[str, str, Callable[[], bytes], type[DmlibError], str]] = [
    ("npy-empty", "e.npy", lambda: b"", TruncatedError, "empty file"),
    ("npy-cut-in-header", "h.npy", lambda: _npy(W)[:30], FormatError, "not a readable .npy"),
    ("npy-cut-in-data", "d.npy", lambda: _npy(W)[:-4], TruncatedError, "needs 24 bytes but 20"),
    ("npy-trailing-bytes", "t.npy", lambda: _npy(W) + b"\x00" * 4, LayoutError, "4 bytes after the array data"),
    ("npy-wrong-magic", "w.npy", lambda: b"\x93NUMPZ" + _npy(W)[6:], FormatError, "not a readable .npy"),
    ("npy-claims-4-TiB", "big.npy", lambda: _npy_header(HUGE_NPY, W.tobytes()), TruncatedError, "needs 4398046511104 bytes"),
    ("npy-object-dtype", "o.npy", lambda: _npy_header("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", bytes(8)), UnsupportedError, "Python objects"),
    ("npy-code-in-header", "c.npy", lambda: _npy_header("__import__('os').getcwd()", b""), FormatError, "not a readable .npy"),
    ("npz-empty", "e.npz", lambda: b"", TruncatedError, "empty file"),
    ("npz-cut", "c.npz", lambda: _zip({"w.npy": _npy(W)})[:50], FormatError, "not a readable .npz"),
    ("npz-not-a-zip", "n.npz", lambda: b"not a zip archive at all", FormatError, "not a readable .npz"),
    ("npz-member-claims-4-TiB", "big.npz", lambda: _zip({"w.npy": _npy_header(HUGE_NPY, W.tobytes())}), TruncatedError, "needs 4398046511104 bytes"),
    ("npz-member-not-npy", "m.npz", lambda: _zip({"w.txt": b"hello"}), FormatError, "not a readable .npz"),
    ("torch-empty", "e.pt", lambda: b"", TruncatedError, "empty file"),
    ("torch-garbage", "g.pt", lambda: b"PK\x03\x04" + b"\x00" * 60, FormatError, "not a loadable PyTorch"),
    ("unknown-format", "x.weights", lambda: b"\x01\x02\x03 definitely not a checkpoint", UnknownFormatError, "pass format="),
]

TABLE = BURNPACK + SAFETENSORS + OTHERS


@pytest.mark.parametrize(("case", "fname", "build", "error", "fragment"), TABLE, ids=[r[0] + ":" + r[1] for r in TABLE])
def test_bad_input_table(tmp_path: Path, case: str, fname: str, build: Callable[[], bytes], error: type[DmlibError], fragment: str) -> None:
    if fname.endswith(".pt"):
        pytest.importorskip("torch")
    path = tmp_path / fname
    path.write_bytes(build())
    with pytest.raises(error) as info:
        with dmlib.open_tensors(path) as ts:
            for t in ts.values():
                t.load()
    msg = str(info.value)
    assert fragment in msg, msg
    assert msg.startswith(f"{path}: "), msg  # names the file first
    assert info.value.path == str(path)
    assert "\n" not in msg


def test_the_table_builders_make_valid_files_when_not_broken(tmp_path: Path) -> None:
    """The baselines the rows start from are themselves valid, so each row tests one fault."""
    for name, raw, fmt in [("a.bpk", _bpk(), "burnpack"), ("b.bpk", _bpk_from_meta(_bpk_meta({"w": GOOD_W, "b": GOOD_B}), DATA), "burnpack"), ("c.safetensors", _st_good(), "safetensors"), ("d.npy", _npy(W), "npy")]:
        p = tmp_path / name
        p.write_bytes(raw)
        with dmlib.open_tensors(p) as ts:
            assert ts.format == fmt
            assert ts["w" if fmt != "npy" else "d"].load().tolist() == W.tolist()
    assert _bpk()[_base(_bpk()) :] == DATA


def test_directory_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="is a directory") as info:
        dmlib.open_tensors(tmp_path)
    assert str(tmp_path) in str(info.value)
    missing = tmp_path / "nope.bpk"
    with pytest.raises(DmlibError, match="no such file") as info:
        dmlib.open_tensors(missing)
    assert str(info.value).startswith(str(missing))
    with pytest.raises(DmlibError, match="no such file"):
        dmlib.load(missing)


@pytest.mark.parametrize("fmt", ["burnpack", "safetensors", "npz"])
def test_missing_tensor_name(tmp_path: Path, fmt: str) -> None:
    path = tmp_path / {"burnpack": "m.bpk", "safetensors": "m.safetensors", "npz": "m.npz"}[fmt]
    if fmt == "burnpack":
        path.write_bytes(_bpk())
    elif fmt == "safetensors":
        path.write_bytes(_st_good())
    else:
        np.savez(path, w=W, b=B)
    with dmlib.open_tensors(path) as ts:
        with pytest.raises(TensorNotFoundError, match="no tensor named 'nope'") as info:
            ts["nope"]
        assert isinstance(info.value, KeyError)
        assert str(info.value).startswith(str(path))
        assert "nope" not in ts and "w" in ts
        assert ts.get("nope") is None
        assert ts.get("w") is ts["w"]
    with pytest.raises(TensorNotFoundError):
        dmlib.load(path, ["w", "nope"])


def test_record_argument_errors(tmp_path: Path) -> None:
    path = tmp_path / "r.bpk"
    path.write_bytes(_bpk())
    with pytest.raises(FormatError, match="record 1 requested but the file holds 1 record"):
        dmlib.open_tensors(path, record=1)
    st = tmp_path / "r.safetensors"
    st.write_bytes(_st_good())
    with pytest.raises(FormatError, match="burnpack files only"):
        dmlib.open_tensors(st, record=0)
    with pytest.raises(UnknownFormatError, match="unknown format 'hdf5'"):
        dmlib.open_tensors(st, format="hdf5")


def test_format_forced_onto_the_wrong_file(tmp_path: Path) -> None:
    """``format=`` that does not match the bytes is refused, not misread."""
    bpk = tmp_path / "a.bpk"
    bpk.write_bytes(_bpk())
    st = tmp_path / "a.safetensors"
    st.write_bytes(_st_good())
    for path, fmt in [(bpk, "safetensors"), (st, "burnpack"), (bpk, "npy"), (st, "npz")]:
        with pytest.raises(DmlibError) as info:
            dmlib.open_tensors(path, format=fmt)
        assert str(path) in str(info.value)


def test_sharded_index_errors(tmp_path: Path) -> None:
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text("{not json")
    with pytest.raises(FormatError, match="corrupt shard index"):
        dmlib.open_tensors(idx)
    idx.write_text(json.dumps({"weight_map": {"w": "missing.safetensors"}}))
    with pytest.raises(FormatError, match="does not exist"):
        dmlib.open_tensors(idx)
    idx.write_text(json.dumps({"weight_map": {"w": "../escape.safetensors"}}))
    with pytest.raises(FormatError, match="not a file name"):
        dmlib.open_tensors(idx)
    (tmp_path / "s.safetensors").write_bytes(_st_good())
    idx.write_text(json.dumps({"weight_map": {"zz": "s.safetensors"}}))
    with pytest.raises(FormatError, match="does not hold it"):
        dmlib.open_tensors(idx)
    idx.write_text(json.dumps([1, 2]))
    with pytest.raises(FormatError, match="weight_map"):
        dmlib.open_tensors(idx)


def test_sharded_index_hostile_contents(tmp_path: Path) -> None:
    (tmp_path / "s.safetensors").write_bytes(_st_good())
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text(json.dumps({"metadata": ["not", "a", "map"], "weight_map": {"w": "s.safetensors"}}))
    with pytest.raises(FormatError, match="'metadata' is a list"):
        dmlib.open_tensors(idx)
    idx.write_text('{"weight_map": ' + "[" * 50000 + "]" * 50000 + "}")
    with pytest.raises(FormatError, match="nests too deeply"):
        dmlib.open_tensors(idx)
    with pytest.raises(DmlibError, match="no such file"):
        dmlib.open_tensors(tmp_path / "missing.safetensors.index.json")
    (tmp_path / "dir.safetensors.index.json").mkdir()
    with pytest.raises(FormatError, match="is a directory"):
        dmlib.open_tensors(tmp_path / "dir.safetensors.index.json")
    idx.write_text(json.dumps({"metadata": {"total_size": 40}, "weight_map": {"w": "s.safetensors", "b": "s.safetensors"}}))
    with dmlib.open_tensors(idx) as ts:
        assert ts.metadata == {"total_size": "40"} and ts["w"].load().tolist() == W.tolist()


def test_messages_stay_on_one_line(tmp_path: Path) -> None:
    """Even when the cause quotes a library's multi-line message (torch's run to paragraphs)."""
    err = FormatError("first line\n\n  second \x1b[1mline\x1b[0m\r\nthird", path=tmp_path / "x.pt")
    assert str(err) == f"{tmp_path / 'x.pt'}: first line second line third"


@pytest.mark.skipif(not hasattr(__import__("os"), "mkfifo"), reason="no named pipes on this platform")
def test_named_pipe_is_refused_without_blocking(tmp_path: Path) -> None:
    """Opening a FIFO for reading blocks until a writer appears: it must be refused first."""
    import os

    fifo = tmp_path / "pipe.bpk"
    os.mkfifo(fifo)
    with pytest.raises(FormatError, match="not a regular file") as info:
        dmlib.open_tensors(fifo)
    assert str(info.value).startswith(str(fifo))


def test_torch_archive_with_a_damaged_local_header_is_refused(tmp_path: Path) -> None:
    """torch itself would read the storage from a shifted window (it checks no CRC)."""
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"a": torch.arange(4, dtype=torch.float32), "b": torch.tensor([1.0, -1.0, 0.5])}, buf)
    raw = bytearray(buf.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as z:
        storage = next(i for i in z.infolist() if i.filename.endswith("data/1"))
    raw[storage.header_offset + 26] ^= 1  # the local header's file-name length, so its data moves by one byte
    path = tmp_path / "shifted.pt"
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="does not match its central-directory entry") as info:
        dmlib.open_tensors(path)
    assert str(info.value).startswith(str(path))


def test_torch_archive_claiming_several_disks_is_refused(tmp_path: Path) -> None:
    """``zipfile.is_zipfile`` itself raises on this end record; still one DmlibError."""
    torch = pytest.importorskip("torch")
    buf = io.BytesIO()
    torch.save({"a": torch.arange(4, dtype=torch.float32)}, buf)
    raw = bytearray(buf.getvalue())
    locator = raw.rfind(b"PK\x06\x07")  # torch writes zip64 end records
    if locator < 0:
        pytest.skip("this torch writes no zip64 end-of-central-directory locator")
    raw[locator + 16] ^= 2  # the locator's "total number of disks": 1 -> 3
    path = tmp_path / "disks.pt"
    path.write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="damaged zip archive") as info:
        dmlib.open_tensors(path)
    assert str(info.value).startswith(str(path))
