"""The compiled JSON writer (dmlib.localize.capture.jsonenc.compact) against json.dumps itself.

Hypothesis draws nested plain data (dicts with str keys, lists, tuples, str with any code
point, ints of any size, floats including NaN, infinities and -0.0, bools, None); the
oracle is ``json.dumps(obj, separators=(",", ":"))``. Anything else (subclasses, other key
types, other objects, nesting past 64) must come back as None, never as other text.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmlib.localize.capture import jsonenc, treehash

compiled = pytest.mark.skipif(
    jsonenc._ENCODE is None or not treehash.USE_COMPILED,
    reason="dmlib.localize.capture._capture not built (or built before encode_json)",
)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.text(alphabet=st.characters(codec=None, exclude_categories=())),
)  # fmt: skip
plain = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.lists(inner, max_size=5).map(tuple),
        st.dictionaries(st.text(), inner, max_size=5),
    ),
    max_leaves=40,
)


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


@compiled
@settings(max_examples=400, deadline=None)
@given(plain)
def test_compact_writes_what_json_dumps_writes(obj):
    assert jsonenc.compact(obj) == _dumps(obj)


@compiled
@pytest.mark.parametrize(
    "obj",
    [
        "\u2028\ud800\udfff\x00\x1f\x7f\"\\/</script>", "\U0001f600", 2**200, -(2**70),
        float("nan"), -float("inf"), -0.0, 5e-324, 1e16, [[], {}, ()], {"": None},
        [0, -1, 9, 10, -10, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64],
    ],
)  # fmt: skip
def test_hand_picked_edges(obj):
    assert jsonenc.compact(obj) == _dumps(obj)


class Str(str):
    pass


class Int(int):
    pass


def _deep(n: int) -> list:
    out: list = []
    x = out
    for _ in range(n):
        x.append([])
        x = x[0]
    return out


@compiled
@pytest.mark.parametrize(
    "obj",
    [Str("x"), Int(3), {1: 2}, {None: 1}, {"a": object()}, {1, 2}, b"x", [Str("x")],
     {"a": {"b": Int(1)}}, _deep(100), bytearray(b"x")],
)  # fmt: skip
def test_anything_else_is_left_to_the_json_module(obj):
    assert jsonenc.compact(obj) is None


@compiled
def test_sixty_four_levels_are_written():
    assert jsonenc.compact(_deep(63)) == _dumps(_deep(63))


def test_off_with_the_numpy_kernels(monkeypatch):
    monkeypatch.setattr(treehash, "USE_COMPILED", False)
    assert jsonenc.compact({"a": 1}) is None
    assert jsonenc.compact_lines([{"a": 1}]) is None


def _lines(items: list) -> str:
    return ",\n".join(_dumps(x) for x in items)


lines_compiled = pytest.mark.skipif(
    jsonenc._LINES is None or not treehash.USE_COMPILED,
    reason="dmlib.localize.capture._capture not built (or built before encode_json_lines)",
)


@lines_compiled
@settings(max_examples=300, deadline=None)
@given(st.lists(plain, max_size=6), st.lists(st.integers(0, 30), max_size=12))
def test_compact_lines_writes_the_joined_dumps_with_shared_dicts(items, picks):
    """Items that hold the same dict objects several times, at several depths (a capture's
    boundaries share one tensor's digests): the copied text is what writing them gives."""
    dicts = [d for d in _walk(items) if type(d) is dict]
    shared = [dicts[i % len(dicts)] for i in picks] if dicts else []
    built = items + [{"again": d, "nested": [d, {"x": d}]} for d in shared] + shared
    assert jsonenc.compact_lines(built) == _lines(built)


def _walk(obj):
    yield obj
    if isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _walk(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _walk(x)


@lines_compiled
def test_compact_lines_edges():
    d = {"digest": "ab", "blocks": ["ab", "cd"], "n_rows": 2}
    req = {"r0": d, "r1": d}
    items = [{"requests": req}, {"requests": req, "leading": [d, d]}, req, d, [], {}]
    assert jsonenc.compact_lines(items) == _lines(items)
    assert jsonenc.compact_lines([]) == ""
    assert jsonenc.compact_lines([{"a": Str("x")}, {"b": 1}]) is None  # one item not plain
    assert jsonenc.compact_lines([req, {"k": {1: 2}}]) is None
    assert jsonenc.compact_lines(({"a": 1},)) is None  # a list only
