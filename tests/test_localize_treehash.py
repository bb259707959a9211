"""The capture's fast paths give the digests the format defines, checked against oracles.

- the compiled per-request block loop (``dmlib.localize.capture.treehash``) against the
  independent ``xxh3-128-tree-v1`` and ``blake3-tree-v1`` oracles of
  tests/_support/tree.py, and a capture made with it against one made with the Python
  loop; ``DMLIB_KERNELS=numpy`` turns it off;
- op outputs that share an input's memory (views) take its digests only where the op
  writes nothing, and an in-place op's output is hashed after its write (it once took
  its input's digest: torch bumps the version counter only after the dispatch): each op
  boundary's digest equals XXH3-128 of the tensor's bytes as a plain dispatch mode in
  the test sees them;
- the dispatch mode is on only while a selected module runs, and is off after a run that
  raised inside one;
- the in-progress marker, and recognising a capture's manifest from its ends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from _support.tree import leaf
from _support.tree import tree_request as oracle_tree

from dmlib import hashing
from dmlib.localize.capture import treehash
from dmlib.localize.captures import TREE_REQUEST_TAG, XXH_REQUEST_TAG

torch = pytest.importorskip("torch")
from _support.twolinear import Tiny  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import (  # noqa: E402
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
)

import dmlib  # noqa: E402
from dmlib.localize.capture import recorder as capture_mod  # noqa: E402
from dmlib.localize.capture import writer as writer_mod  # noqa: E402

compiled = pytest.mark.skipif(
    not treehash.USE_COMPILED, reason="dmlib.localize.capture._capture not built"
)


#: scheme -> (hasher, tag, piece, digest size) as the capture passes them
ARGS = {
    "xxh3": (xxhash.xxh3_128_digest, XXH_REQUEST_TAG, sys.maxsize, 16),
    "blake3": (hashing._blake3(), TREE_REQUEST_TAG, hashing.PIECE, 32),
}


@compiled
@pytest.mark.parametrize("scheme", ["xxh3", "blake3"])
@pytest.mark.parametrize(
    ("row_bytes", "n_rows", "block"), [(256, 400, 64), (12, 97, 7), (4, 1, 64), (1000, 130, 64)]
)
def test_compiled_request_blocks_match_the_oracle(row_bytes, n_rows, block, scheme):
    rng = np.random.default_rng(row_bytes + n_rows)
    buf = rng.integers(0, 256, row_bytes * n_rows, dtype=np.uint8)
    rows = buf.reshape(n_rows, row_bytes)
    spans = [(0, n_rows // 3), (n_rows // 3, n_rows - n_rows // 3), (n_rows - 1, 1), (0, n_rows)]
    spans = [s for s in spans if s[1] > 0]
    hasher, tag, piece, size = ARGS[scheme]
    got = treehash.request_blocks(hasher, buf.data, row_bytes, spans, block, tag, piece, size)
    assert got is not None and len(got) == len(spans)
    for (start, n), (digest, blocks) in zip(spans, got):
        assert (digest, blocks) == oracle_tree(rows[start : start + n], block, scheme)


@compiled
def test_compiled_request_blocks_refuse_a_digest_of_another_size():
    buf = np.zeros(40, np.uint8)
    with pytest.raises(ValueError, match="not 32 bytes"):  # XXH3's 16 bytes, announced as 32
        treehash.request_blocks(xxhash.xxh3_128_digest, buf.data, 4, [(0, 3)], 4, b"t", 1 << 30)
    with pytest.raises(ValueError, match="digest_size"):
        treehash.request_blocks(xxhash.xxh3_128_digest, buf.data, 4, [(0, 3)], 4, b"t", 40, 0)


def test_dmlib_kernels_numpy_turns_the_compiled_loop_off():
    code = "from dmlib.localize.capture import treehash; print(treehash.USE_COMPILED)"
    env = dict(os.environ, DMLIB_KERNELS="numpy")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


@compiled
def test_compiled_request_blocks_refuse_a_span_outside_the_buffer_and_defer_big_blocks():
    buf = np.zeros(40, np.uint8)
    b3 = hashing._blake3()
    with pytest.raises(ValueError, match="outside the buffer"):
        treehash.request_blocks(b3, buf.data, 4, [(8, 3)], 4, TREE_REQUEST_TAG, hashing.PIECE)
    with pytest.raises(ValueError, match="outside the buffer"):
        treehash.request_blocks(b3, buf.data, 4, [(-1, 2)], 4, TREE_REQUEST_TAG, hashing.PIECE)
    # a block of more bytes than one piece: not computed here (the caller's piece logic)
    assert treehash.request_blocks(b3, buf.data, 4, [(0, 10)], 4, TREE_REQUEST_TAG, 15) is None


def _rows() -> list[list[tuple[str, int] | None]]:
    # two requests on consecutive rows (one over several blocks), padding, one gathered
    return [
        [("r0", j) for j in range(7)] + [None],
        [("r1", j) for j in range(3)] + [("g", 0), None, ("g", 1), ("g", 2), None],
    ]


def test_capture_digests_are_the_oracles_with_and_without_the_compiled_loop(tmp_path, monkeypatch):
    model = Tiny().eval()
    x = torch.randn(2, 8, 6, generator=torch.Generator().manual_seed(1))
    seen: dict[str, np.ndarray] = {}
    hooks = [
        m.register_forward_hook(
            lambda mod, i, o, n=n: seen.__setitem__(n, o.detach().numpy().copy())
        )
        for n, m in (("a", model.a), ("b", model.b))
    ]
    manifests = []
    for use in (True, False):
        monkeypatch.setattr(treehash, "USE_COMPILED", use and treehash.USE_COMPILED)
        with (
            torch.no_grad(),
            dmlib.capture(model, tmp_path / str(use), row_map=_rows(), block_rows=2),
        ):
            model(x)
        manifests.append(json.loads((tmp_path / str(use) / "manifest.json").read_text()))
    for h in hooks:
        h.remove()
    assert manifests[0]["boundaries"] == manifests[1]["boundaries"]
    by_name = {b["name"]: b for b in manifests[0]["boundaries"]}
    positions = {"r0": [(0, j) for j in range(7)], "r1": [(1, j) for j in range(3)],
                 "g": [(1, 3), (1, 5), (1, 6)]}  # fmt: skip
    for name, out in seen.items():
        b = by_name[name]
        assert b["digest"] == leaf(np.ascontiguousarray(out).tobytes())
        for rid, where in positions.items():
            mine = np.stack([out[r, j] for r, j in where])
            digest, blocks = oracle_tree(mine, 2)
            assert b["requests"][rid]["digest"] == digest and b["requests"][rid]["blocks"] == blocks


class Views(nn.Module):
    """Ops whose outputs share their input's memory, with and without a write."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Identity()

    def forward(self, x):
        y = x * 2.0
        v = y.view(x.shape[0] * x.shape[1], -1)  # a view: y's bytes
        w = v.reshape(x.shape)  # another view
        z = w.add_(1.0)  # writes y's memory: the output is the new bytes, not y's
        u = z.flatten(0, 1).view(x.shape)
        return self.inner(u) + 0.0


class Witness(TorchDispatchMode):
    """The test's own record of every op output's bytes, right after the op."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            data = out.detach().contiguous().numpy().tobytes()
            self.outputs.append((str(func.overloadpacket), leaf(data)))
        return out


def test_view_outputs_share_digests_only_where_the_op_writes_nothing(tmp_path, monkeypatch):
    model = Views()
    x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(2))
    rows = [[("a", j) for j in range(4)], [("b", j) for j in range(4)]]
    with torch.no_grad(), Witness() as witness:
        model(x)
    expected = [h for op, h in witness.outputs if not op.startswith("aten.detach")]
    digests: list[int] = []
    real = capture_mod.Recorder._digest
    monkeypatch.setattr(capture_mod.Recorder, "_digest",
                        lambda self, e, *a: digests.append(1) or real(self, e, *a))  # fmt: skip
    with torch.no_grad(), dmlib.capture(model, tmp_path / "c", row_map=rows, ops=True, modules="",
                                        op_modules=""):  # fmt: skip
        model(x)
    man = json.loads((tmp_path / "c" / "manifest.json").read_text())
    by_name = {b["name"]: b for b in man["boundaries"]}
    outs = [by_name[o["outputs"][0]] for o in man["ops"] if o["outputs"]]
    assert [b["digest"] for b in outs] == expected
    ops = [o["op"] for o in man["ops"]]
    assert "aten.add_.Tensor" in ops and "aten.view.default" in ops
    add = by_name[man["ops"][ops.index("aten.add_.Tensor")]["outputs"][0]]
    before = by_name[man["ops"][ops.index("aten.add_.Tensor")]["inputs"][0]]
    assert add["digest"] != before["digest"]  # hashed after the write, not shared
    assert len(digests) < len(man["boundaries"])  # some boundaries were not hashed again


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(3, 3)
        self.inner = nn.Linear(3, 3)
        self.fail = False

    def forward(self, x):
        y = self.inner(torch.tanh(self.pre(x)))
        if self.fail:
            raise RuntimeError("stopped inside")
        return y


def test_the_mode_is_on_only_inside_op_modules_and_off_after_a_raise(tmp_path, monkeypatch):
    from dmlib.localize import ops as ops_mod

    model = Outer()
    calls: list[str | None] = []
    real = ops_mod.OpRecorder.on_op

    def on_op(self, func, args, kwargs):
        calls.append(self.stack[-1] if self.stack else None)
        return real(self, func, args, kwargs)

    monkeypatch.setattr(ops_mod.OpRecorder, "on_op", on_op)
    rows = [("r", j) for j in range(4)]
    with torch.no_grad(), dmlib.capture(model, tmp_path / "c", row_map=rows, ops=True,
                                        op_modules="inner"):  # fmt: skip
        model(torch.ones(4, 3))
    assert calls and set(calls) == {"inner"}  # no op outside `inner` reached the mode
    man = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert {o["owner"] for o in man["ops"]} == {"inner"}
    model.inner.register_forward_hook(lambda m, i, o: (_ for _ in ()).throw(RuntimeError("hook")))
    with pytest.raises(RuntimeError, match="hook"):
        with torch.no_grad(), dmlib.capture(model, tmp_path / "d", row_map=rows, ops=True,
                                            op_modules="inner"):  # fmt: skip
            model(torch.ones(4, 3))
    assert _get_current_dispatch_mode_stack() == []


def test_the_in_progress_marker_says_what_and_that_it_is_unfinished(tmp_path):
    model = Tiny().eval()
    during = {}

    def peek(mod, i, o):
        during.update(json.loads((tmp_path / "c" / "manifest.json").read_text()))

    h = model.b.register_forward_hook(peek)
    with torch.no_grad(), dmlib.capture(model, tmp_path / "c", row_map=_rows(),
                                        metadata={"run": "x"}):  # fmt: skip
        model(torch.zeros(2, 8, 6))
    h.remove()
    assert during["format"] == "dmlib-capture" and during["complete"] is False
    assert during["metadata"] == {"run": "x"} and during["boundaries"] == []
    assert "row_map" not in during


def _write(path: Path, text: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(text)
    (path / "tensors").mkdir(exist_ok=True)
    (path / "tensors" / "00000.safetensors").write_bytes(b"dump")
    return path / "tensors" / "00000.safetensors"


def test_a_capture_manifest_is_recognised_from_its_ends_or_by_parsing(tmp_path):
    model = Tiny().eval()
    rows = _rows()
    dmlib_written = '{"format":"dmlib-capture","version":3,"complete":true,"boundaries":[\n]}\n'
    pretty = json.dumps({"version": 3, "format": "dmlib-capture", "boundaries": []}, indent=2)
    for name, text in (("ours", dmlib_written), ("pretty", pretty)):
        dump = _write(tmp_path / name, text)
        with torch.no_grad(), dmlib.capture(model, tmp_path / name, row_map=rows, overwrite=True):
            model(torch.zeros(2, 8, 6))
        assert not dump.exists()  # a capture's own dump, replaced
    # our head but cut short (no closing brace): parsed, not a manifest, nothing replaced
    cut = _write(tmp_path / "cut", dmlib_written[:40])
    with pytest.raises(dmlib.CaptureError, match="not a dmlib-capture manifest"):
        with torch.no_grad(), dmlib.capture(model, tmp_path / "cut", row_map=rows, overwrite=True):
            model(torch.zeros(2, 8, 6))
    assert cut.read_bytes() == b"dump"


def test_the_manifest_encoder_writes_what_json_dumps_writes():
    entry = {"name": 'blk.<script>"\u00e9\u2028', "shape": [2, 3], "x": float("nan"),
             "requests": {"r": {"digest": "ab", "n_rows": 2, "blocks": ["ab"]}}, "dump": None,
             "leading": [], "ok": True, "big": 2**70, "neg": -0.0}  # fmt: skip
    assert writer_mod._encode_compact(entry) == json.dumps(entry, separators=(",", ":"))
