"""Localising through per-sequence boundaries (pooled outputs, a classifier head).

A tiny transformer classifier (tests/_support/tinynet.py) runs one request alone and packed as
one batch row among four. Its only batch-dependent op is planted in the head, so the
ground truth is known; an independent oracle (plain forward hooks, comparing the
request's rows with torch.equal) confirms it on every run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import _support.tinynet as tn  # noqa: E402

import dmlib  # noqa: E402
from dmlib.cli import main  # noqa: E402
from dmlib.errors import CaptureError, DmlibError  # noqa: E402

T = 10
PROBE = [3, 17, 8, 29]
OTHERS = {"r1": [5, 6, 7, 8, 9, 10], "r2": [11, 12], "r3": [13, 14, 15, 16, 17, 18, 19]}
LAYOUTS = {
    "alone": [[("probe", PROBE)]],
    # the probe sits in batch row 2: attribution must find it there
    "packed": [
        [("r1", OTHERS["r1"])],
        [("r2", OTHERS["r2"])],
        [("probe", PROBE)],
        [("r3", OTHERS["r3"])],
    ],
    # probe and another request share one batch row: per-sequence rows mix them
    "shared": [[("probe", PROBE), ("r2", OTHERS["r2"])]],
}
HOOKED = ["tok", "pos", "blocks.0", "blocks.1", "pool", "head"]


def _capture(tmp_path, name, *, flat=False, modules=None, dump=None, model=None):
    m = model or tn.model(1)
    ids, seg, rows = tn.batch(LAYOUTS[name], T)
    row_map = [e for r in rows for e in r] if flat else rows
    path = tmp_path / name
    with torch.no_grad(), dmlib.capture(m, path, row_map=row_map, modules=modules, dump=dump):
        m(ids, seg)
    return path


def _oracle_first_difference(layout_a: str, layout_b: str) -> list[str]:
    """Modules whose output rows of the probe differ, by plain forward hooks."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for layout in (layout_a, layout_b):
        m = tn.model(1)
        seen: dict[str, torch.Tensor] = {}
        hooks = [
            m.get_submodule(n).register_forward_hook(
                lambda mod, args, o, n=n, seen=seen: seen.__setitem__(n, o.detach().clone())
            )
            for n in HOOKED
        ]
        ids, seg, _ = tn.batch(LAYOUTS[layout], T)
        with torch.no_grad():
            m(ids, seg)
        for h in hooks:
            h.remove()
        b = next(i for i, parts in enumerate(LAYOUTS[layout]) if parts[0][0] == "probe")
        probe = {}
        for n, o in seen.items():
            if n == "pos":  # [1, T, D]: no batch axis
                probe[n] = o
            elif o.dim() == 3:  # per token: the probe's positions
                probe[n] = o[b, : len(PROBE)]
            else:  # per sequence: the probe's batch row
                probe[n] = o[b]
        out[layout] = probe
    return [n for n in HOOKED if not torch.equal(out[layout_a][n], out[layout_b][n])]


def test_per_sequence_head_difference_is_found_and_attributed(tmp_path):
    oracle = _oracle_first_difference("alone", "packed")
    assert oracle == ["head"]  # the planted difference, and nothing upstream of it
    a = _capture(tmp_path, "alone", dump=["pool", "head"])
    b = _capture(tmp_path, "packed", dump=["pool", "head"])
    assert dmlib.open_capture(b).batch == 4
    df = dmlib.compare_captures(a, b, request="probe")
    at = df.attrs
    assert at["status"] == "different"
    assert at["first_divergent_boundary"] == "head" == at["culprit"]
    assert at["unjudged"] == []
    rows = df.set_index("boundary")
    assert rows.loc["head:input0", "identical"] and rows.loc["pool", "identical"]
    assert "batch row 0 vs 2" in rows.loc["head", "note"]
    # element statistics of the probe's row, against numpy on the dumped bytes
    ca, cb = dmlib.open_capture(a), dmlib.open_capture(b)
    xa, xb = ca.tensor("head")[0], cb.tensor("head")[2]
    ua, ub = xa.view(np.int32).astype(np.int64), xb.view(np.int32).astype(np.int64)
    assert rows.loc["head", "n_diff"] == int((ua != ub).sum()) == tn.CLASSES
    assert rows.loc["head", "max_ulp"] == int(np.abs(ua - ub).max()) == 1
    # positional embeddings [1, T, D] are per position, broadcast over the batch: judged
    # by the positions the probe occupies in each capture (not whole)
    assert rows.loc["pos", "identical"] and cb.boundary("pos").broadcast


def test_flat_row_map_infers_the_batch(tmp_path):
    a = _capture(tmp_path, "alone", flat=True)
    b = _capture(tmp_path, "packed", flat=True)
    assert dmlib.open_capture(b).batch == 4
    df = dmlib.compare_captures(a, b, request="probe")
    assert df.attrs["status"] == "different" and df.attrs["culprit"] == "head"


def test_cli_different_exit_1(tmp_path, capsys):
    a, b = _capture(tmp_path, "alone"), _capture(tmp_path, "packed")
    assert main(["localize", str(a), str(b), "--request", "probe"]) == 1
    out = capsys.readouterr().out
    assert "first divergent boundary: head" in out and "identical: all" not in out


def test_rows_that_mix_requests_are_inconclusive_exit_3(tmp_path, capsys):
    # only the embedding lookup (exact) and the head: nothing judged can differ
    a = _capture(tmp_path, "alone", modules=["tok", "head"])
    b = _capture(tmp_path, "shared", modules=["tok", "head"])
    before = {p: p.read_bytes() for p in (a / "manifest.json", b / "manifest.json")}
    df = dmlib.compare_captures(a, b, request="probe")
    assert df.attrs["status"] == "inconclusive"
    assert [u["boundary"] for u in df.attrs["unjudged"]] == ["head:input0", "head"]
    assert "also holds request(s) ['r2']" in df.attrs["unjudged"][0]["reason"]
    assert main(["localize", str(a), str(b), "--request", "probe"]) == 3
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("inconclusive")]
    assert "head:input0 (" in line and "; head (" in line and "'r2'" in line
    assert not any(x.startswith("identical") for x in out.splitlines())
    assert {p: p.read_bytes() for p in before} == before
    assert main(["localize", str(a), str(b), "--request", "probe", "--json"]) == 3
    assert json.loads(capsys.readouterr().out)["attrs"]["status"] == "inconclusive"


def test_model_outputs_matching_settle_what_inner_boundaries_cannot(tmp_path):
    # the same layout twice, hooking the model itself: every boundary judged, identical
    a = _capture(tmp_path, "alone", modules=["", "tok", "head"])
    (tmp_path / "again").mkdir()
    b = _capture(tmp_path / "again", "alone", modules=["", "tok", "head"])
    df = dmlib.compare_captures(a, b)
    assert df.attrs["status"] == "identical" and df.attrs["outputs_match"]


def test_help_documents_exit_3(capsys):
    with pytest.raises(SystemExit):
        main(["localize", "--help"])
    assert "3  inconclusive" in capsys.readouterr().out


def test_row_map_of_wrong_length_is_refused_at_capture_time(tmp_path, capsys):
    m = tn.model(1)
    ids, seg, rows = tn.batch(LAYOUTS["alone"], T)
    bad = [e for r in rows for e in r] + [None]  # one entry too many
    with pytest.raises(CaptureError, match="row_map has 11 rows but no boundary"):
        with torch.no_grad(), dmlib.capture(m, tmp_path / "bad", row_map=bad):
            m(ids, seg)
    with pytest.raises(DmlibError, match="incomplete capture"):
        dmlib.open_capture(tmp_path / "bad")
    good = _capture(tmp_path, "alone")
    assert main(["localize", str(good), str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "row_map has 11 rows" in err


def test_nested_row_map_must_agree_with_the_batch(tmp_path):
    m = tn.model(1)
    ids, seg, rows = tn.batch(LAYOUTS["packed"], T)
    halves = [r[: T // 2] for r in rows] + [r[T // 2 :] for r in rows]  # 8 rows of 5
    with pytest.raises(CaptureError, match="nested row_map has 8 batch rows"):
        with torch.no_grad(), dmlib.capture(m, tmp_path / "x", row_map=halves):
            m(ids, seg)
    with pytest.raises(CaptureError, match="lengths"):
        with dmlib.capture(m, tmp_path / "y", row_map=[rows[0], rows[1][:3]]):
            pass


class _FlatTokens(torch.nn.Module):
    """Embeds the tokens flattened ([batch*seq] -> [batch*seq, D]): no [batch, seq] boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(tn.VOCAB, tn.D)
        self.head = tn.PlantedHead(planted=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids.reshape(-1)).reshape(*ids.shape, tn.D)
        return self.head(x.mean(1))


def test_unknown_batch_whole_tensor_only_for_the_same_row_layout(tmp_path):
    torch.manual_seed(0)
    m = _FlatTokens().eval()
    x, z = [3, 4, 5, 9], [6, 7, 8, 9]  # 4 positions: unlike the head's 3 classes
    first = [("probe", p) for p in range(4)] + [("other", p) for p in range(4)]
    swapped = [("other", p) for p in range(4)] + [("probe", p) for p in range(4)]
    layouts = {"a": ([x, z], first), "b": ([z, x], swapped), "a2": ([x, z], first)}
    for name, (ids, rows) in layouts.items():
        with torch.no_grad(), dmlib.capture(m, tmp_path / name, row_map=rows):
            m(torch.tensor(ids))
    assert dmlib.open_capture(tmp_path / "a").batch is None  # flat map, no [batch, seq] tensor
    df = dmlib.compare_captures(tmp_path / "a", tmp_path / "b", request="probe")
    # the probe's tokens match; the head's [2, 3] rows are swapped, so the whole tensor
    # says nothing about the probe: not judged, rather than "different" or "identical"
    assert df.attrs["status"] == "inconclusive"
    assert {u["boundary"] for u in df.attrs["unjudged"]} == {"head:input0", "head"}
    assert "batch size unknown" in df.attrs["unjudged"][0]["reason"]
    same = dmlib.compare_captures(tmp_path / "a", tmp_path / "a2", request="probe")
    assert same.attrs["status"] == "identical" and same.attrs["unjudged"] == []
