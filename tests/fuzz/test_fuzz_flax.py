"""flax msgpack checkpoints (a real ``flax.serialization.to_bytes`` file) mutated: bytes
flipped, cut, maps reordered, a value swapped for another msgpack value.

The property: dmlib reads the file, every tensor loads (and a reordered file reads exactly
as msgpack itself decodes the original), or refuses it with a ``DmlibError`` naming the
file; never another exception, never a hang (fuzzlib.read_or_refuse).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _support import fuzzlib
from _support.fuzzlib import read_or_refuse
from hypothesis import given
from hypothesis import strategies as st

msgpack = pytest.importorskip("msgpack")

FIXTURE = Path("/work/shared/fixtures/jax/msgpack/A_step_10.msgpack")


def _oracle(raw: bytes) -> dict[str, bytes]:
    """name -> array bytes, decoded by msgpack and numpy here (ext 1: shape, dtype, bytes)."""
    out: dict[str, bytes] = {}

    def walk(node: Any, name: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(node, msgpack.ExtType) and node.code == 1:
            shape, dtype, data = msgpack.unpackb(node.data)
            out[name] = np.frombuffer(data, np.dtype(dtype)).reshape(shape).tobytes()

    walk(msgpack.unpackb(raw, strict_map_key=False), "")
    return out


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, dict[str, bytes], Path]:
    if not FIXTURE.exists():
        pytest.skip(f"{FIXTURE} is not here")
    work = tmp_path_factory.mktemp("fuzz_flax")
    shutil.copy(FIXTURE, work / "orig.msgpack")
    raw = FIXTURE.read_bytes()
    return raw, _oracle(raw), work


def _arrays(got: dict[str, tuple[bytes, int | None]]) -> dict[str, bytes]:
    return {k: b for k, (b, _) in got.items()}


def test_the_real_file_reads_as_msgpack_decodes_it(original) -> None:
    raw, expected, work = original
    got = read_or_refuse(work / "orig.msgpack", "flax-real")
    assert got is not None and _arrays(got) == expected and len(expected) >= 10


@fuzzlib.fuzz()
@given(data=st.data())
def test_flax_flipped_or_cut(original, data: st.DataObject) -> None:
    raw, expected, work = original
    path = work / "m.msgpack"
    mutated = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4), label="flips")):
        mutated[data.draw(st.integers(0, len(raw) - 1), label="pos")] ^= data.draw(
            st.integers(1, 255), label="mask"
        )
    if data.draw(st.booleans(), label="cut"):
        mutated = mutated[: data.draw(st.integers(1, len(raw) - 1), label="at")]
    path.write_bytes(bytes(mutated))
    read_or_refuse(path, "flax-flip")


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=8)
    | st.builds(msgpack.ExtType, st.integers(0, 5), st.binary(max_size=24)),
    lambda kids: st.lists(kids, max_size=3)
    | st.dictionaries(st.text(max_size=4) | st.integers(0, 9), kids, max_size=3),
    max_leaves=8,
)  # fmt: skip

# flax's own encodings, built from parts that may be wrong
_ARRAYS = st.builds(
    lambda code, shape, dtype, data: msgpack.ExtType(code, msgpack.packb([shape, dtype, data])),
    st.sampled_from([1, 2, 3]),
    st.lists(st.integers(-1, 2**40), max_size=3) | st.integers(0, 3),
    st.sampled_from(["float32", "int8", "bfloat16", "object", "U4", "complex64", ""]),
    st.binary(max_size=32),
)
_CHUNKED = st.builds(
    lambda shape, chunks: {"__msgpack_chunked_array__": True, "shape": shape, "chunks": chunks},
    st.dictionaries(st.sampled_from(["0", "1"]), st.integers(0, 8)),
    st.dictionaries(st.sampled_from(["0", "1", "2"]), _ARRAYS | _VALUES),
)


def _paths(node: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [at]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, (*at, k))
    return out


@fuzzlib.fuzz()
@given(data=st.data())
def test_flax_value_swapped_or_maps_reordered(original, data: st.DataObject) -> None:
    raw, expected, work = original
    path = work / "s.msgpack"
    tree = msgpack.unpackb(raw, strict_map_key=False)
    where = data.draw(st.sampled_from(_paths(tree)[1:]), label="where")
    parent = tree
    for k in where[:-1]:
        parent = parent[k]
    action = data.draw(st.sampled_from(["swap", "array", "chunked", "reorder"]), label="action")
    if action == "reorder":
        keys = data.draw(st.permutations(list(parent)), label="order")
        parent_items = {k: parent[k] for k in keys}
        parent.clear()
        parent.update(parent_items)
    else:
        strategy = {"swap": _VALUES, "array": _ARRAYS, "chunked": _CHUNKED}[action]
        parent[where[-1]] = data.draw(strategy, label="value")
    path.write_bytes(msgpack.packb(tree))
    got = read_or_refuse(path, f"flax-{action}")
    if action == "reorder":
        assert got is not None and _arrays(got) == expected
