"""Burnpack files, real and generated, broken every way we could think of.

Each case must read correctly or be refused with a ``DmlibError`` naming the file
(``fuzzlib.read_or_refuse``); where the mutation left a tensor alone, it must read back
as its original bytes at its original offset.
"""

from __future__ import annotations

import struct
from pathlib import Path

import cbor2
import numpy as np
import pytest
from _support import fuzzlib
from _support.fuzzlib import (
    align,
    bpk_build,
    bpk_split,
    bpk_tensor_bytes,
    cbor_head,
    check_untouched,
    read_or_refuse,
)
from hypothesis import assume, given
from hypothesis import strategies as st

from dmlib.io import cbor
from dmlib.io.burnpack import encode_burnpack, write_records

REAL = ["case_a.bpk", "case_b_empty.bpk", "case_c_zero_last.bpk", "mnist-model.bpk"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_bpk")


def _write(workdir: Path, data: bytes, name: str = "case.bpk") -> Path:
    p = workdir / name
    p.write_bytes(data)
    return p


def interesting_points(data: bytes, layout: str = "aligned") -> list[int]:
    """Byte positions where the structure changes: header fields, metadata, D, each tensor's ends."""
    msize, _, base = bpk_split(data, layout)
    pts = {
        *range(0, 11),
        BPK_META_END(msize) - 1,
        BPK_META_END(msize),
        BPK_META_END(msize) + 1,
        base - 1,
        base,
        len(data) - 1,
    }
    for s, e in bpk_tensor_bytes(data, layout).values():
        pts |= {s - 1, s, s + 1, e - 1, e}
    return sorted(p for p in pts if 0 <= p < len(data))


def BPK_META_END(msize: int) -> int:  # noqa: N802
    return fuzzlib.BPK_HEADER + msize


# ----------------------------------------------------------------------------- real files


@pytest.mark.parametrize("name", REAL)
def test_real_file_truncated_at_every_interesting_point(
    burnpack_fixtures: Path, workdir: Path, name: str
) -> None:
    data = (burnpack_fixtures / name).read_bytes()
    original = read_or_refuse(burnpack_fixtures / name, "bpk-real-unmodified")
    assert original is not None
    for cut in interesting_points(data):
        got = read_or_refuse(_write(workdir, data[:cut]), "bpk-real-truncate")
        # the only valid file a cut can leave is an empty pack read in the legacy layout
        assert got is None or (got == {} and original == {}), f"cut at {cut} read as {sorted(got)}"


@pytest.mark.parametrize("name", REAL)
@fuzzlib.fuzz()
@given(data=st.data())
def test_real_file_one_byte_flipped(
    burnpack_fixtures: Path, workdir: Path, name: str, data: st.DataObject
) -> None:
    raw = (burnpack_fixtures / name).read_bytes()
    msize, _, base = bpk_split(raw)
    spans = bpk_tensor_bytes(raw)
    pos = data.draw(
        st.one_of(
            st.integers(0, min(len(raw), base + 16) - 1),
            st.integers(0, len(raw) - 1),
            st.sampled_from(interesting_points(raw)),
        ),
        label="pos",
    )
    mask = data.draw(st.integers(1, 255), label="mask")
    mutated = bytearray(raw)
    mutated[pos] ^= mask
    got = read_or_refuse(_write(workdir, bytes(mutated)), "bpk-real-flip")
    if fuzzlib.BPK_HEADER + msize <= pos < base and got is None:
        # dirty header padding in front of tensors that also pack back to back from the
        # legacy base is indistinguishable from a legacy file with trailing bytes
        assert "ambiguous data base" in str(fuzzlib.LAST_ERROR[0])
        return
    if pos >= fuzzlib.BPK_HEADER + msize:
        # padding or tensor data: the file is still valid and must be read
        assert got is not None, (
            f"flip at {pos} (past the metadata) refused: {fuzzlib.LAST_ERROR[0]}"
        )
        inside = [n for n, (s, e) in spans.items() if s <= pos < e]
        for n in inside:
            s, _ = spans[n]
            assert got[n][0][pos - s] == mutated[pos]
    if got is not None:
        check_untouched(got, raw, spans, {pos})


# ----------------------------------------------------------------------------- generated files


@fuzzlib.fuzz()
@given(
    tensors=fuzzlib.tensor_dicts(),
    layout=st.sampled_from(["aligned", "legacy-unaligned"]),
    data=st.data(),
)
def test_generated_round_trip_then_flip_and_truncate(
    workdir: Path, tensors: dict, layout: str, data: st.DataObject
) -> None:
    raw = encode_burnpack(tensors, layout=layout)
    got = read_or_refuse(_write(workdir, raw), f"bpk-gen-{layout}")
    if got is None:
        # only a legacy file that an aligned file cut short would also explain may be refused
        assert layout == "legacy-unaligned"
        return
    for name, arr in tensors.items():  # oracle: the arrays we wrote
        assert got[name][0] == np.ascontiguousarray(arr).tobytes()
    spans = bpk_tensor_bytes(raw, layout)
    pos = data.draw(
        st.sampled_from(interesting_points(raw, layout)) | st.integers(0, len(raw) - 1), label="pos"
    )
    mutated = bytearray(raw)
    mutated[pos] ^= data.draw(st.integers(1, 255), label="mask")
    flipped = read_or_refuse(_write(workdir, bytes(mutated)), "bpk-gen-flip")
    if flipped is not None:
        check_untouched(flipped, raw, spans, {pos})
    cut = data.draw(st.sampled_from(interesting_points(raw, layout)), label="cut")
    truncated = read_or_refuse(_write(workdir, raw[:cut]), "bpk-gen-truncate")
    assert truncated is None or truncated == {}, (
        f"cut at {cut} of {len(raw)} read as {sorted(truncated)}"
    )


def _meta_blob(meta: dict) -> bytes:
    return cbor.encode(meta)


MUTATIONS = [
    "end+256",
    "start+256",
    "both+256",
    "end-huge",
    "shape-huge",
    "shape-zero-huge",
    "shape-many-dims",
    "dtype-other",
    "dtype-unknown",
    "swap-offsets",
    "duplicate-name",
    "msize-huge",
    "msize-plus-one",
    "version",
    "cbor-insert-byte",
    "cbor-delete-byte",
    "cbor-trailing",
    "cbor-array-claims-2**60",
    "drop-tensor",
]


@pytest.mark.parametrize("mutation", MUTATIONS)
@fuzzlib.fuzz()
@given(tensors=fuzzlib.tensor_dicts(min_size=2), data=st.data())
def test_generated_structural_mutation(
    workdir: Path, tensors: dict, mutation: str, data: st.DataObject
) -> None:
    raw = encode_burnpack(tensors, scalars={"step": 7})
    msize, meta, base = bpk_split(raw)
    section = raw[base:]
    names = list(meta["tensors"])
    victim = data.draw(st.sampled_from(names), label="victim")
    d = meta["tensors"][victim]
    blob: bytes | None = None
    version = 1
    expect_refusal = True
    if mutation == "end+256":
        d["data_offsets"][1] += 256
    elif mutation == "start+256":
        d["data_offsets"][0] += 256
    elif mutation == "both+256":
        d["data_offsets"] = [d["data_offsets"][0] + 256, d["data_offsets"][1] + 256]
        if d["data_offsets"][0] == d["data_offsets"][1]:
            expect_refusal = None  # moving a zero-length tensor shifts no data
    elif mutation == "end-huge":
        d["data_offsets"][1] = 2**62
    elif mutation == "shape-huge":
        d["shape"] = [2**40, 2**40]
    elif mutation == "shape-zero-huge":
        d["shape"] = [0, 2**63, 2**63]
        d["data_offsets"][1] = d["data_offsets"][0]
    elif mutation == "shape-many-dims":
        d["shape"] = [1] * 70
        d["data_offsets"][1] = d["data_offsets"][0] + 1
        d["dtype"] = "U8"
    elif mutation == "dtype-other":
        # a dtype of the same width is a valid reinterpretation: read, same bytes
        width = {
            "F64": 8,
            "I64": 8,
            "F32": 4,
            "I32": 4,
            "U32": 4,
            "F16": 2,
            "BF16": 2,
            "I16": 2,
            "I8": 1,
            "U8": 1,
        }
        same = [k for k, w in width.items() if w == width.get(d["dtype"]) and k != d["dtype"]]
        assume(same)
        d["dtype"] = data.draw(st.sampled_from(same), label="dtype")
        expect_refusal = False
    elif mutation == "dtype-unknown":
        d["dtype"] = data.draw(
            st.sampled_from(["F128", "f32", 7, {"Bool": "Bits"}, {"A": 1, "B": 2}, ["F32"], None]),
            label="dtype",
        )
    elif mutation == "swap-offsets":
        other = data.draw(st.sampled_from([n for n in names if n != victim]), label="other")
        o = meta["tensors"][other]
        d["data_offsets"], o["data_offsets"] = o["data_offsets"], d["data_offsets"]
        expect_refusal = None  # valid when both have the same byte length
    elif mutation == "duplicate-name":
        items = list(meta["tensors"].items())
        fake = dict(d, data_offsets=list(d["data_offsets"]))
        pairs = [*items, (victim, fake)]
        body = b"".join(cbor.encode(k) + cbor.encode(v) for k, v in pairs)
        tensors_blob = cbor_head(5, len(pairs)) + body
        rest = {k: v for k, v in meta.items() if k != "tensors"}
        blob = cbor_head(5, 1 + len(rest)) + cbor.encode("tensors") + tensors_blob
        blob += b"".join(cbor.encode(k) + cbor.encode(v) for k, v in rest.items())
    elif mutation == "drop-tensor":
        # a name removed from the map leaves its bytes orphaned between the others
        del meta["tensors"][victim]
        expect_refusal = None  # valid when the dropped one was last in disk order
    if blob is None:
        blob = _meta_blob(meta)
    if mutation == "cbor-insert-byte":
        at = data.draw(st.integers(0, len(blob)), label="at")
        blob = blob[:at] + bytes([data.draw(st.integers(0, 255), label="b")]) + blob[at:]
        expect_refusal = None
    elif mutation == "cbor-delete-byte":
        at = data.draw(st.integers(0, len(blob) - 1), label="at")
        blob = blob[:at] + blob[at + 1 :]
        expect_refusal = None
    elif mutation == "cbor-trailing":
        blob = blob + b"\x00"
    elif mutation == "cbor-array-claims-2**60":
        blob = blob[:-1] + b"\x9b" + (2**60).to_bytes(8, "big")
    elif mutation == "version":
        version = data.draw(st.sampled_from([0, 2, 255, 65535]), label="version")
    out = bpk_build(blob, section, version=version)
    if mutation == "msize-huge":
        out = out[:6] + struct.pack("<I", 2**32 - 1) + out[10:]
    elif mutation == "msize-plus-one":
        out = out[:6] + struct.pack("<I", len(blob) + 1) + out[10:]
    with fuzzlib.small_memory():
        got = read_or_refuse(_write(workdir, out), f"bpk-struct-{mutation}")
    if expect_refusal:
        assert got is None, f"{mutation} of {victim!r} was read"
        return
    if got is None:
        assert expect_refusal is None, f"{mutation}: a valid file was refused"
        return
    # read: every tensor must be exactly the bytes the (mutated) header declares
    new_meta = cbor2.loads(blob)
    new_base = align(fuzzlib.BPK_HEADER + len(blob))
    for n, nd in new_meta["tensors"].items():
        s, e = nd["data_offsets"]
        assert got[n] == (out[new_base + s : new_base + e], new_base + s)


@fuzzlib.fuzz()
@given(
    recs=st.lists(fuzzlib.tensor_dicts(max_size=3), min_size=2, max_size=3),
    dirty=st.booleans(),
    data=st.data(),
)
def test_multi_record_file(
    workdir: Path, recs: list[dict], dirty: bool, data: st.DataObject
) -> None:
    """Records back to back: each read at its own base; a flip or a cut never shifts another record."""
    images = [encode_burnpack(t, scalars={"step": i}) for i, t in enumerate(recs)]
    out, starts = bytearray(), []
    for img in images:  # the layout, computed here independently of write_records
        if out:
            gap = align(len(out)) - len(out)
            out += b"\xff" * gap if dirty else bytes(gap)
        starts.append(len(out))
        out += img
    path = workdir / "multi.bpk"
    write_records(path, images, pad_fill=(lambda off, n: b"\xff" * n) if dirty else None)
    assert path.read_bytes() == bytes(out)
    spans = {}
    for i, (start, img) in enumerate(zip(starts, images, strict=True)):
        for n, (s, e) in bpk_tensor_bytes(img).items():
            spans[n if i == 0 else f"record{i}/{n}"] = (start + s, start + e)
    got = read_or_refuse(path, "bpk-multi")
    assert got is not None and set(got) == set(spans)
    for n, (s, e) in spans.items():
        assert got[n] == (bytes(out[s:e]), s)
    points = sorted(
        {p for s in starts for p in range(s, s + 11)}
        | {p for se in spans.values() for p in se}
        | {len(out) - 1}
    )
    pos = data.draw(
        st.sampled_from([p for p in points if p < len(out)]) | st.integers(0, len(out) - 1),
        label="pos",
    )
    mutated = bytearray(out)
    mutated[pos] ^= data.draw(st.integers(1, 255), label="mask")
    flipped = read_or_refuse(_write(workdir, bytes(mutated)), "bpk-multi-flip")
    if flipped is not None:
        check_untouched(flipped, bytes(out), spans, {pos})
    cut = data.draw(
        st.sampled_from([p for p in points if 0 < p < len(out)] + [len(out) - 1]), label="cut"
    )
    truncated = read_or_refuse(_write(workdir, bytes(out[:cut])), "bpk-multi-truncate")
    if truncated is not None:
        # only whole leading records may survive a cut, each exactly as written
        assert set(truncated) <= set(spans)
        check_untouched(truncated, bytes(out), spans, set())
