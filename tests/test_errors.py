"""Errors: every way an input can be wrong, and what dmlib must do about it.

Readers
-------
The bad-input table: every way a checkpoint can be broken, and the error dmlib must give.

Each row builds one broken file by hand (from the format's specification, not through the
reader) and names the ``DmlibError`` subclass and a fragment of the message saying what
is wrong. Every message must also name the file and fit on one line.

Wrong files
-----------
Valid-looking but wrong files: dmlib reads them correctly or refuses them, and never
returns a shifted window of plausible bytes.

Expected values are the arrays the files were written from; layouts are computed here
from the format's rules, not read back from dmlib.

The command line
----------------
Every ``dmlib`` subcommand, on every class of bad input: one line on stderr, exit 2.

Subcommands are discovered from the parser, so a new one is covered as soon as it is
registered; ``ARGV`` says how to call those that need more than input paths.
"""

from __future__ import annotations

import argparse
import io
import json
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import cbor2
import numpy as np
import pytest
from _support import cli_argv
from _support.cli_argv import CAPTURE_COMMANDS, CKPT_ARGV, CKPT_ARGV_SECOND, subcommands
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import dmlib
from dmlib.cli import main
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
from dmlib.io.burnpack import encode_burnpack, write_records

# ----------------------------------------------------------------------------------------
# Readers


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
    blob = (
        b"\xa2"
        + cbor.encode("tensors")
        + tensors
        + cbor.encode("scalars")
        + cbor.encode({"step": {"UInt": 3}})
    )
    return _bpk_from_meta(blob, DATA)


def _with(raw: bytes, at: int, new: bytes) -> bytes:
    return raw[:at] + new + raw[at + len(new) :]


# (id, file name, bytes builder, error class, message fragment)
BURNPACK: list[tuple[str, str, Callable[[], bytes], type[DmlibError], str]] = [
    ("empty", "e.bpk", lambda: b"", TruncatedError, "empty file"),
    ("header-cut", "h.bpk", lambda: _bpk()[:7], TruncatedError, "shorter than the 10-byte"),
    (
        "metadata-cut",
        "m.bpk",
        lambda: _bpk()[: 10 + _msize(_bpk()) // 2],
        TruncatedError,
        "metadata_size",
    ),
    ("cut-at-data-base", "d.bpk", lambda: _bpk()[: _base(_bpk())], LayoutError, "past the end"),
    (
        "cut-inside-tensor",
        "t.bpk",
        lambda: _bpk()[: _base(_bpk()) + 10],
        LayoutError,
        "past the end",
    ),
    ("cut-in-padding", "p.bpk", lambda: _bpk()[: _base(_bpk()) + 100], LayoutError, "past the end"),
    ("one-byte-short", "s.bpk", lambda: _bpk()[:-1], LayoutError, "past the end"),
    ("trailing-bytes", "x.bpk", lambda: _bpk() + b"\x00" * 7, LayoutError, "not another record"),
    ("wrong-magic", "w.bpk", lambda: b"BURN" + _bpk()[4:], FormatError, "bad magic"),
    ("version-2", "v.bpk", lambda: _with(_bpk(), 4, b"\x02\x00"), UnsupportedError, "version 2"),
    ("version-0", "v0.bpk", lambda: _with(_bpk(), 4, b"\x00\x00"), UnsupportedError, "version 0"),
    (
        "metadata-size-past-end",
        "ms.bpk",
        lambda: _with(_bpk(), 6, struct.pack("<I", 10**9)),
        TruncatedError,
        "metadata_size 1000000000",
    ),
    (
        "metadata-size-short",
        "mss.bpk",
        lambda: _with(_bpk(), 6, struct.pack("<I", _msize(_bpk()) - 1)),
        FormatError,
        "corrupt CBOR",
    ),
    (
        "corrupt-cbor",
        "c.bpk",
        lambda: _with(_bpk(), 10, b"\xff\xff\xff"),
        FormatError,
        "corrupt CBOR",
    ),
    (
        "cbor-trailing",
        "ct.bpk",
        lambda: _bpk_from_meta(cbor.encode(_bpk_meta({"w": GOOD_W, "b": GOOD_B})) + b"\x00", DATA),
        FormatError,
        "trailing",
    ),
    (
        "cbor-not-a-map",
        "cn.bpk",
        lambda: _bpk_from_meta(cbor.encode([1, 2]), DATA),
        FormatError,
        "'tensors' map",
    ),
    ("cbor-tag", "tag.bpk", lambda: _bpk_from_meta(b"\xc1\x00", DATA), FormatError, "tag 1"),
    (
        "cbor-claims-2**60-items",
        "big.bpk",
        lambda: _bpk_from_meta(b"\x9b" + (2**60).to_bytes(8, "big"), DATA),
        FormatError,
        "needs 1152921504606846976 bytes",
    ),
    ("duplicate-name", "dup.bpk", _dup_names, FormatError, "duplicate map key 'w'"),
    (
        "offsets-past-eof",
        "o.bpk",
        lambda: _bpk_from_meta(_bpk_meta({"w": GOOD_W, "b": _desc("I64", [2], 512, 528)}), DATA),
        LayoutError,
        "past the end",
    ),
    (
        "overlap",
        "ov.bpk",
        lambda: _bpk_from_meta(
            _bpk_meta({"w": _desc("F32", [2, 3], 0, 24), "b": _desc("I64", [2], 16, 32)}), DATA
        ),
        LayoutError,
        "overlap",
    ),
    (
        "shifted-by-256",
        "sh.bpk",
        lambda: _bpk_from_meta(
            _bpk_meta({"w": _desc("F32", [2, 3], 256, 280), "b": _desc("I64", [2], 512, 528)}),
            bytes(256) + DATA,
        ),
        LayoutError,
        "gap of",
    ),
    (
        "length-vs-dtype-x-shape",
        "l.bpk",
        lambda: _bpk_from_meta(_bpk_meta({"w": _desc("F32", [2, 2], 0, 24), "b": GOOD_B}), DATA),
        LayoutError,
        "needs 16",
    ),
    (
        "unknown-dtype",
        "u.bpk",
        lambda: _bpk_from_meta(_bpk_meta({"w": _desc("F128", [2, 3], 0, 24), "b": GOOD_B}), DATA),
        UnsupportedError,
        "unknown dtype 'F128'",
    ),
    (
        "shape-not-ints",
        "si.bpk",
        lambda: _bpk_from_meta(_bpk_meta({"w": _desc("F32", [2, "3"], 0, 24), "b": GOOD_B}), DATA),
        FormatError,
        "non-negative integers",
    ),
    (
        "shape-2**63-elements",
        "sz.bpk",
        lambda: _bpk_from_meta(
            _bpk_meta({"w": _desc("F32", [0, 2**63], 0, 0), "b": _desc("I64", [2], 0, 16)}),
            B.tobytes(),
        ),
        FormatError,
        "more than 2**63 bytes",
    ),
    (
        "offsets-reversed",
        "r.bpk",
        lambda: _bpk_from_meta(_bpk_meta({"w": _desc("F32", [2, 3], 24, 0), "b": GOOD_B}), DATA),
        FormatError,
        "0 <= start <= end",
    ),
    (
        "descriptor-missing-key",
        "k.bpk",
        lambda: _bpk_from_meta(
            _bpk_meta({"w": {"dtype": "F32", "shape": [2, 3]}, "b": GOOD_B}), DATA
        ),
        FormatError,
        "lacks 'data_offsets'",
    ),
    (
        "bad-scalar",
        "sc.bpk",
        lambda: _bpk_from_meta(
            _bpk_meta({"w": GOOD_W, "b": GOOD_B}, {"scalars": {"step": {"UInt": -1}}}), DATA
        ),
        FormatError,
        "scalar 'step'",
    ),
    (
        "metadata-not-strings",
        "md.bpk",
        lambda: _bpk_from_meta(_bpk_meta({"w": GOOD_W, "b": GOOD_B}, {"metadata": {"a": 1}}), DATA),
        FormatError,
        "'metadata'",
    ),
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
    (
        "length-cut",
        "c.safetensors",
        lambda: _st_good()[:5],
        TruncatedError,
        "shorter than the 8-byte",
    ),
    ("header-cut", "hc.safetensors", lambda: _st_good()[:20], TruncatedError, "runs past the end"),
    (
        "cut-at-data",
        "cd.safetensors",
        lambda: _st_good()[: 8 + _st_hlen(_st_good())],
        TruncatedError,
        "past the end",
    ),
    (
        "cut-inside-tensor",
        "ct.safetensors",
        lambda: _st_good()[:-3],
        TruncatedError,
        "past the end",
    ),
    (
        "trailing-bytes",
        "tb.safetensors",
        lambda: _st_good() + b"\x00" * 8,
        LayoutError,
        "after the last tensor",
    ),
    ("wrong-magic", "w.safetensors", lambda: b"GARBAGE!" * 8, FormatError, "exceeds the"),
    (
        "header-length-2**63",
        "hl.safetensors",
        lambda: struct.pack("<Q", 2**63) + _st_good()[8:],
        FormatError,
        "exceeds the",
    ),
    (
        "corrupt-json",
        "j.safetensors",
        lambda: _st(b'{"w": {"dtype": "F32",', SDATA),
        FormatError,
        "corrupt JSON",
    ),
    (
        "json-not-object",
        "jo.safetensors",
        lambda: _st(b"[1, 2]", SDATA),
        FormatError,
        "not an object",
    ),
    (
        "json-bad-utf8",
        "ju.safetensors",
        lambda: _st(b'{"\xff": 1}', SDATA),
        FormatError,
        "corrupt JSON",
    ),
    (
        "json-too-deep",
        "jd.safetensors",
        lambda: _st(b'{"w": ' + b"[" * 50000 + b"]" * 50000 + b"}", SDATA),
        FormatError,
        "nests too deeply",
    ),
    (
        "duplicate-name",
        "dup.safetensors",
        lambda: _st(
            b'{"w": '
            + json.dumps(S_W).encode()
            + b', "b": '
            + json.dumps(S_B).encode()
            + b', "w": '
            + json.dumps(S_W).encode()
            + b"}",
            SDATA,
        ),
        FormatError,
        "names 'w' twice",
    ),
    (
        "offsets-past-eof",
        "o.safetensors",
        lambda: _st({"w": S_W, "b": {**S_B, "data_offsets": [40, 56]}}, SDATA),
        TruncatedError,
        "past the end",
    ),
    (
        "overlap",
        "ov.safetensors",
        lambda: _st({"w": S_W, "b": {**S_B, "data_offsets": [16, 32]}}, SDATA[:32]),
        LayoutError,
        "overlap",
    ),
    (
        "gap",
        "g.safetensors",
        lambda: _st({"w": S_W, "b": {**S_B, "data_offsets": [32, 48]}}, SDATA + bytes(8)),
        LayoutError,
        "belong to no tensor",
    ),
    (
        "length-vs-dtype-x-shape",
        "l.safetensors",
        lambda: _st({"w": {**S_W, "shape": [3, 3]}, "b": S_B}, SDATA),
        LayoutError,
        "needs 36",
    ),
    # an unknown dtype name is an opaque entry (tests/test_io_safetensors_dtypes.py); a dtype
    # that is no name at all is a broken header
    (
        "dtype-not-a-name",
        "u.safetensors",
        lambda: _st({"w": {**S_W, "dtype": 128}, "b": S_B}, SDATA),
        FormatError,
        "dtype 128 is not a dtype name",
    ),
    (
        "shape-2**63-elements",
        "sz.safetensors",
        lambda: _st(
            {"z": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}, "w": S_W},
            SDATA[:24],
        ),
        FormatError,
        "more than 2**63 bytes",
    ),
    (
        "descriptor-missing-key",
        "k.safetensors",
        lambda: _st({"w": {"dtype": "F32", "shape": [2, 3]}, "b": S_B}, SDATA),
        FormatError,
        "must have dtype, shape, data_offsets",
    ),
    (
        "metadata-not-strings",
        "m.safetensors",
        lambda: _st({"__metadata__": {"a": 1}, "w": S_W, "b": S_B}, SDATA),
        FormatError,
        "__metadata__",
    ),
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
    (
        "npy-trailing-bytes",
        "t.npy",
        lambda: _npy(W) + b"\x00" * 4,
        LayoutError,
        "4 bytes after the array data",
    ),
    (
        "npy-wrong-magic",
        "w.npy",
        lambda: b"\x93NUMPZ" + _npy(W)[6:],
        FormatError,
        "not a readable .npy",
    ),
    (
        "npy-claims-4-TiB",
        "big.npy",
        lambda: _npy_header(HUGE_NPY, W.tobytes()),
        TruncatedError,
        "needs 4398046511104 bytes",
    ),
    (
        "npy-object-dtype",
        "o.npy",
        lambda: _npy_header("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }", bytes(8)),
        UnsupportedError,
        "Python objects",
    ),
    (
        "npy-code-in-header",
        "c.npy",
        lambda: _npy_header("__import__('os').getcwd()", b""),
        FormatError,
        "not a readable .npy",
    ),
    ("npz-empty", "e.npz", lambda: b"", TruncatedError, "empty file"),
    ("npz-cut", "c.npz", lambda: _zip({"w.npy": _npy(W)})[:50], FormatError, "not a readable .npz"),
    (
        "npz-not-a-zip",
        "n.npz",
        lambda: b"not a zip archive at all",
        FormatError,
        "not a readable .npz",
    ),
    (
        "npz-member-claims-4-TiB",
        "big.npz",
        lambda: _zip({"w.npy": _npy_header(HUGE_NPY, W.tobytes())}),
        TruncatedError,
        "needs 4398046511104 bytes",
    ),
    (
        "npz-member-not-npy",
        "m.npz",
        lambda: _zip({"w.txt": b"hello"}),
        FormatError,
        "not a readable .npz",
    ),
    ("torch-empty", "e.pt", lambda: b"", TruncatedError, "empty file"),
    (
        "torch-garbage",
        "g.pt",
        lambda: b"PK\x03\x04" + b"\x00" * 60,
        FormatError,
        "not a loadable PyTorch",
    ),
    (
        "flax-msgpack-cut",
        "c.msgpack",
        lambda: b"\x81\xa1w\xc7\x20\x01\x93",
        FormatError,
        "not a valid msgpack file",
    ),
    (
        "flax-msgpack-unknown-extension",
        "x.msgpack",
        lambda: b"\x81\xa1w\xd4\x63\x00",
        UnsupportedError,
        "extension type 99",
    ),
    (
        "unknown-format",
        "x.weights",
        lambda: b"\x01\x02\x03 definitely not a checkpoint",
        UnknownFormatError,
        "pass format=",
    ),
]

TABLE = BURNPACK + SAFETENSORS + OTHERS


@pytest.mark.parametrize(
    ("case", "fname", "build", "error", "fragment"), TABLE, ids=[r[0] + ":" + r[1] for r in TABLE]
)
def test_bad_input_table(
    tmp_path: Path,
    case: str,
    fname: str,
    build: Callable[[], bytes],
    error: type[DmlibError],
    fragment: str,
) -> None:
    if fname.endswith(".pt"):
        pytest.importorskip("torch")
    if fname.endswith(".msgpack"):
        pytest.importorskip("msgpack")
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
    for name, raw, fmt in [
        ("a.bpk", _bpk(), "burnpack"),
        ("b.bpk", _bpk_from_meta(_bpk_meta({"w": GOOD_W, "b": GOOD_B}), DATA), "burnpack"),
        ("c.safetensors", _st_good(), "safetensors"),
        ("d.npy", _npy(W), "npy"),
    ]:
        p = tmp_path / name
        p.write_bytes(raw)
        with dmlib.open_tensors(p) as ts:
            assert ts.format == fmt
            assert ts["w" if fmt != "npy" else "d"].load().tolist() == W.tolist()
    assert _bpk()[_base(_bpk()) :] == DATA


def test_directory_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="is a directory") as info:
        dmlib.open_tensors(tmp_path)  # an empty folder: neither DCP nor Orbax
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
    idx.write_text(
        json.dumps({"metadata": ["not", "a", "map"], "weight_map": {"w": "s.safetensors"}})
    )
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
    idx.write_text(
        json.dumps(
            {
                "metadata": {"total_size": 40},
                "weight_map": {"w": "s.safetensors", "b": "s.safetensors"},
            }
        )
    )
    with dmlib.open_tensors(idx) as ts:
        assert ts.metadata == {"total_size": "40"} and ts["w"].load().tolist() == W.tolist()


def test_messages_stay_on_one_line(tmp_path: Path) -> None:
    """Even when the cause quotes a library's multi-line message (torch's run to paragraphs)."""
    err = FormatError("first line\n\n  second \x1b[1mline\x1b[0m\r\nthird", path=tmp_path / "x.pt")
    assert str(err) == f"{tmp_path / 'x.pt'}: first line second line third"


@pytest.mark.skipif(
    not hasattr(__import__("os"), "mkfifo"), reason="no named pipes on this platform"
)
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
    torch.save(
        {"a": torch.arange(4, dtype=torch.float32), "b": torch.tensor([1.0, -1.0, 0.5])}, buf
    )
    raw = bytearray(buf.getvalue())
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as z:
        storage = next(i for i in z.infolist() if i.filename.endswith("data/1"))
    raw[storage.header_offset + 26] ^= (
        1  # the local header's file-name length, so its data moves by one byte
    )
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


# ----------------------------------------------------------------------------------------
# Wrong files


# sizes chosen so that no start but the first is 256-aligned in the legacy layout
TENSORS = {
    "enc.w": np.arange(15, dtype="<f4").reshape(3, 5) / 7,
    "enc.b": np.array([-1.5, 2.25, 0.0], dtype="<f4"),
    "mask": np.array([True, False, True, True]),
    "steps": np.array([3, 1, 4, 1, 5], dtype="<i8"),
}


def _align(n: int) -> int:
    return -(-n // 256) * 256


def _split(raw: bytes) -> tuple[int, dict]:
    msize = struct.unpack("<I", raw[6:10])[0]
    return msize, cbor2.loads(raw[10 : 10 + msize])


def _rebuild(meta: dict, data_section: bytes, *, legacy: bool = False) -> bytes:
    blob = cbor.encode(meta)
    head = b"NRUB" + struct.pack("<HI", 1, len(blob)) + blob
    return head + (b"" if legacy else bytes(_align(len(head)) - len(head))) + data_section


def _write(tmp_path: Path, raw: bytes, name: str = "f.bpk") -> Path:
    p = tmp_path / name
    p.write_bytes(raw)
    return p


def _values(ts: dmlib.TensorSet) -> dict[str, bytes]:
    return {n: t.load().tobytes() for n, t in ts.items()}


EXPECTED = {n: np.ascontiguousarray(a).tobytes() for n, a in TENSORS.items()}


def test_legacy_file_reads_correctly_and_says_so(tmp_path: Path) -> None:
    raw = encode_burnpack(TENSORS, layout="legacy-unaligned")
    msize, meta = _split(raw)
    # the legacy rules, checked here: data right after the metadata, tensors back to back
    spans = sorted(tuple(d["data_offsets"]) for d in meta["tensors"].values())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert len(raw) == 10 + msize + spans[-1][1]
    with dmlib.open_tensors(_write(tmp_path, raw)) as ts:
        assert ts.layout["layout"] == "legacy-unaligned"
        assert ts.layout["data_base"] == 10 + msize
        assert _values(ts) == EXPECTED


def test_legacy_bytes_read_at_the_aligned_base_are_refused(tmp_path: Path) -> None:
    """Pad the legacy file so that its length fits the aligned base: still refused."""
    raw = encode_burnpack(TENSORS, layout="legacy-unaligned")
    msize, _ = _split(raw)
    delta = _align(10 + msize) - (10 + msize)
    assert delta > 0
    for fill in (b"\x00", b"\xab"):
        with pytest.raises(LayoutError) as info:
            dmlib.open_tensors(_write(tmp_path, raw + fill * delta))
        assert "no valid data base" in str(info.value) or "ambiguous" in str(info.value)


def test_aligned_file_cut_to_look_legacy_is_refused(tmp_path: Path) -> None:
    """Tensors of 256-byte multiples pack back to back in both layouts: an aligned file cut
    short by the header padding fits the legacy layout exactly. dmlib must not read it."""
    tensors = {"a": np.arange(64, dtype="<f4"), "b": np.arange(3, dtype="<i2")}
    raw = encode_burnpack(tensors)
    msize, _ = _split(raw)
    delta = _align(10 + msize) - (10 + msize)
    cut = raw[: len(raw) - delta]
    with pytest.raises(LayoutError, match="ambiguous"):
        dmlib.open_tensors(_write(tmp_path, cut))
    # with scalars (which legacy files never had) the legacy reading is ruled out by name
    raw = encode_burnpack(tensors, scalars={"step": 1})
    msize, _ = _split(raw)
    cut = raw[: len(raw) - (_align(10 + msize) - (10 + msize))]
    with pytest.raises(LayoutError, match="scalars"):
        dmlib.open_tensors(_write(tmp_path, cut))


@pytest.mark.parametrize("victims", [["steps"], ["enc.w"], ["enc.w", "enc.b", "mask", "steps"]])
def test_offsets_shifted_by_one_alignment_unit_are_refused(
    tmp_path: Path, victims: list[str]
) -> None:
    raw = encode_burnpack(TENSORS)
    msize, meta = _split(raw)
    section = raw[_align(10 + msize) :]
    for n in victims:
        meta["tensors"][n]["data_offsets"] = [o + 256 for o in meta["tensors"][n]["data_offsets"]]
    # lengthen the file so every shifted tensor still lies inside it
    bad = _rebuild(meta, section + bytes(256))
    with pytest.raises(LayoutError):
        dmlib.open_tensors(_write(tmp_path, bad))


def test_tensor_pointing_at_its_neighbours_bytes_is_refused(tmp_path: Path) -> None:
    tensors = {"a": np.ones(8, "<f4"), "b": np.full(8, 2.0, "<f4"), "c": np.full(8, 3.0, "<f4")}
    raw = encode_burnpack(tensors)
    msize, meta = _split(raw)
    section = raw[_align(10 + msize) :]
    meta["tensors"]["b"]["data_offsets"] = list(
        meta["tensors"]["a"]["data_offsets"]
    )  # b := a's bytes
    with pytest.raises(LayoutError):
        dmlib.open_tensors(_write(tmp_path, _rebuild(meta, section)))
    # safetensors: same fault
    sraw = dmlib.io.safetensors.encode_safetensors(tensors)
    n = struct.unpack("<Q", sraw[:8])[0]
    import json

    header = json.loads(sraw[8 : 8 + n])
    header["b"]["data_offsets"] = header["a"]["data_offsets"]
    hb = json.dumps(header).encode()
    p = tmp_path / "n.safetensors"
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + sraw[8 + n :])
    with pytest.raises(LayoutError):
        dmlib.open_tensors(p)


def test_multi_record_file_reads_each_record(tmp_path: Path) -> None:
    model = {"w": np.arange(6, dtype="<f4").reshape(2, 3), "b": np.array([0.5], "<f4")}
    optim = {"w.moment1": np.full((2, 3), 0.25, "<f4"), "w.moment2": np.full((2, 3), 1e-8, "<f4")}
    ema = {"w": np.arange(6, dtype="<f4").reshape(2, 3) * 0.9, "flags": np.array([True, False])}
    images = [encode_burnpack(r) for r in (model, optim, ema)]
    path = tmp_path / "multi.bpk"
    write_records(path, images, pad_fill=lambda off, n: b"\x7f" * n)
    # record starts, from the rule: each at the next 256-byte boundary after the previous end
    starts = [0]
    for img in images[:-1]:
        starts.append(_align(starts[-1] + len(img)))
    with dmlib.open_tensors(path) as ts:
        assert [r.start for r in ts.records] == starts
        assert [r.end for r in ts.records] == [s + len(img) for s, img in zip(starts, images)]
        for i, rec in enumerate((model, optim, ema)):
            prefix = "" if i == 0 else f"record{i}/"
            for n, a in rec.items():
                assert ts[prefix + n].load().tobytes() == a.tobytes()
                assert ts.records[i][n].load().tobytes() == a.tobytes()
            with dmlib.open_tensors(path, record=i) as r:
                assert set(r) == set(rec)
                assert _values(r) == {n: a.tobytes() for n, a in rec.items()}
                msize = struct.unpack("<I", images[i][6:10])[0]
                assert r.data_base == starts[i] + _align(10 + msize)


# ----------------------------------------------------------------------------- property: never shifted

SHIFTS = [1, 4, 8, 255, 256, 512]


@settings(
    max_examples=40,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    shift=st.sampled_from(SHIFTS),
    which=st.sampled_from(["all", "first", "last"]),
    layout=st.sampled_from(["aligned", "legacy-unaligned"]),
)
def test_shifted_offsets_are_never_read_as_data(
    tmp_path: Path, sizes: list[int], shift: int, which: str, layout: str
) -> None:
    """Shift some offsets, give the file whatever length makes them fit: correct or refused."""
    rng = np.random.default_rng(len(sizes) * 1000 + sum(sizes))
    tensors = {f"t{i}": rng.integers(1, 255, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    raw = encode_burnpack(tensors, layout=layout)
    msize, meta = _split(raw)
    legacy = layout != "aligned"
    base = 10 + msize if legacy else _align(10 + msize)
    section = raw[base:]
    names = (
        list(tensors)
        if which == "all"
        else [next(iter(tensors))]
        if which == "first"
        else [list(tensors)[-1]]
    )
    for n in names:
        s, e = meta["tensors"][n]["data_offsets"]
        meta["tensors"][n]["data_offsets"] = [s + shift, e + shift]
    new_end = max(d["data_offsets"][1] for d in meta["tensors"].values())
    section = section + bytes(max(0, new_end - len(section)))
    bad = _rebuild(meta, section, legacy=legacy)
    try:
        with dmlib.open_tensors(_write(tmp_path, bad, "shift.bpk")) as ts:
            got = _values(ts)
    except DmlibError:
        event("refused")
        return
    event("read")
    # read: then every tensor must hold its own bytes (possible only when nothing moved
    # for real, e.g. an empty tensor's start)
    for n, a in tensors.items():
        assert got[n] == a.tobytes(), f"{n} read as shifted data (shift {shift}, {which}, {layout})"


@pytest.mark.parametrize("shift", [1, 8, 256])
def test_safetensors_offsets_shifted_are_refused(tmp_path: Path, shift: int) -> None:
    """Every offset moved by ``shift`` and the file lengthened to match: refused, not read shifted."""
    import json

    tensors = {"a": np.arange(6, dtype="<f4"), "b": np.arange(3, dtype="<i8")}
    raw = dmlib.io.safetensors.encode_safetensors(tensors)
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    for d in header.values():
        d["data_offsets"] = [o + shift for o in d["data_offsets"]]
    hb = json.dumps(header).encode()
    p = tmp_path / "s.safetensors"
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n :] + bytes(shift))
    with pytest.raises(LayoutError, match="belong to no tensor"):
        dmlib.open_tensors(p)


# ----------------------------------------------------------------------------------------
# The command line


def _good_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "layer.u": rng.standard_normal((4, 2)).astype(np.float32),
        "layer.s": np.array([2.0, 1.0], np.float32),
        "layer.v": rng.standard_normal((3, 2)).astype(np.float32),
        "layer.bias": np.zeros(3, np.float32),
    }


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("good")
    p = d / "good.bpk"
    p.write_bytes(encode_burnpack(_good_tensors(), scalars={"step": 1}))
    p2 = d / "good-step2.bpk"
    p2.write_bytes(
        encode_burnpack({k: v * 1.5 for k, v in _good_tensors().items()}, scalars={"step": 2})
    )
    return {"ckpt": p, "step2": p2}


@pytest.fixture(scope="module")
def good_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch = pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("cap") / "cap"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with torch.no_grad(), dmlib.capture(model, d):
        model(torch.ones(1, 3))
    return d


def _generic_argv(sub: argparse.ArgumentParser, bad: str, good: str) -> list[str]:
    argv: list[str] = []
    for a in sub._actions:
        if a.option_strings:
            if a.required:
                pytest.fail(
                    f"subcommand needs option {a.option_strings}: add it to CKPT_ARGV in {cli_argv.__file__}"
                )
            continue
        argv += [bad] if not argv else [good]
        if a.nargs in ("+", "*"):
            argv.append(good)
    return argv


def _bad_inputs(root: Path, good_ckpt: Path) -> dict[str, Path]:
    raw = good_ckpt.read_bytes()
    out = {"missing": root / "missing.bpk", "directory": root / "a_directory"}
    out["directory"].mkdir(exist_ok=True)
    (root / "empty.bpk").write_bytes(b"")
    out["empty"] = root / "empty.bpk"
    (root / "magic.bpk").write_bytes(b"XXXX" + raw[4:])
    out["wrong-magic"] = root / "magic.bpk"
    (root / "cut.bpk").write_bytes(raw[: len(raw) - 3])
    out["truncated"] = root / "cut.bpk"
    (root / "noise.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    out["corrupt-header"] = root / "noise.safetensors"
    return out


BAD_KINDS = ["missing", "directory", "empty", "wrong-magic", "truncated", "corrupt-header"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse usage errors exit here
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _check_one_line(rc: int, err: str, bad: Path, argv: list[str]) -> None:
    assert rc == 2, f"{argv}: exit {rc}, stderr {err!r}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{argv}: stderr has {len(lines)} lines: {err!r}"
    assert str(bad) in lines[0] or bad.name in lines[0], (
        f"{argv}: the message does not name {bad}: {lines[0]}"
    )


# known departures from the contract, each failing as described (strict: fixed => noticed)
KNOWN_BAD: dict[str, str] = {}


def _commands(names: set[str]) -> list:
    return [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BAD[c]))
        if c in KNOWN_BAD
        else c
        for c in sorted(names)
    ]


@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize("command", _commands(set(subcommands()) - CAPTURE_COMMANDS))
def test_checkpoint_commands_on_bad_input(
    command: str,
    kind: str,
    good: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    bad = _bad_inputs(tmp_path, good["ckpt"])[kind]
    sub = subcommands()[command]
    build = CKPT_ARGV.get(command, lambda b, g: _generic_argv(sub, b, g))
    argvs = [build(str(bad), str(good["ckpt"]))]
    if command in CKPT_ARGV_SECOND:
        argvs.append(CKPT_ARGV_SECOND[command](str(bad), str(good["ckpt"])))
    for argv in argvs:
        rc, _, err = _run([command, *argv], capsys)
        _check_one_line(rc, err, bad, [command, *argv])


def _bad_captures(root: Path, good: Path) -> dict[str, Path]:
    out = {"missing": root / "missing_capture"}
    (root / "empty_dir").mkdir()
    out["directory-without-manifest"] = root / "empty_dir"
    (root / "plain_file").write_bytes(b"")
    out["empty-file"] = root / "plain_file"
    (root / "cut").mkdir()
    text = (good / "manifest.json").read_text()
    (root / "cut" / "manifest.json").write_text(text[: len(text) // 2])
    out["truncated-manifest"] = root / "cut"
    (root / "wrong").mkdir()
    (root / "wrong" / "manifest.json").write_text(
        json.dumps({"format": "something else", "version": 99})
    )
    out["wrong-format"] = root / "wrong"
    return out


CAPTURE_KINDS = [
    "missing",
    "directory-without-manifest",
    "empty-file",
    "truncated-manifest",
    "wrong-format",
]


@pytest.mark.parametrize("kind", CAPTURE_KINDS)
@pytest.mark.parametrize("command", sorted(CAPTURE_COMMANDS & set(subcommands())))
def test_capture_commands_on_bad_input(
    command: str, kind: str, good_capture: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _bad_captures(tmp_path, good_capture)[kind]
    for argv in ([str(bad), str(good_capture)], [str(good_capture), str(bad)]):
        rc, _, err = _run([command, *argv], capsys)
        _check_one_line(rc, err, bad, [command, *argv])


def test_the_good_inputs_are_accepted(
    good: dict[str, Path], good_capture: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bad-input tests start from inputs each command accepts, so each fails for one reason."""
    rc, out, err = _run(["inspect", str(good["ckpt"])], capsys)
    assert rc == 0 and "layer.u" in out, err
    rc, out, err = _run(["compare", str(good["ckpt"]), str(good["ckpt"])], capsys)
    assert rc == 0, err
    if "localize" in subcommands():
        rc, out, err = _run(["localize", str(good_capture), str(good_capture)], capsys)
        assert rc == 0, err


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_help_documents_exit_codes(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "exit status:" in out
    # exit 1 means "a difference" for comparisons; report, study and notebooks have their
    # own (or none)
    one = {"report": "1  a notebook failed", "study": None, "notebooks": None}.get(
        command, "1  a comparison found a difference"
    )
    for line in ("0  success", one, "2  bad input"):
        assert line is None or line in out, f"{command} --help lacks {line!r}"


def test_usage_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["inspect"], ["no-such-command"], ["inspect", "--no-such-option", "x"]):
        rc, _, err = _run(argv, capsys)
        assert rc == 2 and "Traceback" not in err
        assert len([ln for ln in err.splitlines() if "error" in ln]) == 1, err
