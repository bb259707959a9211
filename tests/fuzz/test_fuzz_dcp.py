"""DCP checkpoint directories with a byte flipped or a data file cut: read exactly or refused."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from _support import fuzzlib
from _support.fuzzlib import read_or_refuse
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("fuzz_dcp")
    state = {
        "enc.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) / 3,
        "enc.bias": torch.tensor([1.0, -1.0, 0.5], dtype=torch.bfloat16),
        "steps": torch.tensor(7, dtype=torch.int64),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(root / "orig"), no_dist=True)
    expected = {}
    for k, v in state.items():
        v = v.view(torch.int16) if v.dtype == torch.bfloat16 else v
        expected[k] = np.ascontiguousarray(v.numpy()).tobytes()
    return root, expected


def _copy(root: Path, name: str) -> Path:
    dst = root / name
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(root / "orig", dst)
    return dst


@fuzzlib.fuzz()
@given(data=st.data())
def test_dcp_flip_and_truncate(
    original: tuple[Path, dict[str, bytes]], data: st.DataObject
) -> None:
    root, expected = original
    ck = _copy(root, "work")
    got = read_or_refuse(ck, "dcp-gen")
    assert got is not None and {k: b for k, (b, _) in got.items()} == expected
    target = data.draw(st.sampled_from([".metadata", "__0_0.distcp"]), label="file")
    raw = (ck / target).read_bytes()
    pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
    mutated = bytearray(raw)
    mutated[pos] ^= data.draw(st.integers(1, 255), label="mask")
    (ck / target).write_bytes(bytes(mutated))
    flipped = read_or_refuse(ck, f"dcp-flip{target.replace('__0_0', '')}")
    if flipped is not None and target.endswith(".distcp"):
        # the data file holds torch.save images checked by CRC: a flip there is refused,
        # or lands where it changes no tensor byte (an archive's names, padding)
        assert {k: b for k, (b, _) in flipped.items()} == expected
    (ck / target).write_bytes(raw)
    data_file = ck / "__0_0.distcp"
    full = data_file.read_bytes()
    cut = data.draw(st.integers(0, len(full) - 1), label="cut")
    data_file.write_bytes(full[:cut])
    assert read_or_refuse(ck, "dcp-truncate") is None
