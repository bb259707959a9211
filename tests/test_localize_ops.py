"""Op-level capture and comparison, checked against the plants of tests/_support/opsmodel.py."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from _support import opsmodel  # noqa: E402
from _support.opsmodel import LENGTHS, F, Net, S, layout  # noqa: E402
from _support.tree import leaf, tree_request  # noqa: E402
from torch import nn  # noqa: E402

import dmlib  # noqa: E402
from dmlib.localize.boundaries import capture_verdict as verdict  # noqa: E402
from dmlib.localize.ops import align, op_table  # noqa: E402

QUIRK_OP = "model.quirk/dmtest.batch_round#0"


def cap(model, path, kind, **kw):
    x, rows = layout(kind)
    kw.setdefault("modules", "*")
    kw.setdefault("block_rows", 4)
    with torch.no_grad(), dmlib.capture(model, path, row_map=rows, ops=True, **kw):
        out = model(x)
    return out


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    root = tmp_path_factory.mktemp("opcaps")
    model = Net()
    for name in ("alone", "packed"):
        cap(model, root / name, name, dump="*", dump_requests=["q"])
    cap(model, root / "alone_whole", "alone", dump="*")
    cap(model, root / "packed_whole", "packed", dump="*")
    return root


def planted_rows(x_rows: torch.Tensor) -> list[int]:
    """Positions where float16 rounding moves x * 3 (the plant, computed by hand)."""
    a = (x_rows * 3.0).numpy()
    b = (x_rows.to(torch.float16).to(torch.float32) * 3.0).numpy()
    return np.flatnonzero((a != b).any(axis=1)).tolist()


def test_op_names_hashes_and_rows(tmp_path):
    model = Net()
    seen = {}

    def grab(m, i, o):
        seen["in"], seen["out"] = i[0].detach().clone(), o.detach().clone()

    h = model.model.quirk.register_forward_hook(grab)
    try:
        cap(model, tmp_path / "c", "packed")
    finally:
        h.remove()
    c = dmlib.open_capture(tmp_path / "c")
    ops = op_table(c)
    quirk_ops = [o for o in ops if o.owner == "model.quirk"]
    # the custom op under its own name; the aten ops of its implementation are not seen
    assert [o.op for o in quirk_ops] == ["dmtest.batch_round.default"]
    assert quirk_ops[0].id == QUIRK_OP
    assert quirk_ops[0].inputs == [QUIRK_OP + ":input0"] and quirk_ops[0].outputs == [QUIRK_OP]
    b = c.boundary(QUIRK_OP)
    out = seen["out"].numpy()
    assert b.digest == leaf(out.tobytes())
    assert b.row_dims == 2 and b.shape == (3, S, F)
    q_rows = out[1, :S]  # request q is batch row 1
    assert b.requests["q"].digest == tree_request(q_rows, 4)[0]
    assert b.requests["q"].blocks == [leaf(q_rows[i : i + 4].tobytes()) for i in range(0, S, 4)]
    assert c.boundary(QUIRK_OP + ":input0").digest == leaf(seen["in"].numpy().tobytes())
    # stage1 is x * weight + bias: aten.mul then aten.add, inputs by slot
    s1 = [o for o in ops if o.owner == "model.stage1"]
    assert [o.id for o in s1] == ["model.stage1/aten.mul#0", "model.stage1/aten.add#0"]
    mul_w = c.boundary("model.stage1/aten.mul#0:input1")
    entry = c.manifest["boundaries"][mul_w.index]
    assert entry["param"] == "model.stage1.weight" and mul_w.row_dims is None
    # the op's arguments are kept for replay: tensors by boundary name
    assert s1[0].args == [{"tensor": "model.stage1/aten.mul#0:input0"},
                          {"tensor": "model.stage1/aten.mul#0:input1"}]  # fmt: skip


def test_parameters_hashed_whole_even_when_they_fit_the_row_map(tmp_path):
    model = Net()
    cap(model, tmp_path / "c", "alone")  # alone: 12 rows; pos_bias is (12, F)
    c = dmlib.open_capture(tmp_path / "c")
    slices = [o for o in op_table(c) if o.owner == "model" and o.op.startswith("aten.slice")]
    assert slices, [o.id for o in op_table(c) if o.owner == "model"]
    pb = c.boundary(slices[0].inputs[0])
    assert c.manifest["boundaries"][pb.index]["param"] == "model.pos_bias"
    assert pb.shape == (S, F) and pb.row_dims is None and pb.requests == {}


class Pool(nn.Module):
    def forward(self, x):
        return x.sum(dim=1) * 0.5  # (batch, F): no batch x sequence rows


def test_ops_without_row_layout_are_hashed_whole_and_listed(tmp_path):
    m = Pool()
    x, rows = layout("packed")
    with dmlib.capture(m, tmp_path / "c", modules="", row_map=rows, ops=True):
        out = m(x)
    c = dmlib.open_capture(tmp_path / "c")
    assert [o.id for o in op_table(c)] == ["(model)/aten.sum#0", "(model)/aten.mul#0"]
    s = c.boundary("(model)/aten.sum#0")
    assert s.row_dims is None and s.shape == (3, F) and s.requests == {}
    assert "(model)/aten.sum#0" in c.manifest["whole_only"]
    assert c.boundary("(model)/aten.sum#0:input0").row_dims == 2  # its input keeps the rows
    assert c.boundary("(model)/aten.mul#0").digest == leaf(out.numpy().tobytes())


def test_capture_with_ops_leaves_outputs_byte_identical(tmp_path):
    model = Net()
    x, _ = layout("packed")
    with torch.no_grad():
        plain = [t.numpy().tobytes() for t in model(x)]
    got = cap(model, tmp_path / "c", "packed", dump="*")
    assert [t.numpy().tobytes() for t in got] == plain


def test_first_divergent_op_is_the_plant(caps):
    df = dmlib.compare_captures(caps / "alone", caps / "packed", request="q")
    at = df.attrs
    assert at["culprit_op"] == QUIRK_OP and at["first_divergent_op"] == QUIRK_OP
    assert at["first_divergent_boundary"] == QUIRK_OP and at["culprit"] == QUIRK_OP
    t = df.set_index("boundary")
    assert t.loc[QUIRK_OP + ":input0", "identical"]
    assert t.loc["model.quirk", "role"] == "encloses-culprit"
    # every boundary before the plant is identical, ops included
    first = df.index[df["boundary"] == QUIRK_OP][0]
    assert df.loc[: first - 1, "identical"].all()
    # the differing rows are where float16 rounding changes the value, found by hand
    x_in = torch.from_numpy(np.array(dmlib.open_capture(caps / "alone").tensor(
        QUIRK_OP + ":input0", "q")))  # fmt: skip
    expect = planted_rows(x_in)
    assert expect  # the plant fires on these random inputs
    assert t.loc[QUIRK_OP, "n_diff_rows"] == len(expect)
    assert t.loc[QUIRK_OP, "diff_blocks"] == sorted({p // 4 for p in expect})
    assert at["op_alignment"]["n_partings"] == 0
    text = verdict(df)
    assert f"culprit op (inputs identical, output differs): {QUIRK_OP}" in text


def test_same_ops_without_the_plant_are_identical(caps, tmp_path):
    model = Net()
    model.model.quirk.active = False
    cap(model, tmp_path / "p", "packed")
    cap(model, tmp_path / "a", "alone")
    df = dmlib.compare_captures(tmp_path / "a", tmp_path / "p", request="q")
    assert df.attrs["first_divergent_boundary"] is None and df.attrs["culprit_op"] is None
    assert df["identical"].dropna().all()
    # ops whose tensors have no rows of q and a layout-dependent shape are not "identical"
    assert (df["identical"].isna() == (df["role"] == "incomparable")).all()


class Branchy(nn.Module):
    """Runs an extra aten.add before its mul when packed: op names no longer line up."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Identity()

    def forward(self, x):
        x = self.inner(x)
        if x.shape[0] > 1:
            x = x + 0.0  # an extra op, same values
        y = x * 2.0
        return y + 1.0


def test_alignment_pairs_by_sequence_not_by_name(tmp_path):
    m = Branchy()
    for kind in ("alone", "packed"):
        x, rows = layout(kind)
        with torch.no_grad(), dmlib.capture(m, tmp_path / kind, modules="", row_map=rows, ops=True):
            m(x)
    a, b = dmlib.open_capture(tmp_path / "alone"), dmlib.open_capture(tmp_path / "packed")
    assert [o.id for o in op_table(a)] == ["(model)/aten.mul#0", "(model)/aten.add#0"]
    assert [o.id for o in op_table(b)] == [
        "(model)/aten.add#0",
        "(model)/aten.mul#0",
        "(model)/aten.add#1",
    ]
    al = align(a, b)
    # by name, a's add#0 would meet b's extra add#0; by sequence it meets add#1
    assert al.partner["(model)/aten.add#0"] == "(model)/aten.add#1"
    assert al.partner["(model)/aten.mul#0"] == "(model)/aten.mul#0"
    assert al.partings == [
        {
            "owner": "(model)",
            "at": "(model)/aten.mul#0",
            "a_ops": [],
            "b_ops": ["(model)/aten.add#0"],
        }
    ]
    df = dmlib.compare_captures(a, b, request="q")
    assert df.attrs["first_divergent_boundary"] is None
    assert df.set_index("boundary").loc["(model)/aten.add#0", "identical"]
    assert "first parting at (model)/aten.mul#0" in verdict(df)


class Swap(nn.Module):
    def forward(self, x):
        return x / 4.0 if x.shape[0] > 1 else x * 0.25


def test_unrelated_ops_are_never_paired(tmp_path):
    m = Swap()
    for kind in ("alone", "packed"):
        x, rows = layout(kind)
        with torch.no_grad(), dmlib.capture(m, tmp_path / kind, modules="", row_map=rows, ops=True):
            m(x)
    df = dmlib.compare_captures(tmp_path / "alone", tmp_path / "packed", request="q")
    t = df.set_index("boundary")
    # x * 0.25 and x / 4 give the same bits, but they are different ops: not compared
    assert t.loc["(model)/aten.mul#0", "identical"] is pd_na()
    assert "part here" in t.loc["(model)/aten.mul#0", "note"]
    assert t.loc["(model)", "identical"]  # the module output itself is compared by name
    assert df.attrs["op_alignment"]["n_paired"] == 0


def pd_na():
    import pandas as pd

    return pd.NA


def test_ops_restricted_by_pattern_and_empty_ops_are_skipped(tmp_path):
    model = Net()
    cap(model, tmp_path / "c", "packed", op_modules="model.quirk")
    c = dmlib.open_capture(tmp_path / "c")
    assert {o.owner for o in op_table(c)} == {"model.quirk"}
    assert all(not b.name.startswith("model.stage1/") for b in c.boundaries)

    class Empties(nn.Module):
        def forward(self, x):
            out = torch.empty_like(x)
            return out.copy_(x)

    m = Empties()
    x, rows = layout("alone")
    with dmlib.capture(m, tmp_path / "e", modules="", row_map=rows, ops=True):
        m(x)
    e = op_table(dmlib.open_capture(tmp_path / "e"))
    assert e[0].op == "aten.empty_like.default" and e[0].outputs == []
    assert "uninitialised" in e[0].skipped[0]


def test_lengths_fixture_is_what_the_layout_says():
    x, rows = layout("packed")
    assert x.shape == (len(LENGTHS), S, F) and len(rows) == len(LENGTHS) * S
    assert opsmodel.batch_round(torch.ones(1, 2)).tolist() == [[3.0, 3.0]]


class Total(nn.Module):
    def forward(self, x):
        return x.sum() * 2.0  # 0-d tensors


def test_zero_dim_op_tensors_dump_and_read_back(tmp_path):
    import json
    import struct

    m = Total()
    x, rows = layout("alone")
    with torch.no_grad(), dmlib.capture(m, tmp_path / "c", modules="", row_map=rows, ops=True,
                                        dump="*"):  # fmt: skip
        out = m(x)
    c = dmlib.open_capture(tmp_path / "c")
    b = c.boundary("(model)/aten.sum#0")
    assert b.shape == ()
    got = c.tensor(b)
    assert got.shape == () and got.tobytes() == x.sum().numpy().tobytes()
    assert c.tensor("(model)/aten.mul#0").tobytes() == out.numpy().tobytes()
    raw = (tmp_path / "c" / b.dump["file"]).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert json.loads(raw[8 : 8 + n])["tensor"]["shape"] == []  # safetensors' 0-d: shape []


class Heads(nn.Module):
    """Attention-shaped tensors: (batch, heads, positions, head_dim) and scores."""

    def forward(self, x):
        b, s, f = x.shape
        h = x.view(b, s, 2, f // 2).transpose(1, 2)  # rows on axes 0 and 2
        y = torch.ops.dmtest.batch_round(h)  # the plant, on head-major rows
        scores = y @ y.transpose(-1, -2)  # (b, 2, s, s): two position axes, hashed whole
        return y.transpose(1, 2).reshape(b, s, f) + 0.0 * scores.sum()


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    m = Heads()
    for kind in ("alone", "packed"):
        x, rows = layout(kind)
        with torch.no_grad(), dmlib.capture(m, root / kind, modules="", row_map=rows, ops=True,
                                            dump="*"):  # fmt: skip
            m(x)
    return root


def test_head_major_rows_are_attributed(heads):
    c = dmlib.open_capture(heads / "packed")
    t = c.boundary("(model)/aten.transpose#0")
    assert t.shape == (3, 2, S, F // 2) and t.row_axes == (0, 2) and t.row_dims is None
    assert t.row_shape == (2, F // 2)
    x, _ = layout("packed")
    # oracle: request q is batch row 1, positions 0..S-1, taken by hand from the input
    by_hand = x.view(3, S, 2, F // 2)[1].numpy()  # (positions, heads, head_dim)
    assert t.requests["q"].digest == leaf(by_hand.tobytes())
    np.testing.assert_array_equal(c.tensor(t, "q"), by_hand)
    entry = c.manifest["boundaries"][t.index]
    assert entry["row_axes"] == [0, 2] and entry["row_dims"] is None
    # scores (batch, heads, positions, positions): two position axes, so hashed whole
    scores = [b for b in c.boundaries if len(b.shape) == 4 and b.shape[0] == 3
              and b.shape[2:] == (S, S)]  # fmt: skip
    assert scores and all(b.row_axes is None and not b.row_mapped for b in scores)
    assert all(b.name in c.manifest["whole_only"] for b in scores)
    # K^T (batch, heads, head_dim, positions): positions on axis 3 are rows too
    kt = [b for b in c.boundaries if b.shape == (3, 2, F // 2, S)]
    assert kt and all(b.row_axes == (0, 3) for b in kt)


def test_head_major_plant_found_and_patched(heads):
    from dmlib.localize.patch import patch_test

    df = dmlib.compare_captures(heads / "alone", heads / "packed", request="q")
    assert df.attrs["culprit_op"] == "(model)/dmtest.batch_round#0"
    t = df.set_index("boundary")
    assert t.loc["(model)/dmtest.batch_round#0:input0", "identical"]
    # sum over the whole batch: same shape in both layouts, other requests' data inside
    assert t.loc["(model)/aten.sum#0", "identical"] is pd_na()
    assert "not comparable across layouts" in t.loc["(model)/aten.sum#0", "note"]
    same = dmlib.compare_captures(heads / "packed", heads / "packed").set_index("boundary")
    assert same.loc["(model)/aten.sum#0", "identical"]  # one layout: the whole hash counts
    m = Heads()
    x, rows = layout("packed")

    def run():
        with torch.no_grad():
            return m(x)

    res = patch_test(m, source=heads / "alone", boundary="(model)/dmtest.batch_round#0",
                     request="q", row_map=rows, run=run)  # fmt: skip
    assert res.confirmed, str(res)


def test_interrupted_op_capture_leaves_no_mode_or_hook_behind(tmp_path):
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    model = Net()
    x, rows = layout("alone")
    n_hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    with pytest.raises(RuntimeError, match="killed"):
        with dmlib.capture(model, tmp_path / "c", modules="*", row_map=rows, ops=True):
            model(x)
            raise RuntimeError("killed mid-run")
    assert _get_current_dispatch_mode_stack() == []
    assert (
        sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == n_hooks
    )
    with pytest.raises(dmlib.CaptureError, match="incomplete"):
        dmlib.open_capture(tmp_path / "c")
