"""The manifest's JSON through orjson (dmlib.localize.capture.jsonenc) against json.dumps.

Hypothesis draws nested float-free data (what a capture's boundaries and row maps hold:
dicts with str keys, lists, tuples, ASCII str with every control character, ints within
64 bits, bools, None), with the same dict objects met several times (a capture's
boundaries share one tensor's digests); the oracle is ``json.dumps(obj, separators=(",",
":"))``. Whatever orjson would write otherwise (a character past ASCII, an int past 64
bits, another key type, DEL) must come back as None, never as other text; and a capture's
manifest holds the json module's text wherever orjson declines.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dmlib.localize.capture import jsonenc, treehash

pytestmark = pytest.mark.skipif(
    jsonenc._DUMPS is None or not treehash.USE_COMPILED, reason="orjson not installed (or off)"
)

# ASCII but DEL (0x7f), which the json module escapes (left to it: tested below)
ascii_text = st.text(alphabet=st.characters(max_codepoint=126, exclude_categories=()))
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), ascii_text,
)  # fmt: skip
plain = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5),
        st.lists(inner, max_size=5).map(tuple),
        st.dictionaries(ascii_text, inner, max_size=5),
    ),
    max_leaves=40,
)


def _dumps(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _lines(items: list) -> str:
    return ",\n".join(_dumps(x) for x in items)


@settings(max_examples=400, deadline=None)
@given(plain)
def test_compact_writes_what_json_dumps_writes(obj):
    assert jsonenc.compact(obj) == _dumps(obj)


@pytest.mark.parametrize(
    "obj",
    [
        "\x00\x1f\x08\x0c\n\r\t\"\\/</script>", [[], {}, ()], {"": None},
        [0, -1, 9, 10, -10, 2**63 - 1, -(2**63), True, False],
        {"digest": "ab" * 16, "n_rows": 3, "blocks": ["cd" * 16]},
    ],
)  # fmt: skip
def test_hand_picked_edges(obj):
    assert jsonenc.compact(obj) == _dumps(obj)


class Str(str):
    pass


@pytest.mark.parametrize(
    "obj",
    ["é", "\x7f", {"k": "\U0001f600"}, {"\u2028": 1}, 2**64, -(2**63) - 1, {1: 2}, {None: 1},
     {"a": object()}, {1, 2}, b"x"],
)  # fmt: skip
def test_what_orjson_would_write_otherwise_is_left_to_the_json_module(obj):
    assert jsonenc.compact(obj) is None
    assert jsonenc.compact_lines([{"ok": 1}, obj]) is None


def test_a_str_subclass_is_written_as_its_text():
    assert jsonenc.compact({"a": Str("x")}) == _dumps({"a": Str("x")})


@settings(max_examples=300, deadline=None)
@given(st.lists(plain, max_size=6), st.lists(st.integers(0, 30), max_size=12))
def test_compact_lines_writes_the_joined_dumps_with_shared_dicts(items, picks):
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


def test_compact_lines_edges():
    assert jsonenc.compact_lines([]) == ""
    assert jsonenc.compact_lines(({"a": 1},)) is None  # a list only


def test_off_with_the_numpy_kernels(monkeypatch):
    monkeypatch.setattr(treehash, "USE_COMPILED", False)
    assert jsonenc.compact({"a": 1}) is None
    assert jsonenc.compact_lines([{"a": 1}]) is None


def test_the_manifest_head_keeps_the_json_module_floats(tmp_path):
    """Metadata with floats orjson writes otherwise (1e-05, NaN, -inf) and a request id past
    ASCII: the manifest holds json.dumps' text for them."""
    torch = pytest.importorskip("torch")
    from _support.twolinear import Tiny

    import dmlib

    model = Tiny().eval()
    meta = {"eps": 1e-05, "big": 1e16, "nan": float("nan"), "low": -float("inf")}
    rows = [("é", 0), ("é", 1)]
    with torch.no_grad(), dmlib.capture(model, tmp_path / "c", row_map=rows, metadata=meta):
        model(torch.ones(2, 6))
    text = (tmp_path / "c" / "manifest.json").read_text()
    assert _dumps(meta) in text
    assert '"\\u00e9"' in text and "é" not in text  # escaped as json.dumps escapes it
