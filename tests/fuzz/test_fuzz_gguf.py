"""GGUF files (written by llama.cpp's gguf package) with a byte flipped or cut: read or refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _support import fuzzlib
from _support.fuzzlib import read_or_refuse
from hypothesis import given
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def original(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[bytes, dict[str, tuple[int, bytes]], Path]:
    from gguf import quants
    from gguf.constants import GGMLQuantizationType as Q

    root = tmp_path_factory.mktemp("fuzz_gguf")
    path = root / "orig.gguf"
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "fuzz")
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"])
    w.add_tensor("emb", rng.standard_normal((3, 32)).astype(np.float32))
    w.add_tensor("norm", rng.standard_normal(32).astype(np.float16))
    w.add_tensor(
        "q",
        quants.quantize(rng.standard_normal((2, 32)).astype(np.float32), Q.Q8_0),
        raw_dtype=Q.Q8_0,
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    raw = path.read_bytes()
    expected = {
        t.name: (int(t.data_offset), np.asarray(t.data).tobytes())
        for t in gguf.GGUFReader(str(path)).tensors
    }
    return raw, expected, root


@fuzzlib.fuzz()
@given(data=st.data())
def test_gguf_flip_and_truncate(original, data: st.DataObject) -> None:
    raw, expected, root = original
    path = root / "m.gguf"
    path.write_bytes(raw)
    got = read_or_refuse(path, "gguf-gen")
    assert got is not None and {k: (o, b) for k, (b, o) in got.items()} == expected
    header_end = min(o for o, _ in expected.values())
    pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
    mutated = bytearray(raw)
    mutated[pos] ^= data.draw(st.integers(1, 255), label="mask")
    path.write_bytes(bytes(mutated))
    flipped = read_or_refuse(path, "gguf-flip")
    if flipped is not None and pos >= header_end:
        # past the header a flip can only change the bytes of the tensor that holds it
        for k, (b, off) in flipped.items():
            o, want = expected[k]
            if not o <= pos < o + len(want):
                assert (b, off) == (want, o), f"{k} changed by a flip at {pos}"
    cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    path.write_bytes(raw[:cut])
    got = read_or_refuse(path, "gguf-truncate")
    # only the alignment padding after the last tensor may go without loss
    assert got is None or {k: (o, b) for k, (b, o) in got.items()} == expected
