"""A capture says what it did not see, and a comparison is never "identical" about it.

Tiny random-init Llama from its config. The differences are planted (a forward hook adds
one ULP to one logit in one run), never left to this CPU; the oracle is the model's own
output compared with ``torch.equal``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dmlib.cli._common import EXIT_INCONCLUSIVE, exit_code  # noqa: E402
from dmlib.localize.boundaries import CaptureVerdict, compare_captures  # noqa: E402
from dmlib.localize.capture import capture, open_capture  # noqa: E402
from dmlib.localize.hf import capture_generate, row_map_from_attention_mask  # noqa: E402

VOCAB = 64


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=0)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def one_ulp_logit(model):
    """A hook on lm_head adding 1 ULP to logit [0, -1, 5] (the next token's): a difference
    in the logits that nothing before lm_head shows."""

    def hook(mod, args, out):
        out = out.clone()
        x = out[0, -1, 5]
        out[0, -1, 5] = torch.nextafter(x, torch.tensor(float("inf"), dtype=x.dtype))
        return out

    return model.lm_head.register_forward_hook(hook)


def test_backbone_only_generate_is_not_identical_when_logits_differ(tmp_path):
    model = llama()
    ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    rows = row_map_from_attention_mask(torch.ones(1, 7), ["p"])
    kw = {"input_ids": ids, "max_new_tokens": 1, "do_sample": False,
          "return_dict_in_generate": True, "output_logits": True}  # fmt: skip
    outs = []
    for name, plant in (("a", False), ("b", True)):
        h = one_ulp_logit(model) if plant else None
        outs.append(capture_generate(model, tmp_path / name, row_map=rows, generate_kwargs=kw,
                                     modules=["model", "model.*"]))  # fmt: skip
        if h is not None:
            h.remove()
    # the oracle: the next-token logits differ (planted), by the model's own output
    assert not torch.equal(outs[0].logits[0], outs[1].logits[0])
    for side in ("a", "b"):
        c = open_capture(tmp_path / side)
        assert c.coverage["root_hooked"] is False
        assert any("logits" in u["what"] for u in c.not_captured)
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    v = CaptureVerdict.of(df)
    assert v.status == "inconclusive" and not v
    assert df.attrs["first_divergent_boundary"] is None
    assert any("logits" in u["what"] for u in df.attrs["not_captured"])
    assert df.attrs["identical_up_to"] is not None
    assert exit_code(v) == EXIT_INCONCLUSIVE
    assert "not captured" in str(v) and "logits" in str(v)


def test_root_hooked_sees_the_logits_differ(tmp_path):
    model = llama()
    ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    outs = []
    for name, plant in (("a", False), ("b", True)):
        h = one_ulp_logit(model) if plant else None
        with torch.no_grad(), capture(model, tmp_path / name, modules=["", "model", "model.*"]):
            outs.append(model(input_ids=ids, use_cache=False).logits)
        if h is not None:
            h.remove()
    assert not torch.equal(outs[0], outs[1])
    assert open_capture(tmp_path / "a").not_captured == []
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    v = CaptureVerdict.of(df)
    assert v.status == "different"
    # the logits are the model's own output: it differs, but the model is never the culprit
    root = open_capture(tmp_path / "a").root
    row = df.set_index("boundary").loc[df.attrs["first_divergent_boundary"]]
    assert row["module"] == root
    assert root not in [df.set_index("boundary").loc[c, "module"] for c in v.culprits]
    assert row["role"] == "undetermined"
    assert "never the culprit" in row["note"]
    assert "no culprit claimed there" in str(v)


def test_default_modules_capture_the_logits_through_lm_head(tmp_path):
    """With the default modules lm_head is hooked: the logits it returns are the model's
    own output tensor, so nothing is missing though the root was not hooked."""
    model = llama()
    ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), capture(model, tmp_path / "a"):
        model(input_ids=ids, use_cache=False)
    c = open_capture(tmp_path / "a")
    assert c.coverage["root_hooked"] is False
    assert c.not_captured == []


def test_positional_and_keyword_inputs_pair_by_parameter_name(tmp_path):
    model = llama()
    ids = torch.randint(1, VOCAB, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with capture(model, tmp_path / "a", modules=["", "lm_head"]):
            model(ids, use_cache=False)
        with capture(model, tmp_path / "b", modules=["", "lm_head"]):
            model(input_ids=ids, use_cache=False)
    a, b = open_capture(tmp_path / "a"), open_capture(tmp_path / "b")
    root = a.root
    assert f"{root}:input0" in a and f"{root}:input.input_ids" in b
    assert a.arg_names[root][0] == "input_ids"  # inspect.signature(model.forward)
    df = compare_captures(a, b).set_index("boundary")
    assert bool(df.loc[f"{root}:input0", "identical"]) is True
    assert not [u for u in df.attrs["unjudged"] if "input" in u["boundary"]]
    assert df.attrs["status"] == "identical"
    # the other way round, too
    df2 = compare_captures(b, a).set_index("boundary")
    assert bool(df2.loc[f"{root}:input.input_ids", "identical"]) is True
    assert df2.attrs["status"] == "identical"
