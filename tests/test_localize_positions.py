"""A full-sequence capture (trainer) against a prefill + decode capture (sampler), position
by position, with real transformers generate() (DynamicCache and StaticCache).

The oracle is plain torch forward hooks on one module (layer 0's q_proj): the trainer's
row at each position of the probe, the sampler's rows of the prefill and of each decode
pass, compared by hand with torch.equal. A difference is planted in the sampler run only
(one element of one decode step's q_proj output moved by 1 ULP with torch.nextafter); what
the unplanted model does on this CPU is never assumed, only read from the oracle.
"""

from __future__ import annotations

import pandas as pd
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dmlib  # noqa: E402
from dmlib.localize.boundaries import compare_captures  # noqa: E402
from dmlib.localize.hf import capture_generate, row_map_from_attention_mask  # noqa: E402

Q = "model.layers.0.self_attn.q_proj"
PAD = 2  # the probe's prompt is left-padded by this much in the sampler's batch
NEW = 4  # tokens generated: the prefill, then NEW - 1 decode passes


def _model(rowwise=False):
    """A tiny random Qwen2; ``rowwise``: layer 0's q_proj computes each row by its own call
    (so a row's value does not depend on how many rows share the pass, by construction)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    if rowwise:
        q = _q(model)
        f = torch.nn.functional.linear

        def forward(x):
            rows = [f(r, q.weight, q.bias) for r in x.reshape(-1, x.shape[-1])]
            return torch.stack(rows).reshape(*x.shape[:-1], q.out_features)

        q.forward = forward
    return model


def _q(model):
    return model.model.layers[0].self_attn.q_proj


def _sample(model, path, cache, plant_step=None, **capture_kw):
    """generate() captured; returns (probe's full sequence, q_proj outputs per pass)."""
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    calls, outs = [0], []

    def plant(mod, args, out):
        k = calls[0]
        calls[0] += 1
        if k == plant_step:
            out = out.clone()
            out[0, 0, 0] = torch.nextafter(out[0, 0, 0], torch.tensor(float("inf")))
            return out
        return None

    handles = [_q(model).register_forward_hook(plant)]  # first: what follows sees the plant
    handles.append(_q(model).register_forward_hook(lambda m, a, o: outs.append(o.detach().clone())))
    kw = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": NEW, "do_sample": False,
          "pad_token_id": 0}  # fmt: skip
    if cache:
        kw["cache_implementation"] = cache
    rm = row_map_from_attention_mask(mask, ["probe", "other"])
    try:
        with torch.no_grad():
            opts = {"block_rows": 1, **capture_kw}
            seq = capture_generate(model, path, row_map=rm, generate_kwargs=kw, **opts)
    finally:
        for h in handles:
            h.remove()
    return seq[0, PAD:], outs


def _train(model, path, seq, **kw):
    """The probe's full sequence in a right-padded batch of two, captured whole."""
    other = torch.tensor([3, 1, 4, 1, 5])
    ids = torch.zeros((2, len(seq)), dtype=torch.long)
    ids[0], ids[1, : len(other)] = seq, other
    mask = (ids != 0).long()
    mask[0] = 1
    outs = []
    h = _q(model).register_forward_hook(lambda m, a, o: outs.append(o.detach().clone()))
    rm = row_map_from_attention_mask(mask, ["probe", "other"])
    try:
        with torch.no_grad(), dmlib.capture(model, path, row_map=rm, overwrite=True, **kw):
            model(input_ids=ids, attention_mask=mask)
    finally:
        h.remove()
    return outs[0][0]  # the probe's rows, (L, hidden)


def _oracle(trainer_rows, sampler_outs):
    """Per pass: {position: rows equal} for the probe, by hand."""
    prompt = 5 - PAD
    out = {0: {p: torch.equal(trainer_rows[p], sampler_outs[0][0, PAD + p]) for p in range(prompt)}}
    for s in range(1, len(sampler_outs)):
        p = prompt - 1 + s
        out[s] = {p: torch.equal(trainer_rows[p], sampler_outs[s][0, 0])}
    return out


def _q_rows(df):
    rows = df[df["module"] == Q]
    return rows[rows["kind"] == "output"]


def _check_against_oracle(df, oracle):
    """dmlib's q_proj verdict of every pass (and its differing positions) is the oracle's."""
    q = _q_rows(df).set_index("boundary")
    assert len(q) == NEW  # the prefill and each decode pass, none dropped
    for s, by_pos in oracle.items():
        name = Q if s == 0 else f"{Q}#{s}"
        assert bool(q.loc[name, "identical"]) == all(by_pos.values())
        differing = [p for p, same in by_pos.items() if not same]
        assert (q.loc[name, "diff_positions"] or []) == differing
    return q


@pytest.mark.parametrize("cache", [None, "static"])
def test_planted_decode_step_found_at_its_module_and_position(tmp_path, cache):
    model = _model(rowwise=True)
    step = 2  # the second decode pass computes position prompt + 1
    pos = 5 - PAD - 1 + step
    seq0, outs0 = _sample(model, tmp_path / "s0", cache)
    seq, outs = _sample(model, tmp_path / "s", cache, plant_step=step)
    assert torch.equal(seq0, seq)  # the plant changed no token: one trainer serves both
    rows = _train(model, tmp_path / "t", seq, block_rows=1)
    clean, planted = _oracle(rows, outs0), _oracle(rows, outs)
    assert clean[step] == {pos: True} and planted[step] == {pos: False}  # by hand
    df0 = compare_captures(tmp_path / "t", tmp_path / "s0", request="probe")
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="probe")
    _check_against_oracle(df0, clean)
    q = _check_against_oracle(df, planted)
    hit = q.loc[f"{Q}#{step}"]
    assert hit["role"] == "culprit" and hit["diff_positions"] == [pos]
    # the first row that differs with the plant and not without it is the planted one
    differs0 = set(df0["boundary"][df0["identical"].eq(False).fillna(False)])
    differs = df["boundary"][df["identical"].eq(False).fillna(False)]
    new = [b for b in differs if b not in differs0]
    assert new[0] == f"{Q}#{step}"
    assert df.attrs["status"] == "different"
    first = df.attrs["first_divergent_position"]
    assert first["boundary"] == df.attrs["first_divergent_boundary"]
    if df0.attrs["first_divergent_boundary"] is None:  # nothing else differs: the plant is first
        assert first["step"] == step and first["positions"] == [pos]
    text = str(dmlib.localize.boundaries.CaptureVerdict.of(df))
    assert f"  at {first['note']}" in text.splitlines()


def test_unplanted_follows_the_oracle_and_never_says_identical(tmp_path):
    model = _model()
    seq, outs = _sample(model, tmp_path / "s", None)
    rows = _train(model, tmp_path / "t", seq, block_rows=1)
    oracle = _oracle(rows, outs)
    df = compare_captures(tmp_path / "s", tmp_path / "t", request="probe")  # either order
    q = _q_rows(df).set_index("boundary")
    for s, by_pos in oracle.items():
        name = Q if s == 0 else f"{Q}#{s}"
        assert bool(q.loc[name, "identical"]) == all(by_pos.values())
    # the last position of the full sequence was computed by no pass of the sampler
    assert len(seq) == 5 - PAD + NEW
    last = f"position {len(seq) - 1} of request 'probe'"
    assert any(u["what"] == last for u in df.attrs["not_captured"])
    assert df.attrs["status"] != "identical"
    # the sampler's KV cache and states are listed, not dropped
    un = {u["boundary"]: u["reason"] for u in df.attrs["unjudged"]}
    cache = [n for n in un if ":input.cache." in n]
    assert cache and all("KV-cache" in un[n] for n in cache)


def test_blocks_of_many_positions_are_not_judged_per_position(tmp_path):
    model = _model()
    seq, _ = _sample(model, tmp_path / "s", None, plant_step=1)
    _train(model, tmp_path / "t", seq, block_rows=64)  # one digest for the probe's 7 rows
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="probe")
    q = _q_rows(df).set_index("boundary")
    assert q["identical"].isna().all()
    assert "block_rows=1" in q.loc[f"{Q}#1", "note"]
    assert df.attrs["status"] == "inconclusive"


def _join_sampler(model, path, plant_step, join=1, passes=5):
    """A sampler loop of its own: request A's prompt prefilled in pass 0, request B joining
    the batch at pass ``join`` and fed one prompt token per pass (its row padding before);
    each pass's (request, position) per batch row written as ``pass_rows``. Returns A's
    tokens fed and the q_proj outputs per pass; +1 ULP planted in B's row at
    ``plant_step``."""
    a, b = [5, 6, 7], [9, 8, 4, 2]
    calls, outs = [0], []

    def plant(mod, args, out):
        k = calls[0]
        calls[0] += 1
        if k != plant_step:
            return None
        out = out.clone()
        out[1, 0, 0] = torch.nextafter(out[1, 0, 0], torch.tensor(float("inf")))
        return out

    handles = [_q(model).register_forward_hook(plant)]
    handles.append(_q(model).register_forward_hook(lambda m, x, o: outs.append(o.detach().clone())))
    ids, mask = torch.tensor([a, [0, 0, 0]]), torch.tensor([[1, 1, 1], [0, 0, 0]])
    rm = [[("A", 0), ("A", 1), ("A", 2)], [None, None, None]]
    cache, fed, table = transformers.DynamicCache(config=model.config), [], {}
    try:
        with (
            torch.no_grad(),
            dmlib.capture(model, path, row_map=rm, overwrite=True, block_rows=1) as rec,
        ):
            logits = model(input_ids=ids, attention_mask=mask, cache=cache).logits
            for s in range(1, passes):
                fed.append(int(logits[0, -1].argmax()))
                tok_b = b[s - join] if join <= s < join + len(b) else 0
                mask = torch.cat([mask, torch.tensor([[1], [int(s >= join)]])], 1)
                pos = (mask.cumsum(1) - 1).clamp(min=0)[:, -1:]
                logits = model(input_ids=torch.tensor([[fed[-1]], [tok_b]]), attention_mask=mask,
                               position_ids=pos, cache=cache).logits  # fmt: skip
                table[str(s)] = [["A", 2 + s], ["B", s - join] if s >= join else None]
            rec.metadata["pass_rows"] = table
    finally:
        for h in handles:
            h.remove()
    return a + fed, b, outs


@pytest.mark.parametrize("request_id", ["B", None])
def test_a_request_joining_at_a_later_pass(tmp_path, request_id):
    model = _model(rowwise=True)
    join, step = 1, 3  # B's position 2 is computed by pass 3
    seq_a, seq_b, outs = _join_sampler(model, tmp_path / "s", plant_step=step, join=join)
    ids = torch.zeros((2, len(seq_a)), dtype=torch.long)
    ids[0], ids[1, : len(seq_b)] = torch.tensor(seq_a), torch.tensor(seq_b)
    mask = (torch.arange(len(seq_a))[None] < torch.tensor([[len(seq_a)], [len(seq_b)]])).long()
    trainer = []
    h = _q(model).register_forward_hook(lambda m, x, o: trainer.append(o.detach().clone()))
    rm = row_map_from_attention_mask(mask, ["A", "B"])
    try:
        with torch.no_grad(), dmlib.capture(model, tmp_path / "t", row_map=rm, block_rows=1):
            model(input_ids=ids, attention_mask=mask)
    finally:
        h.remove()
    t = trainer[0]
    # the oracle, by hand: per pass, per request, the rows of the positions it computed
    oracle = {0: {("A", p): torch.equal(t[0, p], outs[0][0, p]) for p in range(3)}}
    for s in range(1, len(outs)):
        oracle[s] = {("A", 2 + s): torch.equal(t[0, 2 + s], outs[s][0, 0])}
        if s >= join:
            oracle[s][("B", s - join)] = torch.equal(t[1, s - join], outs[s][1, 0])
    assert oracle[step][("B", step - join)] is False  # the plant, seen by the hooks
    df = compare_captures(tmp_path / "t", tmp_path / "s", request=request_id)
    q = _q_rows(df).set_index("boundary")
    for s, by in oracle.items():
        mine = {k: v for k, v in by.items() if request_id is None or k[0] == request_id}
        name = Q if s == 0 else f"{Q}#{s}"
        if not mine:  # B computed nothing in the prefill
            assert pd.isna(q.loc[name, "identical"])
            continue
        assert bool(q.loc[name, "identical"]) == all(mine.values())
        if request_id is not None:
            assert (q.loc[name, "diff_positions"] or []) == [
                p for (_, p), v in mine.items() if not v
            ]
    assert q.loc[f"{Q}#{step}", "identical"] == False  # noqa: E712
    assert df.attrs["status"] == "different"
    assert not [u for u in df.attrs["not_captured"] if u["what"].startswith("position")]


def test_a_prefill_alone_against_the_full_sequence(tmp_path):
    """generate(max_new_tokens=1) is one pass: its prompt's positions are compared, the
    token it chose (the full sequence's last position) is not captured."""
    model = _model()
    ids, mask = torch.tensor([[1, 2, 3, 4, 9]]), torch.ones((1, 5), dtype=torch.long)
    sampler = []
    h = _q(model).register_forward_hook(lambda m, x, o: sampler.append(o.detach().clone()))
    kw = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 1, "do_sample": False}
    try:
        with torch.no_grad():
            seq = capture_generate(model, tmp_path / "s", row_map=[[("p", i) for i in range(5)]],
                                   generate_kwargs=kw, block_rows=1)[0]  # fmt: skip
    finally:
        h.remove()
    rows = _train_alone(model, tmp_path / "t", seq)
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="p")
    q = _q_rows(df).set_index("boundary")
    equal = [torch.equal(rows[p], sampler[0][0, p]) for p in range(5)]
    assert bool(q.loc[Q, "identical"]) == all(equal)
    assert (q.loc[Q, "diff_positions"] or []) == [p for p in range(5) if not equal[p]]
    assert [u["what"] for u in df.attrs["not_captured"]] == ["position 5 of request 'p'"]
    assert df.attrs["status"] != "identical"


def _train_alone(model, path, seq):
    out = []
    h = _q(model).register_forward_hook(lambda m, x, o: out.append(o.detach().clone()))
    try:
        rm = [[("p", i) for i in range(len(seq))]]
        with torch.no_grad(), dmlib.capture(model, path, row_map=rm, block_rows=1):
            model(input_ids=seq[None])
    finally:
        h.remove()
    return out[0][0]


def test_dumped_rows_compared_by_value_with_statistics(tmp_path):
    """Blocks of 64 positions on both sides, but the q_proj rows dumped: compared by value,
    the planted element counted (one element, 1 ULP: the plant's own size)."""
    model = _model(rowwise=True)
    step, pos = 1, 5 - PAD
    dump = {"block_rows": 64, "dump": [Q + "*"]}  # its input and output, every pass
    seq, outs = _sample(model, tmp_path / "s", None, plant_step=step, **dump)
    rows = _train(model, tmp_path / "t", seq, **dump)
    oracle = _oracle(rows, outs)
    assert oracle[step] == {pos: False}
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="probe")
    q = _check_against_oracle(df, oracle)
    hit = q.loc[f"{Q}#{step}"]
    assert hit["diff_positions"] == [pos] and hit["role"] == "culprit"
    d = (rows[pos] - outs[step][0, 0]).abs()
    assert hit["n_diff"] == int((d != 0).sum()) == 1 and hit["max_ulp"] == 1
    assert hit["max_abs"] == float(d.max())


def test_a_packed_trainer_batch(tmp_path):
    """The trainer packs the probe and another sequence in one row (position ids restarting
    at 0): the probe's positions are its rows in the pack."""
    from dmlib.localize.hf import row_map_packed

    model = _model(rowwise=True)
    step = 3
    pos = 5 - PAD - 1 + step
    seq, outs = _sample(model, tmp_path / "s", None, plant_step=step)
    other = torch.tensor([3, 1, 4, 1, 5])
    ids = torch.cat([seq, other])[None]
    position_ids = torch.cat([torch.arange(len(seq)), torch.arange(len(other))])[None]
    rm = row_map_packed(position_ids=position_ids, request_ids=["probe", "other"])
    trainer = []
    h = _q(model).register_forward_hook(lambda m, x, o: trainer.append(o.detach().clone()))
    try:
        with torch.no_grad(), dmlib.capture(model, tmp_path / "t", row_map=rm, block_rows=1):
            model(input_ids=ids, position_ids=position_ids)
    finally:
        h.remove()
    oracle = _oracle(trainer[0][0, : len(seq)], outs)
    assert oracle[step] == {pos: False}
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="probe")
    q = _check_against_oracle(df, oracle)
    assert q.loc[f"{Q}#{step}", "diff_positions"] == [pos]
    assert df.attrs["status"] == "different"


def test_the_command_line_names_the_position(tmp_path, capsys):
    from dmlib.cli import main

    model = _model(rowwise=True)
    seq, outs = _sample(model, tmp_path / "sampler", None, plant_step=2)
    rows = _train(model, tmp_path / "trainer", seq, block_rows=1)
    oracle = _oracle(rows, outs)
    argv = ["localize", str(tmp_path / "trainer"), str(tmp_path / "sampler"), "--request", "probe",
            "--limit", "0"]  # fmt: skip
    assert main(argv) == 1  # different (it exited 2 on the lengths before)
    out = capsys.readouterr().out
    df = compare_captures(tmp_path / "trainer", tmp_path / "sampler", request="probe")
    first = df.attrs["first_divergent_position"]
    assert f"first divergent boundary: {first['boundary']}\n  at {first['note']}\n" in out
    assert oracle[2] == {4: False}
    assert f"{Q}#2 " in out  # the planted pass's q_proj, a differing row, is in the table


def _generate_two(model, path, eos, plant_step):
    """generate() over A (5 prompt tokens) and B (3, left-padded by 2) with ``eos`` as the
    end-of-sequence token; +1 ULP planted in B's row (batch row 1) of q_proj's output at
    pass ``plant_step``. Returns the output and the q_proj outputs per pass (hooks)."""
    ids = torch.tensor([[1, 2, 3, 4, 9], [0, 0, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    calls, outs = [0], []

    def plant(mod, args, out):
        calls[0] += 1
        if calls[0] - 1 != plant_step:
            return None
        out = out.clone()
        out[1, -1, 0] = torch.nextafter(out[1, -1, 0], torch.tensor(float("inf")))
        return out

    handles = [_q(model).register_forward_hook(plant)]
    handles.append(_q(model).register_forward_hook(lambda m, a, o: outs.append(o.detach().clone())))
    kw = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 5, "do_sample": False,
          "pad_token_id": 0, "eos_token_id": eos}  # fmt: skip
    rm = row_map_from_attention_mask(mask, ["A", "B"])
    try:
        with torch.no_grad():
            seq = capture_generate(model, path, row_map=rm, generate_kwargs=kw, block_rows=1)
    finally:
        for h in handles:
            h.remove()
    return seq, outs


def test_generate_writes_pass_rows_and_a_planted_step_of_the_second_request(tmp_path):
    """capture_generate names each pass's rows (left padding counted out, a finished row
    None); the trainer's full forward of each final sequence against it finds +1 ULP
    planted in B's row of one decode pass at B's position, as plain hooks see it."""
    from dmlib.localize.capture.reader import open_capture

    model = _model(rowwise=True)
    with torch.no_grad():  # A's first generated token, made its end of sequence
        probe = model.generate(input_ids=torch.tensor([[1, 2, 3, 4, 9]]), max_new_tokens=1,
                               do_sample=False, pad_token_id=0)  # fmt: skip
    eos = int(probe[0, -1])
    step = 2  # B (prompt positions 0-2) computes position 2 + 2 = 4 in decode pass 2
    out, outs = _generate_two(model, tmp_path / "s", eos, plant_step=step)
    gen_a, gen_b = out[0, 5:].tolist(), out[1, 5:].tolist()
    assert gen_a[0] == eos and eos not in gen_b  # A finished at once, B ran all 5 passes
    assert len(outs) == 5
    # by hand: pass 0 holds A's position 4 and B's 2 in its last column; pass s feeds the
    # token pass s - 1 chose: A's position 4 + s, B's 2 + s; A after its EOS was fed: None
    expected = {"0": [["A", 4], ["B", 2]], "1": [["A", 5], ["B", 3]], "2": [None, ["B", 4]],
                "3": [None, ["B", 5]], "4": [None, ["B", 6]]}  # fmt: skip
    assert open_capture(tmp_path / "s").metadata["pass_rows"] == expected
    # the trainer: each final sequence (A up to its EOS) in a right-padded batch, no cache
    seq_a, seq_b = out[0, :6], out[1, 2:]
    ids = torch.zeros((2, 8), dtype=torch.long)
    ids[0, :6], ids[1] = seq_a, seq_b
    mask = (torch.arange(8)[None] < torch.tensor([[6], [8]])).long()
    trainer = []
    h = _q(model).register_forward_hook(lambda m, x, o: trainer.append(o.detach().clone()))
    rm = row_map_from_attention_mask(mask, ["A", "B"])
    try:
        with torch.no_grad(), dmlib.capture(model, tmp_path / "t", row_map=rm, block_rows=1):
            model(input_ids=ids, attention_mask=mask)
    finally:
        h.remove()
    t = trainer[0]
    # the oracle: B's trainer row at each position against the sampler row that computed it
    oracle = {0: {p: torch.equal(t[1, p], outs[0][1, 2 + p]) for p in range(3)}}
    for s in range(1, 5):
        oracle[s] = {2 + s: torch.equal(t[1, 2 + s], outs[s][1, 0])}
    assert oracle[step] == {4: False}  # the plant, seen by the hooks
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="B")
    q = _q_rows(df).set_index("boundary")
    for s, by in oracle.items():
        name = Q if s == 0 else f"{Q}#{s}"
        assert bool(q.loc[name, "identical"]) == all(by.values())
        assert (q.loc[name, "diff_positions"] or []) == [p for p, v in by.items() if not v]
    assert q.loc[f"{Q}#{step}", "role"] == "culprit"
    assert df.attrs["status"] == "different"
    # B's last token was never fed: its position 7 is not captured, and nothing else
    left = [u["what"] for u in df.attrs["not_captured"] if u["what"].startswith("position")]
    assert left == ["position 7 of request 'B'"]
    # A: its 6 positions all computed (prefill, pass 1); passes after its EOS are not its
    da = compare_captures(tmp_path / "t", tmp_path / "s", request="A")
    qa = _q_rows(da).set_index("boundary")
    same_a = [torch.equal(t[0, p], outs[0][0, p]) for p in range(5)]
    assert bool(qa.loc[Q, "identical"]) == all(same_a)
    assert bool(qa.loc[f"{Q}#1", "identical"]) == torch.equal(t[0, 5], outs[1][0, 0])
    for s in (2, 3, 4):
        assert pd.isna(qa.loc[f"{Q}#{s}", "identical"])
        assert "no compared request computed" in qa.loc[f"{Q}#{s}", "note"]
    assert not [u for u in da.attrs["not_captured"] if u["what"].startswith("position")]


def _two_per_pass(model, path, plant, dump=True, block_rows=1):
    """A loop of one's own: A's prompt (3 positions) prefilled, then two tokens per pass
    against a DynamicCache (as a speculative verification does), ``pass_rows`` naming both
    positions of each pass; +1 ULP planted in q_proj's output at (pass, column) ``plant``.
    Returns the full sequence and the q_proj outputs per pass (hooks)."""
    seq = [5, 6, 7, 9, 8, 4, 2]
    calls, outs = [0], []

    def hook(mod, args, out):
        calls[0] += 1
        if calls[0] - 1 != plant[0]:
            return None
        out = out.clone()
        out[0, plant[1], 0] = torch.nextafter(out[0, plant[1], 0], torch.tensor(float("inf")))
        return out

    handles = [_q(model).register_forward_hook(hook)]
    handles.append(_q(model).register_forward_hook(lambda m, a, o: outs.append(o.detach().clone())))
    cache = transformers.DynamicCache(config=model.config)
    kw = {"block_rows": block_rows, "overwrite": True, **({"dump": [Q + "*"]} if dump else {})}
    try:
        with torch.no_grad(), dmlib.capture(model, path, row_map=[[("A", p) for p in range(3)]],
                                            **kw) as rec:  # fmt: skip
            model(input_ids=torch.tensor([seq[:3]]), cache=cache)
            for start in (3, 5):
                pos = torch.arange(start, start + 2)[None]
                model(input_ids=torch.tensor([seq[start : start + 2]]), position_ids=pos,
                      attention_mask=torch.ones((1, start + 2), dtype=torch.long), cache=cache)  # fmt: skip
            rec.metadata["pass_rows"] = {"1": [[["A", 3], ["A", 4]]], "2": [[["A", 5], ["A", 6]]]}
    finally:
        for h in handles:
            h.remove()
    return torch.tensor(seq), outs


def test_two_positions_of_one_request_in_a_pass_judged_each(tmp_path):
    model = _model(rowwise=True)
    seq, outs = _two_per_pass(model, tmp_path / "s", plant=(2, 1))  # pass 2's second column
    dump = {"block_rows": 1, "dump": [Q + "*"]}
    trainer = []
    h = _q(model).register_forward_hook(lambda m, x, o: trainer.append(o.detach().clone()))
    rm = [[("A", p) for p in range(len(seq))]]
    try:
        with torch.no_grad(), dmlib.capture(model, tmp_path / "t", row_map=rm, **dump):
            model(input_ids=seq[None])
    finally:
        h.remove()
    t = trainer[0][0]
    # the oracle, by hand: pass 0 computed positions 0-2; pass s, column c: position 1 + 2s + c
    oracle = {0: {p: torch.equal(t[p], outs[0][0, p]) for p in range(3)}}
    for s in (1, 2):
        oracle[s] = {1 + 2 * s + c: torch.equal(t[1 + 2 * s + c], outs[s][0, c]) for c in (0, 1)}
    assert oracle[2][6] is False  # the plant, seen by the hooks
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="A")
    q = _q_rows(df).set_index("boundary")
    assert len(q) == 3
    for s, by in oracle.items():
        name = Q if s == 0 else f"{Q}#{s}"
        assert bool(q.loc[name, "identical"]) == all(by.values())
        assert (q.loc[name, "diff_positions"] or []) == [p for p, v in by.items() if not v]
    hit = q.loc[f"{Q}#2"]
    assert hit["role"] == "culprit" and "decode step 2" in hit["note"]
    d = (t[6] - outs[2][0, 1]).abs()
    assert hit["n_diff"] == int((d != 0).sum()) == 1 and hit["max_ulp"] == 1
    assert df.attrs["status"] == "different"
    assert not [u for u in df.attrs["not_captured"] if u["what"].startswith("position")]


def test_two_positions_in_a_pass_without_dumps_are_not_judged(tmp_path):
    """Passes captured with blocks of 64 positions: a batch row's digest covers both its
    columns, and without values no position is judged (with block_rows=1 each column has
    its own digest: tests/test_localize_positions_columns.py)."""
    model = _model(rowwise=True)
    seq, _ = _two_per_pass(model, tmp_path / "s", plant=(2, 1), dump=False, block_rows=64)
    rm = [[("A", p) for p in range(len(seq))]]
    with torch.no_grad(), dmlib.capture(model, tmp_path / "t", row_map=rm, block_rows=1):
        model(input_ids=seq[None])
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="A")
    q = _q_rows(df).set_index("boundary")
    for s in (1, 2):
        assert pd.isna(q.loc[f"{Q}#{s}", "identical"])
        assert "one digest covers a batch row's columns" in q.loc[f"{Q}#{s}", "note"]
    assert df.attrs["status"] != "identical"
