"""DCP checkpoints: tiling checked in O(n log n), impossible sizes refused before allocation,
and read without importing torch.

Layouts are built by hand here (their ground truth is known by construction); the
checkpoints are written by ``torch.distributed.checkpoint`` and edited through the test's
own (trusted) ``pickle``.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest

import dmlib
from dmlib.cli import main
from dmlib.io.dcp import _boxes_tile

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


def _brick_wall(rows: int, per_row: int, width: int) -> list:
    """Each row split at its own columns (as no grid is): the worst case of a pairwise check."""
    rng = np.random.default_rng(0)
    chunks = []
    for r in range(rows):
        cuts = np.sort(rng.choice(np.arange(1, width), per_row - 1, replace=False))
        edges = [0, *cuts.tolist(), width]
        chunks += [((r, a), (1, b - a)) for a, b in zip(edges, edges[1:])]
    return chunks


def test_twenty_thousand_chunks_tile_in_well_under_a_second():
    chunks = _brick_wall(200, 100, 10_000)
    assert len(chunks) == 20_000
    start = time.perf_counter()
    assert _boxes_tile((200, 10_000), chunks) is None
    assert time.perf_counter() - start < 3.0  # pair by pair it took minutes
    # chunk 500 widened over the first column of chunk 501, the row's last chunk narrowed:
    # the same volume, one overlap (and one gap)
    (o1, s1), (o2, _), (o3, s3) = chunks[500], chunks[501], chunks[599]
    bad = [
        *chunks[:500],
        (o1, (1, s1[1] + 1)),
        *chunks[501:599],
        (o3, (1, s3[1] - 1)),
        *chunks[600:],
    ]
    start = time.perf_counter()
    assert _boxes_tile((200, 10_000), bad) == f"chunks at {list(o1)} and {list(o2)} overlap"
    assert time.perf_counter() - start < 3.0  # pair by pair it took minutes


def test_tiling_in_one_and_three_dimensions():
    rows = [((i * 3,), (3,)) for i in range(20_000)]
    start = time.perf_counter()
    assert _boxes_tile((60_000,), rows) is None
    grid = [
        ((a, b, c), (2, 3, 4))
        for a in range(0, 40, 2)
        for b in range(0, 60, 3)
        for c in range(0, 200, 4)
    ]
    assert len(grid) == 20_000 and _boxes_tile((40, 60, 200), grid) is None
    assert time.perf_counter() - start < 6.0
    # a gap and an overlap of equal volume in 3-D
    moved = [*grid[:-1], ((0, 0, 0), (2, 3, 4))]
    assert "overlap" in _boxes_tile((40, 60, 200), moved)
    assert "elements" in _boxes_tile((40, 60, 200), grid[:-1])  # a gap alone: volume short
    assert "outside" in _boxes_tile((4,), [((2,), (3,))])


def _saved(path, **tensors) -> None:
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(tensors, checkpoint_id=str(path), no_dist=True)


def test_tensor_declared_at_four_tebibytes_is_refused_before_allocation(tmp_path, capsys):
    _saved(tmp_path / "ck", w=torch.arange(8.0))
    md = pickle.loads((tmp_path / "ck" / ".metadata").read_bytes())
    meta = md.state_dict_metadata["w"]
    huge = 1 << 40  # float32 elements: 4 TiB
    meta.size = torch.Size([huge])
    meta.chunks[0].sizes = torch.Size([huge])
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(dmlib.FormatError, match="needs 4398046511104 bytes, its place holds"):
        dmlib.open_tensors(tmp_path / "ck")
    assert main(["inspect", str(tmp_path / "ck")]) == 2
    assert "4398046511104" in capsys.readouterr().err


def test_dcp_read_in_a_fresh_interpreter_without_torch(tmp_path):
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 7
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    _saved(tmp_path / "ck", w=w, b=b, step=torch.tensor(5))
    code = (
        "import sys, json, dmlib\n"
        "with dmlib.open_tensors(sys.argv[1]) as ts:\n"
        "    out = {k: t.raw().tobytes().hex() for k, t in ts.items()}\n"
        "print(json.dumps({'t': out, 'torch': 'torch' in sys.modules}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["torch"] is False
    want = {"w": w.numpy().tobytes(), "b": b.view(torch.int16).numpy().tobytes(),
            "step": torch.tensor(5).numpy().tobytes()}  # fmt: skip
    assert doc["t"] == {k: v.hex() for k, v in want.items()}
