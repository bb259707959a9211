"""CaptureOptions: every capture setting once, checked once; the old keywords build it.

Oracles: the defaults as the capture documented them before the options existed (written
out by hand here), the normal forms worked out by hand, and a capture made through the
options against one made through the keywords (the same model and input: the same file).
"""

from __future__ import annotations

import dataclasses

import pytest

import dmlib
from dmlib.errors import CaptureError
from dmlib.localize.capture.options import UNSET, CaptureOptions


def test_the_defaults_are_the_documented_ones():
    o = CaptureOptions()
    assert (o.modules, o.row_map, o.block_rows, o.dump, o.dump_requests, o.metadata) == (
        None, None, 64, (), None, {},
    )  # fmt: skip
    assert (o.overwrite, o.hash_threads, o.device_hash, o.ops, o.op_modules) == (
        False, 2, True, False, None,
    )  # fmt: skip
    assert (o.layout_inputs, o.hash, o.scheme) == ((), "xxh3", "xxh3-128-tree-v1")
    assert dmlib.CaptureOptions is CaptureOptions


def test_settings_are_kept_in_one_normal_form():
    o = CaptureOptions(modules=["a", "b.*"], dump="a", dump_requests=[3, "x"],
                       layout_inputs="my_mask", op_modules="a", metadata={"k": 1})  # fmt: skip
    assert o.modules == ("a", "b.*") and o.op_modules == "a" and o.dump == ("a",)
    assert o.dump_requests == frozenset({"3", "x"})
    assert o.layout_inputs == ("my_mask",)
    assert o.layout_patterns[-1] == "my_mask" and "attention_mask" in o.layout_patterns
    assert CaptureOptions(hash="BLAKE3").scheme == "blake3-tree-v1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.block_rows = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("block_rows", 0, "block_rows=0; expected a positive integer"),
        ("block_rows", True, "block_rows=True"),
        ("hash", "md5", "hash='md5'; expected 'xxh3' or 'blake3'"),
        ("hash_threads", -1, "hash_threads=-1"),
    ],
)
def test_a_setting_that_cannot_be_honoured_is_refused_once(field, value, match):
    with pytest.raises(CaptureError, match=match):
        CaptureOptions(**{field: value})
    with pytest.raises(CaptureError, match=match):  # with_ checks again
        CaptureOptions().with_(**{field: value})


def test_of_applies_the_keywords_given_over_the_options():
    base = CaptureOptions(block_rows=8, ops=True)
    assert CaptureOptions.of(base) is base
    assert CaptureOptions.of(base, block_rows=UNSET, ops=False) == CaptureOptions(block_rows=8)
    assert CaptureOptions.of(None, dump="x").dump == ("x",)
    with pytest.raises(TypeError, match="unknown capture setting"):
        CaptureOptions.of(base, blocks=3)
    with pytest.raises(TypeError, match="must be a CaptureOptions"):
        CaptureOptions.of({"block_rows": 3})  # type: ignore[arg-type]


torch = pytest.importorskip("torch")


def _capture(path, *args, **kwargs):
    from _support.twolinear import Tiny

    model = Tiny().eval()
    x = torch.arange(2 * 3 * 6, dtype=torch.float32).reshape(2, 3, 6) / 7
    rows = [[("p", i) for i in range(3)], [("q", i) for i in range(3)]]
    with torch.no_grad(), dmlib.capture(model, path, *args, row_map=rows, **kwargs) as rec:
        model(x)
    return rec, (path / "manifest.json").read_bytes()


def test_a_capture_through_options_writes_what_the_keywords_write(tmp_path):
    opts = CaptureOptions(block_rows=2, metadata={"run": "a"}, layout_inputs="x_mask")
    rec, by_options = _capture(tmp_path / "o", opts)
    _, by_keywords = _capture(tmp_path / "k", block_rows=2, metadata={"run": "a"},
                              layout_inputs="x_mask")  # fmt: skip
    assert by_options == by_keywords
    assert dataclasses.replace(rec.options, row_map=None) == opts and rec.block_rows == 2
    rec.metadata["added"] = 1  # the recorder's metadata is its own: the options keep theirs
    assert opts.metadata == {"run": "a"}
    # a keyword replaces the options' field
    _, other = _capture(tmp_path / "b", opts, block_rows=3)
    assert b'"block_rows":3' in other and b'"block_rows":2' in by_options


def test_a_bad_setting_names_the_capture_folder(tmp_path):
    with pytest.raises(CaptureError, match="block_rows=0") as err:
        _capture(tmp_path / "c", block_rows=0)
    assert str(tmp_path / "c") in str(err.value)
    assert not (tmp_path / "c").exists()  # refused before the folder is made
