"""Per-position tensors broadcast over the batch (a rotary embedding's cos and sin, [1, L, d])
judged by position: a request alone against the same request in a right-padded batch."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dmlib  # noqa: E402
from dmlib.localize.boundaries import compare_captures  # noqa: E402

ROT = "model.rotary_emb"
MODULES = ("model.rotary_emb", "model.layers.*", "model.norm")


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).float().eval()


PROBE = [5, 9, 11]  # the request alone: 3 tokens


def _alone(m, path):
    with torch.no_grad(), dmlib.capture(m, path, modules=MODULES, overwrite=True,
                                        row_map=[[("p", j) for j in range(3)]]):  # fmt: skip
        m(input_ids=torch.tensor([PROBE]))


def _batch(m, path, plant=None):
    """The probe in row 1 of a right-padded batch of 3 x 5 (others: 5 and 4 tokens)."""
    ids = torch.tensor([[1, 2, 3, 4, 6], [*PROBE, 0, 0], [7, 8, 9, 10, 0]])
    mask = torch.tensor([[1] * 5, [1, 1, 1, 0, 0], [1, 1, 1, 1, 0]])
    rows = [[("a", j) for j in range(5)], [("p", 0), ("p", 1), ("p", 2), None, None],
            [("b", j) for j in range(4)] + [None]]  # fmt: skip
    handle = None
    if plant is not None:  # +1 ULP in the cos row of one position (column), all batch rows

        def hook(mod, args, out):
            cos = out[0].clone()
            cos[0, plant, 0] = torch.nextafter(cos[0, plant, 0], torch.tensor(np.inf))
            return (cos, out[1])

        handle = m.get_submodule(ROT).register_forward_hook(hook)
    try:
        with torch.no_grad(), dmlib.capture(m, path, modules=MODULES, overwrite=True,
                                            row_map=rows):  # fmt: skip
            m(input_ids=ids, attention_mask=mask)
    finally:
        if handle is not None:
            handle.remove()


def test_rotary_cos_sin_judged_by_position_alone_against_a_padded_batch(tmp_path):
    m = _model()
    _alone(m, tmp_path / "alone")
    _batch(m, tmp_path / "batch")
    b = dmlib.open_capture(tmp_path / "batch").boundary(ROT)
    assert b.broadcast and b.shape == (1, 5, 8) and b.requests["p"].n_rows == 3
    df = compare_captures(tmp_path / "alone", tmp_path / "batch", request="p")
    same = dict(zip(df["boundary"], df["identical"], strict=True))
    assert same[ROT] == True  # noqa: E712 (a pandas boolean; None where not judged)
    assert same[f"{ROT}:output1"] == True  # noqa: E712
    assert same["model.layers.0:input.position_embeddings.0"] == True  # noqa: E712
    # a request's positions are the rows it occupies: request b (4 tokens) in its own row
    assert dmlib.open_capture(tmp_path / "batch").boundary(ROT).requests["b"].n_rows == 4


def test_a_planted_ulp_in_one_position_of_cos_is_found_for_the_requests_there(tmp_path):
    m = _model()
    _alone(m, tmp_path / "alone")
    _batch(m, tmp_path / "late", plant=4)  # a column the probe does not occupy
    _batch(m, tmp_path / "hit", plant=2)  # the probe's position 2
    late = compare_captures(tmp_path / "alone", tmp_path / "late", request="p")
    assert dict(zip(late["boundary"], late["identical"], strict=True))[ROT] == True  # noqa: E712
    hit = compare_captures(tmp_path / "alone", tmp_path / "hit", request="p")
    row = hit[hit["boundary"] == ROT].iloc[0]
    assert row["identical"] == False  # noqa: E712
    assert hit.attrs["first_divergent_boundary"] == ROT
    # the padded batch against itself with the plant: request a (5 tokens) sees column 4
    both = compare_captures(tmp_path / "late", tmp_path / "hit", request="a")
    assert dict(zip(both["boundary"], both["identical"], strict=True))[ROT] == False  # noqa: E712


def _bert():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.BertModel(cfg).float().eval()


POS = "embeddings.position_embeddings"


def _bert_capture(m, path, ids, rows, shift=None):
    """One capture of ``m``'s embeddings; ``shift``: the position id column moved by one in
    the [1, L] position ids the embedding table receives (a planted layout bug)."""
    handle = None
    if shift is not None:

        def pre(mod, args):
            pos = args[0].clone()
            pos[0, shift] += 1
            return (pos,)

        handle = m.get_submodule(POS).register_forward_pre_hook(pre)
    try:
        with torch.no_grad(), dmlib.capture(m, path, modules=("embeddings", "embeddings.*"),
                                            overwrite=True, row_map=rows):  # fmt: skip
            m(input_ids=torch.tensor(ids), attention_mask=(torch.tensor(ids) > 0).long())
    finally:
        if handle is not None:
            handle.remove()


def test_position_ids_of_shape_1_by_L_judged_by_position(tmp_path):
    """An absolute position table's input, position ids [1, L] shared by a right-padded
    batch: judged per request by the columns it occupies (the request's positions 0..2 are
    ids 0..2 in both runs: identical by construction); a column moved by one in the batch
    run is found, and only for the request occupying it."""
    m = _bert()
    _bert_capture(m, tmp_path / "alone", [PROBE], [[("p", j) for j in range(3)]])
    ids = [[1, 2, 3, 4, 6], [*PROBE, 0, 0]]
    rows = [[("a", j) for j in range(5)], [("p", 0), ("p", 1), ("p", 2), None, None]]
    _bert_capture(m, tmp_path / "batch", ids, rows)
    _bert_capture(m, tmp_path / "moved", ids, rows, shift=3)  # a column p does not occupy
    b = dmlib.open_capture(tmp_path / "batch").boundary(f"{POS}:input0")
    assert b.broadcast and b.shape == (1, 5) and b.requests["p"].n_rows == 3
    df = compare_captures(tmp_path / "alone", tmp_path / "batch", request="p")
    assert dict(zip(df["boundary"], df["identical"], strict=True))[f"{POS}:input0"] == True  # noqa: E712
    moved = compare_captures(tmp_path / "alone", tmp_path / "moved", request="p")
    assert dict(zip(moved["boundary"], moved["identical"], strict=True))[f"{POS}:input0"] == True  # noqa: E712
    a = compare_captures(tmp_path / "batch", tmp_path / "moved", request="a")
    assert dict(zip(a["boundary"], a["identical"], strict=True))[f"{POS}:input0"] == False  # noqa: E712


def test_broadcast_rows_checksummed_where_they_live(tmp_path, monkeypatch):
    """With the device's checksums (taken here on CPU tensors, ``cksum4-v1``) on both sides,
    cos is judged by position as on the host: identical alone against the batch, +1 ULP at
    a column the probe does not occupy still identical for it, at its position 2 found."""
    from dmlib.localize.capture import recorder

    init = recorder.Recorder.__init__

    def on_device_path(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self._device_path_on_cpu = True  # the device path, as a GPU tensor takes it

    monkeypatch.setattr(recorder.Recorder, "__init__", on_device_path)
    m = _model()
    _alone(m, tmp_path / "alone")
    _batch(m, tmp_path / "batch")
    _batch(m, tmp_path / "late", plant=4)
    _batch(m, tmp_path / "hit", plant=2)
    b = dmlib.open_capture(tmp_path / "batch").boundary(ROT)
    assert b.broadcast and b.hash == "cksum4-v1" and b.requests["p"].n_rows == 3
    for side, same in (("batch", True), ("late", True), ("hit", False)):
        df = compare_captures(tmp_path / "alone", tmp_path / side, request="p")
        got = dict(zip(df["boundary"], df["identical"], strict=True))
        assert got[ROT] == same, side
        assert got["model.layers.0:input.position_embeddings.0"] == same, side
        if side == "batch":
            assert got[f"{ROT}:output1"] == True  # noqa: E712
