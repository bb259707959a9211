"""torch.save zips read without torch, mutated: bytes flipped, cut, members reordered or
repeated, the pickle itself damaged with its CRC made right again.

The property: dmlib reads the file (every tensor loads, and what it reads is exactly what
torch wrote, as torch itself reads it back) or refuses it with a ``DmlibError`` naming the
file; never another exception, never a hang (fuzzlib.read_or_refuse).
"""

from __future__ import annotations

import io
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from _support import fuzzlib
from _support.fuzzlib import read_or_refuse
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")


def _bits(t: object) -> bytes:
    v = t.detach().contiguous()  # type: ignore[attr-defined]
    if v.dtype == torch.bfloat16:
        v = v.view(torch.int16)
    return np.ascontiguousarray(v.numpy()).tobytes()


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, bytes], Path]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {
        "model": {"w": base, "w_t": base.t(), "row": base[1], "b": torch.ones(3, dtype=torch.bfloat16)},
        "opt": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": base * 0.5}},
                "param_groups": [{"lr": 0.1, "params": [0]}]},
        "steps": torch.tensor([7, 8], dtype=torch.int64),
        "scale": torch.tensor([2.0]).expand(3),
    }  # fmt: skip
    buf = io.BytesIO()
    torch.save(state, buf)
    raw = buf.getvalue()
    back = torch.load(io.BytesIO(raw), weights_only=True)  # the oracle: torch's own reading
    expected = {
        "model.w": _bits(back["model"]["w"]),
        "model.w_t": _bits(back["model"]["w_t"]),
        "model.row": _bits(back["model"]["row"]),
        "model.b": _bits(back["model"]["b"]),
        "opt.state.0.step": _bits(back["opt"]["state"][0]["step"]),
        "opt.state.0.exp_avg": _bits(back["opt"]["state"][0]["exp_avg"]),
        "steps": _bits(back["steps"]),
        "scale": _bits(back["scale"]),
    }
    return raw, expected, tmp_path_factory.mktemp("fuzz_torch_zip")


def _members(raw: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


def _zip(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a repeated name, written on purpose
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
            for name, data in members:
                z.writestr(name, data)
    return buf.getvalue()


def _tensors(got: dict[str, tuple[bytes, int | None]]) -> dict[str, bytes]:
    return {k: b for k, (b, _) in got.items() if not k.startswith("opt.param_groups")}


@fuzzlib.fuzz()
@given(data=st.data())
def test_torch_zip_flipped_or_cut(original, data: st.DataObject) -> None:
    raw, expected, workdir = original
    path = workdir / "m.pt"
    mutated = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        mutated[data.draw(st.integers(0, len(raw) - 1), label="pos")] ^= data.draw(
            st.integers(1, 255), label="mask"
        )
    if data.draw(st.booleans(), label="cut"):
        mutated = mutated[: data.draw(st.integers(0, len(raw) - 1), label="at")]
    path.write_bytes(bytes(mutated))
    read_or_refuse(path, "torch-zip-flip")


@fuzzlib.fuzz()
@given(data=st.data())
def test_torch_zip_members_reordered_repeated_or_dropped(original, data: st.DataObject) -> None:
    raw, expected, workdir = original
    path = workdir / "r.pt"
    members = _members(raw)
    order = data.draw(st.permutations(members), label="order")
    action = data.draw(st.sampled_from(["reorder", "repeat", "drop"]), label="action")
    if action == "repeat":
        i = data.draw(st.integers(0, len(order) - 1), label="which")
        order = [*order, (order[i][0], order[i][1][::-1])]
    elif action == "drop":
        order.pop(data.draw(st.integers(0, len(order) - 1), label="which"))
    path.write_bytes(_zip(list(order)))
    got = read_or_refuse(path, f"torch-zip-{action}")
    if action == "repeat":
        assert got is None, "a member named twice was read"
    elif got is not None:  # what reads is what torch wrote
        assert _tensors(got) == expected


@fuzzlib.fuzz()
@given(data=st.data())
def test_torch_zip_pickle_damaged_with_a_right_crc(original, data: st.DataObject) -> None:
    raw, expected, workdir = original
    path = workdir / "p.pt"
    members = _members(raw)
    (i,) = [k for k, (n, _) in enumerate(members) if n.endswith("/data.pkl")]
    pkl = bytearray(members[i][1])
    for _ in range(data.draw(st.integers(1, 3), label="flips")):
        pkl[data.draw(st.integers(0, len(pkl) - 1), label="pos")] ^= data.draw(
            st.integers(1, 255), label="mask"
        )
    if data.draw(st.booleans(), label="cut"):
        pkl = pkl[: data.draw(st.integers(0, len(pkl) - 1), label="at")]
    members[i] = (members[i][0], bytes(pkl))
    path.write_bytes(_zip(members))  # zipfile writes the damaged pickle's own CRC
    read_or_refuse(path, "torch-zip-pickle")


def test_the_generated_file_reads_as_torch_reads_it(original) -> None:
    raw, expected, workdir = original
    path = workdir / "g.pt"
    path.write_bytes(raw)
    got = read_or_refuse(path, "torch-zip-gen")
    assert got is not None and _tensors(got) == expected
