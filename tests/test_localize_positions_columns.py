"""A sampler that computes two positions of a request per pass (a speculative verification,
a chunked prefill), judged position by position against a full-sequence forward by digest
alone: with ``block_rows=1`` a later pass's ``(batch, 2, ...)`` tensors keep one digest per
column (``columns`` in the manifest entry), which ``pass_rows`` pairs with the trainer's row
of the position each column computed.

The oracle is plain torch forward hooks on layer 0's q_proj: the trainer's row at each
position, the sampler's column of each pass, compared by hand with torch.equal. +1 ULP is
planted (torch.nextafter, through a hook) in one column of one pass of the sampler run;
what the unplanted model does on this CPU is never assumed, only read from the oracle.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
xxhash = pytest.importorskip("xxhash")

import dmlib  # noqa: E402
from dmlib.localize.boundaries import compare_captures  # noqa: E402

Q = "model.layers.0.self_attn.q_proj"
SEQ = [5, 6, 7, 9, 8, 4, 2]  # 3 prompt positions, then two positions per pass
PASSES = {1: (3, 4), 2: (5, 6)}  # pass -> the positions its two columns compute


def _model():
    """A tiny random Qwen2 whose layer-0 q_proj computes each row by its own call, so that
    a row's value does not depend on how many rows share the pass (by construction)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    q = model.model.layers[0].self_attn.q_proj
    f = torch.nn.functional.linear

    def forward(x):
        rows = [f(r, q.weight, q.bias) for r in x.reshape(-1, x.shape[-1])]
        return torch.stack(rows).reshape(*x.shape[:-1], q.out_features)

    q.forward = forward
    return model


def _q(model):
    return model.model.layers[0].self_attn.q_proj


def _collect(model, plant=None):
    """Forward hooks on q_proj: the outputs per call, +1 ULP at (call, column) ``plant``."""
    calls, outs = [0], []

    def hook(mod, args, out):
        k = calls[0]
        calls[0] += 1
        if plant is None or k != plant[0]:
            return None
        out = out.clone()
        out[0, plant[1], 0] = torch.nextafter(out[0, plant[1], 0], torch.tensor(float("inf")))
        return out

    handles = [_q(model).register_forward_hook(hook)]  # first: what follows sees the plant
    handles.append(_q(model).register_forward_hook(lambda m, a, o: outs.append(o.detach().clone())))
    return outs, handles


def _sampler(model, path, plant=None, device_path=False, block_rows=1):
    """A loop of one's own: the prompt prefilled, then two tokens per pass against a
    DynamicCache; ``pass_rows`` names both positions of each pass. Digests only, no dump."""
    outs, handles = _collect(model, plant)
    cache = transformers.DynamicCache(config=model.config)
    rm = [[("A", p) for p in range(3)]]
    try:
        with torch.no_grad(), dmlib.capture(model, path, row_map=rm, block_rows=block_rows) as rec:
            rec._device_path_on_cpu = device_path  # the device's checksums, on this CPU
            model(input_ids=torch.tensor([SEQ[:3]]), cache=cache)
            for start, _ in PASSES.values():
                model(input_ids=torch.tensor([SEQ[start : start + 2]]),
                      position_ids=torch.arange(start, start + 2)[None],
                      attention_mask=torch.ones((1, start + 2), dtype=torch.long), cache=cache)  # fmt: skip
            rec.metadata["pass_rows"] = {
                str(s): [[["A", p] for p in ps]] for s, ps in PASSES.items()
            }
    finally:
        for h in handles:
            h.remove()
    return outs


def _trainer(model, path, device_path=False):
    """The whole sequence in one forward pass, no cache; q_proj's rows by position."""
    outs, handles = _collect(model)
    try:
        with torch.no_grad(), dmlib.capture(model, path, row_map=[[("A", p) for p in range(7)]],
                                            block_rows=1) as rec:  # fmt: skip
            rec._device_path_on_cpu = device_path
            model(input_ids=torch.tensor([SEQ]))
    finally:
        for h in handles:
            h.remove()
    return outs[0][0]


def _oracle(t, outs):
    """Per pass: {position: the trainer's row equals the sampler's}, by hand."""
    out = {0: {p: torch.equal(t[p], outs[0][0, p]) for p in range(3)}}
    for s, ps in PASSES.items():
        out[s] = {p: torch.equal(t[p], outs[s][0, c]) for c, p in enumerate(ps)}
    return out


def _entries(path):
    """The manifest's boundary entries by name, read with the json module."""
    return {e["name"]: e for e in json.loads((path / "manifest.json").read_text())["boundaries"]}


def _q_rows(df):
    rows = df[(df["module"] == Q) & (df["kind"] == "output")]
    return rows.set_index("boundary")


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device-checksums"])
def test_a_planted_column_found_at_its_position_by_digest(tmp_path, device_path):
    model = _model()
    t = _trainer(model, tmp_path / "t", device_path)
    clean = _oracle(t, _sampler(model, tmp_path / "s0", device_path=device_path))
    planted = _oracle(t, _sampler(model, tmp_path / "s", (2, 1), device_path=device_path))
    assert planted[2] == {5: clean[2][5], 6: False}  # the plant, as the hooks see it
    assert all(planted[s] == clean[s] for s in (0, 1))
    for name, oracle in (("s0", clean), ("s", planted)):
        df = compare_captures(tmp_path / "t", tmp_path / name, request="A")
        q = _q_rows(df)
        assert len(q) == 3
        for s, by in oracle.items():
            row = q.loc[Q if s == 0 else f"{Q}#{s}"]
            assert not pd.isna(row["identical"]), row["note"]  # judged, by digest
            assert "not judged" not in row["note"]
            assert bool(row["identical"]) == all(by.values())
            assert (row["diff_positions"] or []) == [p for p, v in by.items() if not v]
    hit = q.loc[f"{Q}#2"]
    assert hit["diff_positions"] == [6] and "decode step 2" in hit["note"]
    assert df.attrs["status"] == "different"
    assert not [u for u in df.attrs["not_captured"] if u["what"].startswith("position")]
    # no boundary of a two-column pass is left unjudged for want of per-column digests
    wide = df[df["note"].str.contains("one digest covers", regex=False)]
    assert wide.empty, list(wide["boundary"])


def test_every_two_column_output_of_the_passes_judged(tmp_path):
    """Every module output of a two-column pass that has a full-sequence counterpart is
    judged (identical or not, as the bytes are), none left to 'not judged'."""
    model = _model()
    _trainer(model, tmp_path / "t")
    _sampler(model, tmp_path / "s", (1, 0))
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="A")
    cap = dmlib.open_capture(tmp_path / "s")
    two = {x.name for x in cap.boundaries
           if x.step and x.kind == "output" and len(x.shape) >= 3 and x.shape[1] == 2
           and not (x.cache or x.state)}  # fmt: skip
    assert two  # the decoder layers, norms, projections, logits of both passes
    rows = df[df["boundary"].isin(two)]
    assert len(rows) == len(two)
    assert rows["identical"].notna().all(), rows[rows["identical"].isna()][["boundary", "note"]]
    assert rows.loc[rows["boundary"] == f"{Q}#1", "diff_positions"].iloc[0] == [3]


def test_the_column_digests_are_xxh3_of_each_columns_bytes(tmp_path):
    """The manifest's per-column blocks are XXH3-128 of each column's C-order bytes (the
    xxhash library on the hooks' rows), as the trainer's per-position blocks are of each
    position's row: the two sides' digests of one position are one hash of one row."""
    model = _model()
    outs = _sampler(model, tmp_path / "s")
    t = _trainer(model, tmp_path / "t")
    entries, trainer = _entries(tmp_path / "s"), _entries(tmp_path / "t")
    for s in PASSES:
        cols = entries[f"{Q}#{s}"]["columns"]
        assert cols["hash"] == "xxh3-128-tree-v1" and len(cols["rows"]) == 1
        row = cols["rows"][0]
        assert row["n_rows"] == 2
        assert row["blocks"] == [
            xxhash.xxh3_128_hexdigest(outs[s][0, c].numpy().tobytes()) for c in range(2)
        ]
    blocks = trainer[Q]["requests"]["A"]["blocks"]
    assert blocks == [xxhash.xxh3_128_hexdigest(t[p].numpy().tobytes()) for p in range(7)]
    # one-column and prompt tensors keep none; the prefill's q_proj is row-mapped
    assert "columns" not in entries[Q]


def test_blocks_of_many_positions_keep_no_column_digests(tmp_path):
    """Only block_rows=1 asks for per-position digests: with blocks of 64 the passes keep
    one digest per batch row, and their positions are not judged (never paired whole)."""
    model = _model()
    _trainer(model, tmp_path / "t")
    _sampler(model, tmp_path / "s", (2, 1), block_rows=64)
    cap = dmlib.open_capture(tmp_path / "s")
    assert all(x.columns is None for x in cap.boundaries)
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="A")
    q = _q_rows(df)
    for s in PASSES:
        assert pd.isna(q.loc[f"{Q}#{s}", "identical"])
        assert "block_rows=1" in q.loc[f"{Q}#{s}", "note"]
    assert df.attrs["status"] != "identical"


@pytest.mark.parametrize("bad", [[], {"hash": "xxh3-128-tree-v1"}, {"hash": "x", "rows": [3]}])
def test_a_malformed_columns_entry_is_refused_naming_the_manifest(tmp_path, bad):
    from dmlib.errors import CaptureError

    model = _model()
    _sampler(model, tmp_path / "s")
    path = tmp_path / "s" / "manifest.json"
    man = json.loads(path.read_text())
    entry = next(e for e in man["boundaries"] if "columns" in e)
    entry["columns"] = bad
    path.write_text(json.dumps(man))
    with pytest.raises(CaptureError, match="manifest.json") as err:
        dmlib.open_capture(tmp_path / "s")
    assert "is malformed" in str(err.value)  # one line: the boundary and the manifest
