"""capture_generate's ``pass_rows`` when a sequence is ended by something other than an
end-of-sequence id: a stop string (``generate(stop_strings=..., tokenizer=...)``) or a
custom StoppingCriteria. The end is what generate() itself decided; the rows after it are
None from the right pass, so a trainer's full forward of each final sequence is paired
with the passes that really computed its positions.

The tokenizer is built here, offline (a tokenizers WordLevel model over 62 one-character
tokens). The expected tables are worked out by hand from the tokens a plain generate()
chose; the oracle of the planted difference is plain torch forward hooks on layer 0's
q_proj, compared with torch.equal (+1 ULP through torch.nextafter in one decode pass).
"""

from __future__ import annotations

import string

import pandas as pd
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import dmlib  # noqa: E402
from dmlib.localize.boundaries import compare_captures  # noqa: E402
from dmlib.localize.capture.reader import open_capture  # noqa: E402
from dmlib.localize.hf import capture_generate, row_map_from_attention_mask  # noqa: E402

Q = "model.layers.0.self_attn.q_proj"
IDS = [[1, 2, 3, 4, 9], [0, 0, 5, 6, 7]]  # A: 5 prompt positions; B: 3, left-padded by 2
MASK = [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
NEW = 6  # generated tokens: the prefill, then 5 decode passes


def _tokenizer():
    chars = string.ascii_lowercase + string.ascii_uppercase + string.digits
    vocab = {"[PAD]": 0, "[UNK]": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
    tok.decoder = tokenizers.decoders.Fuse()  # "a", "b" -> "ab"
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]"
    )


def _model():
    """A tiny random Qwen2 (no end-of-sequence id configured) whose layer-0 q_proj computes
    each row by its own call, so that a row's value does not depend on the batch."""
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


def _kwargs(**more):
    return {"input_ids": torch.tensor(IDS), "attention_mask": torch.tensor(MASK),
            "max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0, **more}  # fmt: skip


def _plain(model):
    """The tokens a plain generate() (no capture, no stop) chooses per row."""
    with torch.no_grad():
        return model.generate(**_kwargs())[:, 5:].tolist()


def _generate(model, path, plant_step=None, **more):
    """capture_generate with +1 ULP planted in B's row (batch row 1) of q_proj's output at
    pass ``plant_step``; returns the output and the q_proj outputs per pass (hooks)."""
    calls, outs = [0], []

    def plant(mod, args, out):
        calls[0] += 1
        if calls[0] - 1 != plant_step:
            return None
        out = out.clone()
        out[1, -1, 0] = torch.nextafter(out[1, -1, 0], torch.tensor(float("inf")))
        return out

    q = model.model.layers[0].self_attn.q_proj
    handles = [q.register_forward_hook(plant)]
    handles.append(q.register_forward_hook(lambda m, a, o: outs.append(o.detach().clone())))
    rm = row_map_from_attention_mask(torch.tensor(MASK), ["A", "B"])
    try:
        with torch.no_grad():
            out = capture_generate(model, path, row_map=rm, generate_kwargs=_kwargs(**more),
                                   block_rows=1)  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    return out, outs


def _expected(a_ends_at):
    """pass_rows by hand: pass 0 holds A's position 4 and B's 2 in its last column; pass s
    feeds the token pass s - 1 chose (A's position 4 + s, B's 2 + s); A's sequence ends
    on the token pass ``a_ends_at`` chose, fed by pass a_ends_at + 1: None after that."""
    table = {"0": [["A", 4], ["B", 2]]}
    for s in range(1, NEW):
        table[str(s)] = [["A", 4 + s] if s <= a_ends_at + 1 else None, ["B", 2 + s]]
    return table


def _stop_on(tok, gen_a, gen_b):
    """A's generated index k and a one-character stop string ending A there alone."""
    names_a, names_b = tok.convert_ids_to_tokens(gen_a), tok.convert_ids_to_tokens(gen_b)
    for k in range(1, NEW - 2):  # a pass in the middle: rows before and after it
        if names_a[k] not in names_a[:k] and names_a[k] not in names_b:
            return k, names_a[k]
    pytest.skip("no token of A's completion is absent from B's (a different random model)")


def test_a_stop_string_ends_one_row_from_the_right_pass(tmp_path):
    model, tok = _model(), _tokenizer()
    gen_a, gen_b = _plain(model)
    k, stop = _stop_on(tok, gen_a, gen_b)
    step = k + 3  # a decode pass after A ended: B's position 2 + step
    out, outs = _generate(model, tmp_path / "s", step, stop_strings=[stop], tokenizer=tok)
    assert out[:, 5:].tolist()[1] == gen_b  # B ran all its passes, its tokens unchanged
    assert out[0, 5 : 5 + k + 1].tolist() == gen_a[: k + 1]  # A up to the stop
    assert len(outs) == NEW
    meta = open_capture(tmp_path / "s").metadata
    assert meta["pass_rows"] == _expected(k)
    assert meta["generate"]["lengths"] == {"A": k + 1, "B": NEW}  # A's tokens 0..k
    # the trainer: each final sequence (A up to its stop) in a right-padded batch, no cache
    len_a, len_b = 5 + k + 1, 3 + NEW
    ids = torch.zeros((2, len_b), dtype=torch.long)
    ids[0, :len_a], ids[1] = out[0, :len_a], out[1, 2:]
    mask = (torch.arange(len_b)[None] < torch.tensor([[len_a], [len_b]])).long()
    trainer = []
    q = model.model.layers[0].self_attn.q_proj
    h = q.register_forward_hook(lambda m, x, o: trainer.append(o.detach().clone()))
    rm = row_map_from_attention_mask(mask, ["A", "B"])
    try:
        with torch.no_grad(), dmlib.capture(model, tmp_path / "t", row_map=rm, block_rows=1):
            model(input_ids=ids, attention_mask=mask)
    finally:
        h.remove()
    t = trainer[0]
    # B: its trainer row at each position against the sampler row that computed it
    oracle = {0: {p: torch.equal(t[1, p], outs[0][1, 2 + p]) for p in range(3)}}
    for s in range(1, NEW):
        oracle[s] = {2 + s: torch.equal(t[1, 2 + s], outs[s][1, 0])}
    assert oracle[step] == {2 + step: False}  # the plant, seen by the hooks
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="B")
    qb = df[(df["module"] == Q) & (df["kind"] == "output")].set_index("boundary")
    for s, by in oracle.items():
        row = qb.loc[Q if s == 0 else f"{Q}#{s}"]
        assert bool(row["identical"]) == all(by.values())
        assert (row["diff_positions"] or []) == [p for p, v in by.items() if not v]
    assert qb.loc[f"{Q}#{step}", "diff_positions"] == [2 + step]
    assert df.attrs["status"] == "different"
    # A: every position of its sequence computed by some pass, none after its end paired
    da = compare_captures(tmp_path / "t", tmp_path / "s", request="A")
    qa = da[(da["module"] == Q) & (da["kind"] == "output")].set_index("boundary")
    assert not [u for u in da.attrs["not_captured"] if u["what"].startswith("position")]
    assert bool(qa.loc[f"{Q}#{k + 1}", "identical"]) == torch.equal(
        t[0, 4 + k + 1], outs[k + 1][0, 0]
    )
    for s in range(k + 2, NEW):
        assert pd.isna(qa.loc[f"{Q}#{s}", "identical"])
        assert "no compared request computed" in qa.loc[f"{Q}#{s}", "note"]


class _EndRowAfter(transformers.StoppingCriteria):
    """Ends batch row ``row`` once ``n`` tokens were generated for it (by length alone:
    neither an end-of-sequence id nor a pad is looked at)."""

    def __init__(self, row, n, prompt):
        self.row, self.n, self.prompt = row, n, prompt

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[self.row] = input_ids.shape[1] - self.prompt >= self.n
        return done


@pytest.mark.parametrize("n", [1, 3])
def test_a_custom_stopping_criterion(tmp_path, n):
    """Row 0 (A) ended after its n-th token by a criterion of one's own: its rows are None
    from pass n + 1 on, B's named in every pass; no other end is read from the tokens."""
    model = _model()
    crit = transformers.StoppingCriteriaList([_EndRowAfter(0, n, 5)])
    out, _ = _generate(model, tmp_path / "s", None, stopping_criteria=crit)
    assert out.shape[1] == 5 + NEW  # B went on to max_new_tokens
    meta = open_capture(tmp_path / "s").metadata
    assert meta["pass_rows"] == _expected(n - 1)
    assert meta["generate"]["lengths"] == {"A": n, "B": NEW}


def test_the_criteria_are_restored_after_the_capture(tmp_path):
    """The observation is undone: the model builds generate()'s criteria as before."""
    model = _model()
    before = type(model)._get_stopping_criteria
    assert "_get_stopping_criteria" not in model.__dict__
    _generate(model, tmp_path / "s", None)
    assert "_get_stopping_criteria" not in model.__dict__
    assert type(model)._get_stopping_criteria is before
    assert all("_get_stopping_criteria" not in m.__dict__ for m in model.modules())
    # without any stop but max_new_tokens, both rows are named in every pass
    meta = open_capture(tmp_path / "s").metadata
    assert meta["pass_rows"] == _expected(NEW)
    assert meta["generate"]["lengths"] == {"A": NEW, "B": NEW}  # max_new_tokens ended both
