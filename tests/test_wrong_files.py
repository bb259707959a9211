"""Valid-looking but wrong files: dmlib reads them correctly or refuses them, and never
returns a shifted window of plausible bytes.

Expected values are the arrays the files were written from; layouts are computed here
from the format's rules, not read back from dmlib.
"""

from __future__ import annotations

import struct
from pathlib import Path

import cbor2
import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import dmlib
from dmlib.errors import DmlibError, LayoutError
from dmlib.io import cbor
from dmlib.io.burnpack import encode_burnpack, write_records

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
def test_offsets_shifted_by_one_alignment_unit_are_refused(tmp_path: Path, victims: list[str]) -> None:
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
    meta["tensors"]["b"]["data_offsets"] = list(meta["tensors"]["a"]["data_offsets"])  # b := a's bytes
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


@settings(max_examples=40, derandomize=True, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    shift=st.sampled_from(SHIFTS),
    which=st.sampled_from(["all", "first", "last"]),
    layout=st.sampled_from(["aligned", "legacy-unaligned"]),
)
def test_shifted_offsets_are_never_read_as_data(tmp_path: Path, sizes: list[int], shift: int, which: str, layout: str) -> None:
    """Shift some offsets, give the file whatever length makes them fit: correct or refused."""
    rng = np.random.default_rng(len(sizes) * 1000 + sum(sizes))
    tensors = {f"t{i}": rng.integers(1, 255, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    raw = encode_burnpack(tensors, layout=layout)
    msize, meta = _split(raw)
    legacy = layout != "aligned"
    base = 10 + msize if legacy else _align(10 + msize)
    section = raw[base:]
    names = list(tensors) if which == "all" else [next(iter(tensors))] if which == "first" else [list(tensors)[-1]]
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
