"""PyTorch checkpoints (zip archives of pickles) with bytes flipped or cut: read or refused."""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
from _support import fuzzlib
from _support.fuzzlib import read_or_refuse
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, bytes], Path]:
    state = {
        "enc.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "enc.bias": torch.tensor([1.0, -1.0, 0.5], dtype=torch.bfloat16),
        "steps": torch.tensor([7], dtype=torch.int64),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    expected = {}
    for k, v in state.items():
        v = v.view(torch.int16) if v.dtype == torch.bfloat16 else v
        expected[k] = np.ascontiguousarray(v.numpy()).tobytes()
    return buf.getvalue(), expected, tmp_path_factory.mktemp("fuzz_torch")


def _in_pickle(raw: bytes, pos: int) -> bool:
    """Is byte ``pos`` inside the data of the archive's pickle member (names, shapes, offsets)?"""
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        for info in z.infolist():
            if info.filename.endswith(".pkl"):
                head = info.header_offset
                name_len, extra_len = struct.unpack("<HH", raw[head + 26 : head + 30])
                start = head + 30 + name_len + extra_len
                return start <= pos < start + info.compress_size
    return False


@fuzzlib.fuzz()
@given(data=st.data())
def test_torch_flip_and_truncate(
    original: tuple[bytes, dict[str, bytes], Path], data: st.DataObject
) -> None:
    raw, expected, workdir = original
    path = workdir / "m.pt"
    path.write_bytes(raw)
    got = read_or_refuse(path, "torch-gen")
    assert got is not None and {k: b for k, (b, _) in got.items()} == expected
    pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
    mutated = bytearray(raw)
    mutated[pos] ^= data.draw(st.integers(1, 255), label="mask")
    path.write_bytes(bytes(mutated))
    flipped = read_or_refuse(path, "torch-flip")
    if flipped is not None and not _in_pickle(raw, pos):
        # the pickle declares names, shapes and storage offsets; outside it a flip can
        # only change the bytes of the tensor whose storage holds it
        for k, (b, _) in flipped.items():
            start = raw.find(expected[k])
            if not start <= pos < start + len(expected[k]):
                assert b == expected[k], f"{k} changed by a flip at {pos}, outside its storage"
    cut = data.draw(st.integers(1, len(raw) - 1), label="cut")
    path.write_bytes(raw[:cut])
    assert read_or_refuse(path, "torch-truncate") is None
