"""Burn .mpk / .mpk.gz records with a byte flipped or cut: read or refused, never a crash."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
from _support import fuzzlib
from _support.fuzzlib import read_or_refuse
from hypothesis import given
from hypothesis import strategies as st

msgpack = pytest.importorskip("msgpack")


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, bytes], Path]:
    w = np.arange(12, dtype="<f4").reshape(3, 4) / 3
    b = np.array([1, -2, 3], dtype="<i8")
    record = {
        "metadata": {
            "float": "f32",
            "int": "i64",
            "format": "mpk",
            "version": "0.16.0",
            "settings": "s",
        },
        "item": {
            "lin": {
                "weight": {
                    "id": "a",
                    "param": {"bytes": w.tobytes(), "shape": [3, 4], "dtype": "F32"},
                }
            },
            "steps": {"id": "b", "param": {"bytes": b.tobytes(), "shape": [3], "dtype": "I64"}},
            "dropout": {"prob": 0.5},
        },
    }
    return (
        msgpack.packb(record, use_bin_type=True),
        {"lin.weight": w.tobytes(), "steps": b.tobytes()},
        tmp_path_factory.mktemp("fuzz_mpk"),
    )


@fuzzlib.fuzz()
@given(data=st.data())
def test_mpk_flip_and_truncate(original, data: st.DataObject) -> None:
    raw, expected, root = original
    gz = data.draw(st.booleans(), label="gz")
    blob = gzip.compress(raw, mtime=0) if gz else raw
    path = root / ("m.mpk.gz" if gz else "m.mpk")
    path.write_bytes(blob)
    got = read_or_refuse(path, "mpk-gen")
    assert got is not None and {k: b for k, (b, _) in got.items()} == expected
    pos = data.draw(st.integers(0, len(blob) - 1), label="pos")
    mutated = bytearray(blob)
    mutated[pos] ^= data.draw(st.integers(1, 255), label="mask")
    path.write_bytes(bytes(mutated))
    read_or_refuse(
        path, "mpk-flip.gz" if gz else "mpk-flip"
    )  # MessagePack has no checksum: read or refused
    cut = data.draw(st.integers(0, len(blob) - 1), label="cut")
    path.write_bytes(blob[:cut])
    assert read_or_refuse(path, "mpk-truncate") is None
