"""Roles on hand-written manifests: secondary op outputs, declared layout inputs, the root."""

from __future__ import annotations

import json

import dmlib

H = "blake3-64MiB"


def entry(name, module, kind, slot, digest, **extra):
    return {"name": name, "module": module, "call": 0, "kind": kind, "slot": slot,
            "dtype": "float32", "shape": [2, 3], "hash": H, "digest": digest, "row_dims": None,
            "requests": {}, "dump": None, "leading": None, **extra}  # fmt: skip


def write(path, boundaries, ops=None, root=None):
    path.mkdir()
    m = {"format": "dmlib-capture", "version": 2, "complete": True, "hash": H,
         "block_rows": 64, "row_map": None, "batch": None, "whole_only": [], "metadata": {},
         "boundaries": boundaries}  # fmt: skip
    if ops is not None:
        m["ops"] = ops
    if root is not None:
        m["root"] = root
    (path / "manifest.json").write_text(json.dumps(m))
    return path


def op_capture(path, lse):
    op = "m/aten._sdpa#0"
    bs = [
        entry(f"{op}:input0", op, "input", "input0", "aa", op=op),
        entry(op, op, "output", "output0", "bb", op=op),
        entry(f"{op}:output1", op, "output", "output1", lse, op=op),
    ]
    ops = [{"id": op, "op": "aten._sdpa.default", "owner": "m", "inputs": [f"{op}:input0"],
            "outputs": [op, f"{op}:output1"]}]  # fmt: skip
    return write(path, bs, ops)


def test_a_secondary_op_output_is_never_the_culprit(tmp_path):
    a = op_capture(tmp_path / "a", "c1")
    b = op_capture(tmp_path / "b", "c2")  # only the second output (logsumexp) differs
    df = dmlib.compare_captures(a, b)
    roles = df.set_index("boundary")["role"]
    assert roles["m/aten._sdpa#0:output1"] == "secondary"
    assert df.attrs["culprit"] is None and df.attrs["culprit_op"] is None
    assert df.attrs["status"] == "different"  # bytes differ: never called identical
    assert df.attrs["secondary"] == ["m/aten._sdpa#0:output1"]


def test_declared_layout_input_is_not_judged(tmp_path):
    mods = [
        entry("f:input0", "f", "input", "input0", "x"),
        entry("f", "f", "output", "output0", "y"),
    ]
    a = write(
        tmp_path / "a", [*mods, entry("f:input.my_mask", "f", "input", "input.my_mask", "m1")]
    )
    b = write(
        tmp_path / "b", [*mods, entry("f:input.my_mask", "f", "input", "input.my_mask", "m2")]
    )
    assert dmlib.compare_captures(a, b).attrs["status"] == "different"
    df = dmlib.compare_captures(a, b, layout_inputs=["my_mask"])
    assert df.attrs["status"] == "identical"
    assert df.attrs["layout_inputs"] == ["f:input.my_mask"]
    assert df.set_index("boundary").loc["f:input.my_mask", "role"] == "layout"


def test_an_input_that_differs_first_is_the_entry_not_the_culprit(tmp_path):
    a = write(tmp_path / "a", [entry("f:input0", "f", "input", "input0", "x1"),
                               entry("f", "f", "output", "output0", "y1")])  # fmt: skip
    b = write(tmp_path / "b", [entry("f:input0", "f", "input", "input0", "x2"),
                               entry("f", "f", "output", "output0", "y2")])  # fmt: skip
    df = dmlib.compare_captures(a, b)
    assert df.attrs["culprit"] is None and df.attrs["entry"] == "f:input0"
    text = dmlib.localize.boundaries.capture_verdict(df)
    assert "culprit (inputs identical, output differs)" not in text
    assert "enters at an input: f:input0" in text


def test_root_outputs_use_the_stored_root_label(tmp_path):
    # a submodule named "model" is not the root: its matching output proves nothing
    bs = [entry("model", "model", "output", "output0", "z"),
          entry("inner:input0", "inner", "input", "input0", "q", )]  # fmt: skip
    bs_b = [entry("model", "model", "output", "output0", "z")]
    a = write(tmp_path / "a", bs, root="(model)")
    b = write(tmp_path / "b", bs_b, root="(model)")
    df = dmlib.compare_captures(a, b)
    assert df.attrs["outputs_match"] is False and df.attrs["status"] == "inconclusive"
