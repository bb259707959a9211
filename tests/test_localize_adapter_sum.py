"""A LoRA layer's own output (its base layer's output plus ``scaling * B(A(x))``, summed in
the wrapper's forward, outside every leaf module) is hooked by default: a difference entering
at that sum is found there, not a block later. Tiny random-init Qwen2 with a PEFT LoRA on
q/k/v/o; the difference is planted (+1 ULP in one element of q_proj's sum, through a forward
hook in one run), the oracle is the plant itself and plain hooks on the wrapper's children."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import dmlib  # noqa: E402
from dmlib.localize.boundaries import compare_captures  # noqa: E402
from dmlib.localize.capture.tensors import default_modules  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")

Q = "base_model.model.model.layers.0.self_attn.q_proj"


def _model():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    m = peft.get_peft_model(transformers.Qwen2ForCausalLM(cfg).eval(), lora)
    with torch.no_grad():  # B is zero at init: give it values, so the sum is a real one
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return m.eval()


def _capture(m, path, plant):
    handle = None
    if plant:

        def hook(mod, args, out):
            out = out.clone()
            out[0, 1, 3] = torch.nextafter(out[0, 1, 3], torch.tensor(np.inf))
            return out

        handle = m.get_submodule(Q).register_forward_hook(hook)
    try:
        with torch.no_grad(), dmlib.capture(m, path, overwrite=True,
                                            row_map=[[("p", j) for j in range(4)]]):  # fmt: skip
            m(input_ids=torch.tensor([[3, 5, 7, 9]]))
    finally:
        if handle is not None:
            handle.remove()


def test_the_lora_wrapper_is_hooked_by_default():
    m = _model()
    chosen = default_modules(m)
    assert Q in chosen and f"{Q}.base_layer" in chosen and f"{Q}.lora_B.default" in chosen
    # a plain module with children (the attention block) is still not hooked by this rule
    assert "base_model.model.model.layers.0.self_attn" not in chosen


def test_a_difference_entering_at_the_adapter_sum_is_found_there(tmp_path):
    m = _model()
    _capture(m, tmp_path / "a", plant=False)
    _capture(m, tmp_path / "b", plant=True)
    df = compare_captures(tmp_path / "a", tmp_path / "b", request="p")
    same = dict(zip(df["boundary"], df["identical"], strict=True))
    # the wrapper's children computed the same (the plant is after them), its sum differs
    assert same[f"{Q}.base_layer"] == True  # noqa: E712
    assert same[f"{Q}.lora_B.default"] == True  # noqa: E712
    assert same[Q] == False  # noqa: E712
    assert df.attrs["first_divergent_boundary"] == Q
    assert df.attrs["culprit"] == Q
