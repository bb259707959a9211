""".npy and .npz files, generated with numpy itself, broken every way we could think of."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import numpy as np
import pytest
from _support import fuzzlib
from _support.fuzzlib import read_or_refuse
from hypothesis import given
from hypothesis import strategies as st

# numpy's own writer handles these; bfloat16 has no .npy descr numpy can read back
NPY_DTYPES = {k: v for k, v in fuzzlib.DTYPES.items() if k != "BF16"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_np")


def _npy_bytes(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def _header_end(raw: bytes) -> int:
    major = raw[6]
    n = int.from_bytes(raw[8:10], "little") if major == 1 else int.from_bytes(raw[8:12], "little")
    return (10 if major == 1 else 12) + n


def _with_header(raw: bytes, header: str) -> bytes:
    """``raw`` with its header dict replaced (v1.0 layout, padded like numpy pads it)."""
    h = header.encode("latin1")
    h += b" " * (-(10 + len(h) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + raw[_header_end(raw) :]


@fuzzlib.fuzz()
@given(
    arrays=fuzzlib.tensor_dicts(max_size=1, dtypes=NPY_DTYPES),
    fortran=st.booleans(),
    data=st.data(),
)
def test_npy_round_trip_then_flip_and_truncate(
    workdir: Path, arrays: dict, fortran: bool, data: st.DataObject
) -> None:
    (arr,) = arrays.values()
    if fortran:
        arr = np.asfortranarray(arr)
    raw = _npy_bytes(arr)
    path = workdir / "a.npy"
    path.write_bytes(raw)
    got = read_or_refuse(path, "npy-gen")
    assert got is not None and got["a"][0] == np.ascontiguousarray(arr).tobytes()
    hend = _header_end(raw)
    in_data = len(raw) > hend and data.draw(st.booleans(), label="in_data")
    pos = data.draw(
        st.integers(hend, len(raw) - 1) if in_data else st.integers(0, hend - 1), label="pos"
    )
    mutated = bytearray(raw)
    mutated[pos] ^= data.draw(st.integers(1, 255), label="mask")
    path.write_bytes(bytes(mutated))
    flipped = read_or_refuse(path, "npy-flip")
    if pos >= hend:
        assert flipped is not None, "a flip in the array data was refused"
    cut = data.draw(
        st.sampled_from(sorted({0, 1, 6, 8, 9, 10, hend - 1, hend, len(raw) - 1})), label="cut"
    )
    if cut < len(raw):
        path.write_bytes(raw[:cut])
        assert read_or_refuse(path, "npy-truncate", format="npy") is None or arr.nbytes == 0


HOSTILE_HEADERS = [
    "{'descr': '<f2', 'fortran_order': False, 'shape': (1,(, }",  # unbalanced: tokenize.TokenError
    "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }",  # 4 TiB claimed
    "{'descr': '<f4', 'fortran_order': False, 'shape': (2147483648, 2147483648), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (0, 9223372036854775807, 9223372036854775807), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }",
    "{'descr': '|O', 'fortran_order': False, 'shape': (1,), }",
    "{'descr': 'not a dtype', 'fortran_order': False, 'shape': (1,), }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': " + "(" * 200 + ")" * 200 + ", }",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (1,)*70, }",
    "{'descr': '<f4', 'fortran_order': False}",
    "__import__('os').getcwd()",
    "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }",  # 4 bytes too many data bytes
    "{'descr': '<f4', 'fortran_order': False, 'shape': (5,), }",  # 4 bytes too few
]


@pytest.mark.parametrize("header", HOSTILE_HEADERS)
def test_npy_hostile_header(workdir: Path, header: str) -> None:
    raw = _with_header(_npy_bytes(np.arange(4, dtype="<f4")), header)
    path = workdir / "h.npy"
    path.write_bytes(raw)
    with fuzzlib.small_memory():
        assert read_or_refuse(path, "npy-hostile-header") is None


def _npz_bytes(members: dict[str, bytes], compress: bool) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        for name, b in members.items():
            z.writestr(name, b)
    return buf.getvalue()


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("header", HOSTILE_HEADERS)
def test_npz_member_with_hostile_header(workdir: Path, header: str, compress: bool) -> None:
    """numpy allocates what an npz member's header claims before reading: dmlib must check first."""
    good = _npy_bytes(np.ones(2, "<f4"))
    bad = _with_header(_npy_bytes(np.arange(4, dtype="<f4")), header)
    path = workdir / "h.npz"
    path.write_bytes(_npz_bytes({"good.npy": good, "bad.npy": bad}, compress))
    with fuzzlib.small_memory():
        assert read_or_refuse(path, "npz-hostile-member") is None


@fuzzlib.fuzz()
@given(
    arrays=fuzzlib.tensor_dicts(max_size=4, dtypes=NPY_DTYPES),
    compress=st.booleans(),
    data=st.data(),
)
def test_npz_round_trip_then_flip_and_truncate(
    workdir: Path, arrays: dict, compress: bool, data: st.DataObject
) -> None:
    path = workdir / "z.npz"
    # names with '/' would be folders inside the archive
    arrays = {k.replace("/", "_"): v for k, v in arrays.items()}
    (np.savez_compressed if compress else np.savez)(path, **arrays)
    raw = path.read_bytes()
    got = read_or_refuse(path, "npz-gen")
    assert got is not None and set(got) == set(arrays)
    for k, v in arrays.items():
        assert got[k][0] == np.ascontiguousarray(v).tobytes()
    pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
    mutated = bytearray(raw)
    mutated[pos] ^= data.draw(st.integers(1, 255), label="mask")
    path.write_bytes(bytes(mutated))
    flipped = read_or_refuse(path, "npz-flip")
    if flipped is not None:
        # zip CRCs guard member data: a flip that is read was outside it (a timestamp,
        # a comment), so what is read under an original name is what was written
        for k, (b, _) in flipped.items():
            if k in arrays:
                assert b == np.ascontiguousarray(arrays[k]).tobytes(), (
                    f"{k}: bytes changed but the read succeeded"
                )
    cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    path.write_bytes(raw[:cut])
    assert read_or_refuse(path, "npz-truncate", format="npz") is None


def test_npz_duplicate_member_names(workdir: Path) -> None:
    path = workdir / "dup.npz"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z, pytest.warns(UserWarning, match="Duplicate name"):
        z.writestr("a.npy", _npy_bytes(np.zeros(2)))
        z.writestr("a.npy", _npy_bytes(np.ones(2)))
    path.write_bytes(buf.getvalue())
    assert read_or_refuse(path, "npz-duplicate") is None
