"""Tiny GPT-2 and Llama state dicts with their hand-written conversions and mappings: the
models the mapping tests compare across layouts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dmlib.mapping import Mapping
from dmlib.mapping.spec import loads

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

D, LAYERS = 16, 2

GPT2_MAP = """
version = 1

[[rule]]
source = "transformer.wte.weight"
target = ["embed.weight", "lm_head.weight"]
transforms = [{ op = "tie", copies = 2 }]

[[rule]]
source = "transformer.wpe.weight"
target = "pos.weight"

[[rule]]
source = "transformer.h.{i}.ln_{n}.{p:w}"
target = "blocks.{i}.norm{n}.{p}"

[[rule]]
source = "transformer.h.{i}.attn.c_attn.weight"
target = ["blocks.{i}.attn.q.weight", "blocks.{i}.attn.k.weight", "blocks.{i}.attn.v.weight"]
transforms = [{ op = "transpose" }, { op = "split", axis = 0, parts = 3 }]

[[rule]]
source = "transformer.h.{i}.attn.c_attn.bias"
target = ["blocks.{i}.attn.q.bias", "blocks.{i}.attn.k.bias", "blocks.{i}.attn.v.bias"]
transforms = [{ op = "split", axis = 0, parts = 3 }]

[[rule]]
source = ["transformer.h.{i}.attn.c_proj.weight", "transformer.h.{i}.mlp.c_fc.weight", "transformer.h.{i}.mlp.c_proj.weight"]
target = ["blocks.{i}.attn.c_proj.weight", "blocks.{i}.mlp.c_fc.weight", "blocks.{i}.mlp.c_proj.weight"]
transforms = [{ op = "transpose" }]

[[rule]]
source = ["transformer.h.{i}.attn.c_proj.bias", "transformer.h.{i}.mlp.c_fc.bias", "transformer.h.{i}.mlp.c_proj.bias"]
target = ["blocks.{i}.attn.c_proj.bias", "blocks.{i}.mlp.c_fc.bias", "blocks.{i}.mlp.c_proj.bias"]

[[rule]]
source = "transformer.ln_f.{p:w}"
target = "final_norm.{p}"
"""


def gpt2_state() -> dict[str, np.ndarray]:
    """A tiny GPT-2 from its config, every parameter drawn at random (all values distinct)."""
    cfg = transformers.GPT2Config(
        n_layer=LAYERS, n_embd=D, n_head=2, vocab_size=50, n_positions=8, bos_token_id=0,
        eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    assert np.array_equal(sd.pop("lm_head.weight"), sd["transformer.wte.weight"])  # tied
    return sd


def gpt2_converted(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GPT-2 as separate q/k/v Linear weights ([out, in]), by hand."""
    out = {
        "embed.weight": sd["transformer.wte.weight"].copy(),
        "lm_head.weight": sd["transformer.wte.weight"].copy(),
        "pos.weight": sd["transformer.wpe.weight"].copy(),
        "final_norm.weight": sd["transformer.ln_f.weight"].copy(),
        "final_norm.bias": sd["transformer.ln_f.bias"].copy(),
    }
    for i in range(LAYERS):
        h = f"transformer.h.{i}."
        w = sd[h + "attn.c_attn.weight"]  # Conv1D: [in, 3 * out]
        bias = sd[h + "attn.c_attn.bias"]
        for j, name in enumerate("qkv"):
            out[f"blocks.{i}.attn.{name}.weight"] = np.ascontiguousarray(
                w[:, j * D : (j + 1) * D].T
            )
            out[f"blocks.{i}.attn.{name}.bias"] = bias[j * D : (j + 1) * D].copy()
        for part in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            out[f"blocks.{i}.{part}.weight"] = np.ascontiguousarray(sd[h + part + ".weight"].T)
            out[f"blocks.{i}.{part}.bias"] = sd[h + part + ".bias"].copy()
        for n in (1, 2):
            for p in ("weight", "bias"):
                out[f"blocks.{i}.norm{n}.{p}"] = sd[f"{h}ln_{n}.{p}"].copy()
    return out


def _map(text: str) -> Mapping:
    return loads(text)


HEADS, KV_HEADS = 4, 2


def llama_hf() -> dict[str, np.ndarray]:
    return tiny_llama(D, HEADS, KV_HEADS, LAYERS, intermediate=32, vocab=40, seed=1)


def tiny_llama(
    hidden: int,
    heads: int,
    kv_heads: int,
    layers: int,
    *,
    intermediate: int,
    vocab: int,
    seed: int,
) -> dict[str, np.ndarray]:
    """A tiny LlamaForCausalLM from its config, every parameter drawn at random (seeded)."""
    cfg = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def hf_to_meta_by_loops(w: np.ndarray, heads: int) -> np.ndarray:
    """Meta row h*d + 2m + r holds HF row h*d + r*d/2 + m (explicit loops, no reshape)."""
    d = w.shape[0] // heads
    out = np.empty_like(w)
    for h in range(heads):
        for m in range(d // 2):
            for r in range(2):
                out[h * d + 2 * m + r] = w[h * d + r * (d // 2) + m]
    return out


def llama_meta(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The Meta checkpoint's names and rotary layout (as in Meta's consolidated.00.pth)."""
    out = {
        "tok_embeddings.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
        "output.weight": hf["lm_head.weight"],
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[f"layers.{i}.attention.wq.weight"] = hf_to_meta_by_loops(
            hf[p + "self_attn.q_proj.weight"], HEADS
        )
        out[f"layers.{i}.attention.wk.weight"] = hf_to_meta_by_loops(
            hf[p + "self_attn.k_proj.weight"], KV_HEADS
        )
        out[f"layers.{i}.attention.wv.weight"] = hf[p + "self_attn.v_proj.weight"]
        out[f"layers.{i}.attention.wo.weight"] = hf[p + "self_attn.o_proj.weight"]
        out[f"layers.{i}.feed_forward.w1.weight"] = hf[p + "mlp.gate_proj.weight"]
        out[f"layers.{i}.feed_forward.w3.weight"] = hf[p + "mlp.up_proj.weight"]
        out[f"layers.{i}.feed_forward.w2.weight"] = hf[p + "mlp.down_proj.weight"]
        out[f"layers.{i}.attention_norm.weight"] = hf[p + "input_layernorm.weight"]
        out[f"layers.{i}.ffn_norm.weight"] = hf[p + "post_attention_layernorm.weight"]
    return out


LLAMA_MAP = f"""
[[rule]]
source = "tok_embeddings.weight"
target = "model.embed_tokens.weight"
[[rule]]
source = "norm.weight"
target = "model.norm.weight"
[[rule]]
source = "output.weight"
target = "lm_head.weight"
[[rule]]
source = "layers.{{i}}.attention.wq.weight"
target = "model.layers.{{i}}.self_attn.q_proj.weight"
transforms = [{{ op = "rotary", heads = {HEADS}, to = "hf" }}]
[[rule]]
source = "layers.{{i}}.attention.wk.weight"
target = "model.layers.{{i}}.self_attn.k_proj.weight"
transforms = [{{ op = "rotary", heads = {KV_HEADS}, to = "hf" }}]
[[rule]]
source = "layers.{{i}}.attention.wv.weight"
target = "model.layers.{{i}}.self_attn.v_proj.weight"
[[rule]]
source = "layers.{{i}}.attention.wo.weight"
target = "model.layers.{{i}}.self_attn.o_proj.weight"
[[rule]]
source = ["layers.{{i}}.feed_forward.w1.weight", "layers.{{i}}.feed_forward.w3.weight", "layers.{{i}}.feed_forward.w2.weight"]
target = ["model.layers.{{i}}.mlp.gate_proj.weight", "model.layers.{{i}}.mlp.up_proj.weight", "model.layers.{{i}}.mlp.down_proj.weight"]
[[rule]]
source = "layers.{{i}}.attention_norm.weight"
target = "model.layers.{{i}}.input_layernorm.weight"
[[rule]]
source = "layers.{{i}}.ffn_norm.weight"
target = "model.layers.{{i}}.post_attention_layernorm.weight"
"""


FIXTURES = Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "jax" / "reference"
