"""A toy torch model with a planted, layout-dependent divergence, and the capture tests.

``Toy`` is elementwise per row (no matrix products whose rounding could depend on the
batch shape), except ``Quirk`` in ``blocks.1``, which nudges positions ``QUIRK_POSITIONS``
by ``NUDGE`` only when it sees more than one batch row (the "packed" layout), and
``CumMix`` in ``blocks.2``, which mixes along the sequence (position j sees 0..j). So the
ground truth is known: the divergence enters at ``blocks.1.quirk``, in the blocks holding
positions 5 and 20, and ``blocks.2.mix`` spreads it to every later position.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from _support.toymodel import (  # noqa: E402
    BLOCK_ROWS,
    N_REQ,
    QUIRK_POSITIONS,
    Affine,
    F,
    Toy,
    layout,
    run_capture,
)
from _support.tree import leaf, tree_request  # noqa: E402
from torch import nn  # noqa: E402

import dmlib  # noqa: E402
from dmlib.errors import CaptureError  # noqa: E402

# ---------------------------------------------------------------- tests of the toy itself


def test_toy_quirk_fires_only_when_packed():
    model = Toy()
    with torch.no_grad():
        a = model(*layout("alone")[:2])[0]
        p = model(*layout("packed")[:2])[1, :N_REQ]
        model.blocks[1].quirk.active = False
        q = model(*layout("packed")[:2])[1, :N_REQ]
    assert torch.equal(a, q)  # elementwise model: layout alone changes nothing
    differ = (a != p).any(dim=1).nonzero().flatten().tolist()
    assert differ == list(range(QUIRK_POSITIONS[0], N_REQ))  # cumsum spreads from position 5 on


# ---------------------------------------------------------------- capture


def test_capture_leaves_outputs_byte_identical(tmp_path):
    model = Toy()
    x, pos, _ = layout("packed")
    with torch.no_grad():
        plain = model(x, pos).numpy().tobytes()
    captured = run_capture(model, tmp_path / "c", "packed", modules="*", dump="*").numpy().tobytes()
    assert captured == plain


def test_manifest_order_names_and_hashes(tmp_path):
    model = Toy()
    x, pos, rows = layout("packed")
    seen = {}
    hook = model.blocks[1].quirk.register_forward_hook(
        lambda m, i, o: seen.__setitem__("out", o.detach().clone())
    )
    try:
        run_capture(model, tmp_path / "c", "packed", modules="*")
    finally:
        hook.remove()
    cap = dmlib.open_capture(tmp_path / "c")
    names = [b.name for b in cap.boundaries]
    # pre-hooks record inputs at entry, outputs at exit: children finish before parents
    order = [
        "blocks.1:input0",
        "blocks.1.quirk:input0",
        "blocks.1.quirk:input1",
        "blocks.1.quirk",
        "blocks.1.act",
        "blocks.1",
    ]
    idx = [names.index(n) for n in order]
    assert idx == sorted(idx)
    b = cap.boundary("blocks.1.quirk")
    out = seen["out"].numpy()
    assert (b.dtype, b.shape, b.kind, b.row_dims) == ("float32", (3, 30, F), "output", 2)
    # version-4 captures name their scheme: XXH3-128 of the bytes (oracle: the xxhash package)
    assert b.hash == "xxh3-128-tree-v1" and cap.manifest["hash"] == "xxh3-128-tree-v1"
    assert b.digest == leaf(out.tobytes())
    # oracle for the per-request rule: r sits in batch row 1, positions 0..23
    r_rows = out[1, :N_REQ]
    assert b.requests["r"].digest == tree_request(r_rows, BLOCK_ROWS)[0]
    expect_blocks = [leaf(r_rows[i : i + BLOCK_ROWS].tobytes()) for i in (0, 8, 16)]
    assert b.requests["r"].blocks == expect_blocks
    assert b.requests["b"].n_rows == 11 and len(b.requests["b"].blocks) == 2
    assert cap.requests == {"a": 30, "r": 24, "b": 11}


def test_default_modules_are_leaves_and_blocks(tmp_path):
    from dmlib.localize.capture import default_modules

    got = set(default_modules(Toy()))
    leaves = {f"blocks.{i}.{m}" for i in range(3) for m in ("fc", "quirk", "act", "mix")}
    assert got == {"inp", "blocks.0", "blocks.1", "blocks.2"} | leaves


def test_whole_only_when_leading_dims_do_not_match(tmp_path):
    class Summary(nn.Module):
        def forward(self, x):
            return x.sum(dim=(0, 1))  # shape (F,): no row structure

    class WithSummary(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = Affine(1)
            self.summary = Summary()

        def forward(self, x):
            return self.summary(self.body(x))

    x, _, rows = layout("packed")
    with pytest.raises(CaptureError, match="no hooked module ran"):
        with (
            torch.no_grad(),
            dmlib.capture(WithSummary(), tmp_path / "c", row_map=rows, modules="*"),
        ):
            WithSummary()(x)  # a different instance: no hooks, nothing recorded
    with pytest.raises(CaptureError, match="incomplete"):
        dmlib.open_capture(tmp_path / "c")
    model = WithSummary()
    with torch.no_grad(), dmlib.capture(model, tmp_path / "d", row_map=rows, modules="*"):
        model(x)
    cap = dmlib.open_capture(tmp_path / "d")
    s = cap.boundary("summary")
    assert s.row_dims is None and s.requests == {} and s.shape == (F,)
    assert "summary" in cap.manifest["whole_only"]
    assert cap.boundary("body").row_dims == 2


def test_dump_request_rows_and_whole(tmp_path):
    model = Toy()
    x, pos, _ = layout("packed")
    run_capture(
        model,
        tmp_path / "rows",
        "packed",
        modules="*",
        dump=["inp", "blocks.1.quirk:input1"],
        dump_requests=["r"],
    )
    run_capture(model, tmp_path / "whole", "packed", modules="*", dump=["inp"])
    expected_inp = (x * model.inp.weight + model.inp.bias).detach().numpy()
    rows = dmlib.open_capture(tmp_path / "rows")
    got = rows.tensor("inp", "r")
    assert got.shape == (N_REQ, F) and not got.flags.writeable
    np.testing.assert_array_equal(got, expected_inp[1, :N_REQ])
    np.testing.assert_array_equal(rows.tensor("blocks.1.quirk:input1", "r"), np.arange(N_REQ))
    with pytest.raises(CaptureError, match="not dumped"):
        rows.tensor("inp", "a")  # only r's rows were written
    with pytest.raises(CaptureError, match="not dumped"):
        rows.tensor("blocks.1.act", "r")
    whole = dmlib.open_capture(tmp_path / "whole")
    np.testing.assert_array_equal(whole.tensor("inp"), expected_inp)
    np.testing.assert_array_equal(whole.tensor("inp", "b"), expected_inp[2, :11])


def test_bfloat16_bits_are_kept(tmp_path):
    import ml_dtypes

    lin = nn.Identity()
    x = torch.randn(2, 3, 5).to(torch.bfloat16)
    with dmlib.capture(
        lin, tmp_path / "c", modules="", row_map=[("q", i) for i in range(6)], dump="*"
    ):
        lin(x)
    cap = dmlib.open_capture(tmp_path / "c")
    got = cap.tensor("(model)")
    assert got.dtype == np.dtype(ml_dtypes.bfloat16)
    assert got.view(np.uint16).tolist() == x.view(torch.int16).numpy().view(np.uint16).tolist()


def test_interrupted_and_bad_captures(tmp_path):
    model = Toy()
    x, pos, rows = layout("alone")
    with pytest.raises(RuntimeError):
        with dmlib.capture(model, tmp_path / "c", row_map=rows):
            model(x, pos)
            raise RuntimeError("killed mid-run")
    with pytest.raises(CaptureError, match="incomplete") as err:
        dmlib.open_capture(tmp_path / "c")
    assert str(tmp_path / "c") in str(err.value)
    with pytest.raises(CaptureError, match="no manifest.json"):
        dmlib.open_capture(tmp_path)
    with pytest.raises(CaptureError, match="not a directory"):
        dmlib.open_capture(tmp_path / "missing")
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "manifest.json").write_text("{not json")
    with pytest.raises(CaptureError, match="not valid JSON"):
        dmlib.open_capture(tmp_path / "j")
    run_capture(model, tmp_path / "ok", "alone")
    with pytest.raises(CaptureError, match="already exists"):
        run_capture(model, tmp_path / "ok", "alone")
    run_capture(model, tmp_path / "ok", "alone", overwrite=True)
    with pytest.raises(CaptureError, match="expected \\(request_id, position\\)"):
        with dmlib.capture(model, tmp_path / "rm", row_map=[("r", 0), 5]):
            pass
    with pytest.raises(CaptureError, match="positions"):
        with dmlib.capture(model, tmp_path / "rm2", row_map=[("r", 0), ("r", 2)]):
            pass
    with pytest.raises(CaptureError, match="no boundary"):
        dmlib.open_capture(tmp_path / "ok").boundary("nope")


def test_capture_readable_without_torch(tmp_path):
    model = Toy()
    run_capture(model, tmp_path / "c", "packed", modules="*", dump="inp", dump_requests=["r"])
    expected = dmlib.open_capture(tmp_path / "c").tensor("inp", "r")
    np.save(tmp_path / "expected.npy", expected)
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import numpy as np, dmlib\n"
        f"c = dmlib.open_capture({str(tmp_path / 'c')!r})\n"
        f"assert np.array_equal(c.tensor('inp', 'r'), np.load({str(tmp_path / 'expected.npy')!r}))\n"
        "print(len(c.boundaries), 'torch' in sys.modules and sys.modules['torch'] is None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    n, blocked = out.stdout.split()
    assert int(n) == len(dmlib.open_capture(tmp_path / "c").boundaries) and blocked == "True"


def test_manifest_is_json_with_complete_flag(tmp_path):
    run_capture(Toy(), tmp_path / "c", "alone")
    doc = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert (
        doc["complete"] is True
        and doc["format"] == "dmlib-capture"
        and doc["block_rows"] == BLOCK_ROWS
    )
    assert not list(tmp_path.glob("c/.*part"))  # no temporary files left behind
