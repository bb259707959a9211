"""KV caches entering a module: a tiny Llama's StaticCache under generate(), and legacy
tuples of past (key, value) tensors, hashed per request.

Oracle: plain forward pre-hooks of our own cloning the cache tensors when the hook runs;
a request's cache rows are its positions (prompt, then generated tokens) in order, each
position's heads x head_dim, hashed with the ``xxhash`` package (XXH3-128, the default
scheme). The installed
transformers passes only ``Cache`` objects to Llama (no tuples), so legacy tuples are
tested on a small module of our own that takes them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from _support.tree import leaf  # noqa: E402
from torch import nn  # noqa: E402

import dmlib  # noqa: E402
from dmlib.localize.hf import capture_generate, row_map_from_attention_mask  # noqa: E402

N_PROBE, N_OTHER = 6, 9


def _b3(x) -> str:
    return leaf(x, "xxh3")


def _llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64,
                                   attn_implementation="sdpa", pad_token_id=0)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def _request_rows(keys: np.ndarray, batch_row: int, slots: list[int]) -> np.ndarray:
    """(positions, heads, head_dim) of one batch row's slots, in position order."""
    return np.ascontiguousarray(np.moveaxis(keys[batch_row][:, slots, :], 1, 0))


def _oracle_static(model, gen_kwargs):
    """Per decode step (from 1): layer-0 block's cache, each layer's filled keys/values."""
    seen: list[dict[str, Any]] = []

    def pre(mod, args, kwargs):
        name = "past_key_values" if "past_key_values" in kwargs else "cache"
        cache = kwargs[name]
        got = {"kwarg": name}
        for i, layer in enumerate(cache.layers):
            n = int(layer.get_seq_length()) if layer.is_initialized else 0
            for part in ("keys", "values"):
                if n:
                    got[f"{i}.{part}"] = getattr(layer, part)[:, :, :n].detach().clone().numpy()
        seen.append(got)

    h = model.model.layers[0].register_forward_pre_hook(pre, with_kwargs=True)
    with torch.no_grad():
        out = model.generate(**gen_kwargs)
    h.remove()
    return seen, out


def test_static_cache_hashed_per_request_against_hooks(tmp_path):
    model = _llama()
    g = torch.Generator().manual_seed(1)
    probe = torch.randint(1, 64, (1, N_PROBE), generator=g)
    other = torch.randint(1, 64, (1, N_OTHER), generator=g)
    ids = torch.cat([torch.cat([torch.zeros(1, N_OTHER - N_PROBE, dtype=torch.long), probe], 1),
                     other])  # fmt: skip
    mask = torch.ones_like(ids)
    mask[0, : N_OTHER - N_PROBE] = 0
    gen = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0,
           "cache_implementation": "static"}  # fmt: skip
    kw = {"input_ids": ids, "attention_mask": mask, **gen}
    seen, out_oracle = _oracle_static(model, kw)
    rows = row_map_from_attention_mask(mask, ["probe", "other"])
    with torch.no_grad():
        out = capture_generate(model, tmp_path / "c", row_map=rows, generate_kwargs=kw,
                               modules=["model.layers.0"])  # fmt: skip
    assert torch.equal(out, out_oracle)
    c = dmlib.open_capture(tmp_path / "c")
    pad = N_OTHER - N_PROBE
    checked = 0
    for step in (1, 2):  # decode steps: the cache holds the prompt and step-1 tokens
        kwarg = seen[step].pop("kwarg")
        for key, arr in seen[step].items():
            i, part = key.split(".")
            b = c.boundary(f"model.layers.0:input.{kwarg}.layers.{i}.{part}#{step}")
            n = arr.shape[2]
            assert list(b.shape) == list(arr.shape)  # the filled positions only
            assert b.digest == _b3(arr)
            probe_slots = list(range(pad, N_OTHER)) + list(range(N_OTHER, n))
            other_slots = list(range(n))
            assert b.requests["probe"].digest == _b3(_request_rows(arr, 0, probe_slots))
            assert b.requests["probe"].n_rows == len(probe_slots)
            assert b.requests["other"].digest == _b3(_request_rows(arr, 1, other_slots))
            checked += 1
    assert checked == 2 * 2 * 2  # two decode steps, two layers, keys and values


class PastUser(nn.Module):
    """Attends its input to legacy past (key, value) tensors given as a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, past_key_values=None):
        k, v = past_key_values[0]
        att = torch.softmax(x[:, None] @ k.transpose(-1, -2), -1) @ v  # (b, h, s, d)
        return self.proj(x + att.sum(1))


def test_legacy_tuple_cache_hashed_per_request(tmp_path):
    torch.manual_seed(2)
    b, h, s, d = 2, 2, 5, 8
    x = torch.randn(b, s, d)
    k, v = torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    mod = PastUser().eval()
    rows = [[("a", j) for j in range(s)], [None] + [("b", j) for j in range(s - 1)]]
    with torch.no_grad(), dmlib.capture(mod, tmp_path / "c", modules=[""], row_map=rows):
        mod(x, past_key_values=((k, v),))
    c = dmlib.open_capture(tmp_path / "c")
    for part, t in (("0", k), ("1", v)):
        bd = c.boundary(f"{c.manifest['root']}:input.past_key_values.0.{part}")
        arr = t.numpy()
        assert bd.cache and bd.digest == _b3(arr)
        assert bd.requests["a"].digest == _b3(_request_rows(arr, 0, list(range(s))))
        assert bd.requests["b"].digest == _b3(_request_rows(arr, 1, list(range(1, s))))
        assert bd.requests["b"].n_rows == s - 1


def _mistral_sliding():
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=64,
                                     sliding_window=4, attn_implementation="sdpa",
                                     pad_token_id=0)  # fmt: skip
    return transformers.MistralForCausalLM(cfg).eval()


def test_sliding_window_cache_hashed_whole_and_judged_only_on_the_same_rows(tmp_path):
    """A static cache with a sliding window (4 slots, a 6-token prompt: the slots roll over)
    is hashed whole per layer (oracle: a pre-hook's clone of every layer's keys/values),
    never judged between layouts that place the probe on other rows, judged between two
    captures of one layout; a decode step whose rolled cache was not judged is never
    called the culprit."""
    from dmlib.localize.boundaries import CaptureVerdict, compare_captures

    model = _mistral_sliding()
    g = torch.Generator().manual_seed(1)
    probe = torch.randint(1, 64, (1, 6), generator=g)
    other = torch.randint(1, 64, (1, 6), generator=g)
    gen = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0,
           "cache_implementation": "static"}  # fmt: skip
    seen: list[dict[str, np.ndarray]] = []

    def pre(mod, args, kwargs):
        kwarg = "past_key_values" if "past_key_values" in kwargs else "cache"
        cache = kwargs[kwarg]
        got = {"kwarg": kwarg}
        for i, layer in enumerate(cache.layers):
            for part in ("keys", "values"):
                t = getattr(layer, part, None)
                if torch.is_tensor(t) and t.numel():
                    assert layer.is_sliding
                    got[f"{i}.{part}"] = t.detach().clone().numpy()
        seen.append(got)

    layouts = {"alone": probe, "batched": torch.cat([probe, other]), "again": None}
    layouts["again"] = layouts["batched"]
    for name, ids in layouts.items():
        mask = torch.ones_like(ids)
        rows = row_map_from_attention_mask(mask, ["probe", "other"][: len(ids)])
        kw = {"input_ids": ids, "attention_mask": mask, **gen}
        h = model.model.layers[0].register_forward_pre_hook(pre, with_kwargs=True)
        seen.clear()
        with torch.no_grad():
            capture_generate(model, tmp_path / name, row_map=rows, generate_kwargs=kw,
                             modules=["model.layers.0"])  # fmt: skip
        h.remove()
        c = dmlib.open_capture(tmp_path / name)
        checked = 0
        for step, got in enumerate(seen):
            kwarg = got.pop("kwarg")
            for key, arr in got.items():
                i, part = key.split(".")
                b = c.boundary(f"model.layers.0:input.{kwarg}.layers.{i}.{part}#{step}")
                assert b.cache and b.rolled and not b.requests and b.digest == _b3(arr)
                checked += 1
        assert checked == 2 * 2 * 2  # two decode steps, two layers, keys and values
    df = compare_captures(tmp_path / "alone", tmp_path / "batched", request="probe")
    rolled = df[df["boundary"].str.contains(r":input\.(?:past_key_values|cache)\.")]
    assert len(rolled) == 8 and (rolled["role"] == "unjudged").all()
    assert rolled["note"].str.contains("sliding-window KV cache").all()
    v = CaptureVerdict.of(df)
    for r in df[(df["module"] == "model.layers.0") & (df["kind"] == "output")].itertuples():
        if r.boundary != "model.layers.0" and r.identical is False:  # a decode step
            assert r.role in ("undetermined", "carrier"), (r.boundary, r.role)
            assert r.boundary not in v.culprits
            assert (r.role == "undetermined") == (r.boundary in v.undetermined)
    same = compare_captures(tmp_path / "batched", tmp_path / "again", request="probe")
    rolled = same[same["boundary"].str.contains(r":input\.(?:past_key_values|cache)\.")]
    assert len(rolled) == 8 and (rolled["identical"] == True).all()  # noqa: E712
