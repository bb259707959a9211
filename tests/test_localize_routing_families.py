"""The routing report on the MoE families beside Qwen3-MoE: Mixtral, OLMoE, Qwen2-MoE,
Qwen3-Next and Qwen3.5-MoE's text model (their sparse MoE blocks between Gated DeltaNet
layers, on the torch fallback),
DeepSeek-V2 and DeepSeek-V3 (one group, a correction bias of its own), tiny random-init
models from transformers' own config classes, float32 and bfloat16.

A near-tie is planted, never left to this CPU. While the router runs, the output of its own
``F.linear`` (its logits) is rewritten for one token of the second request: the logit of
the expert ranked (k+1)-th is put a few steps from the k-th's, below in run A, and in run B
above it (a flip) or less far below (the margin shrinks, no flip). A step is ``2**-23`` of a
float32 logit (a relative change of that size in its softmax score) or one bfloat16 ULP of a
bfloat16 logit; for DeepSeek-V3 the logit is set so that its sigmoid plus bias lands a few
``2**-23`` from the k-th's. The router's own ``forward`` then computes its scores, top-k
and weights.

The oracle, written here from each router's ``forward`` in transformers: the scores it ranks
by recomputed from the planted logits (softmax in float32; Mixtral upcasts before its
softmax; DeepSeek-V2's and V3's logits are float32 whatever the model's dtype; V3 adds its
bias to the sigmoid), ``torch.topk`` by hand, and the margin as the k-th minus the
(k+1)-th score, absolute and in float32 ULP (numpy's bit patterns, and ``numpy.nextafter``
steps for the float32 near-ties). The ids the router returned (a plain forward hook) must
equal the oracle's, so the oracle is the model's.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dmlib.cli import main  # noqa: E402
from dmlib.localize.boundaries import compare_captures  # noqa: E402
from dmlib.localize.capture import capture, open_capture  # noqa: E402
from dmlib.localize.hf import row_map_from_attention_mask  # noqa: E402
from dmlib.localize.routing import flip_lines, values  # noqa: E402

VOCAB, N, T, K = 64, 8, 5, 2
ROW = N + T  # the planted token: request "second", position T, in the router's flat rows
REQUESTS = ["first", "second"]
SMALL = dict(vocab_size=VOCAB, hidden_size=32, max_position_embeddings=64)  # noqa: C408


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **SMALL, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=8, num_experts_per_tok=K,
    ))  # fmt: skip


def _olmoe():
    return transformers.OlmoeForCausalLM(transformers.OlmoeConfig(
        **SMALL, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=K, norm_topk_prob=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=None,
    ))  # fmt: skip


def _qwen2_moe():
    return transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **SMALL, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=K, norm_topk_prob=True,
    ))  # fmt: skip


def _qwen3_next():
    # layers 0-2 Gated DeltaNet, layer 3 full attention, a sparse MoE block in each
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **SMALL, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=K,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8,
    ))  # fmt: skip


def _qwen3_5_moe():
    # the text model of Qwen3.5-MoE: Qwen3-Next's layout (3 Gated DeltaNet layers, then
    # full attention), its own router class
    return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(
        **SMALL, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=K,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8,
    ))  # fmt: skip


def _deepseek_v2(topk_method="greedy"):
    return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        **SMALL, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=K,
        n_shared_experts=1, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        topk_method=topk_method, n_group=2, topk_group=1,
    ))  # fmt: skip


def _deepseek_v3():
    # one group (no group limit), and a correction bias of its own, so that the ranking by
    # sigmoid + bias is not the logits' (the bias starts at zero)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **SMALL, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=K, n_group=1,
        topk_group=1, n_shared_experts=1, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8,
    ))  # fmt: skip
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    bias.copy_(torch.randn(bias.shape, generator=torch.Generator().manual_seed(3)) * 0.02)
    return model


def _softmax_f32(logits):  # Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE, OLMoE: softmax(dtype=float)
    return torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)


def _upcast_softmax(logits):  # Mixtral: softmax(router_logits.float())
    return torch.nn.functional.softmax(logits.float(), dim=-1)


def _v2_softmax(logits):  # DeepSeek-V2: float32 logits, logits.softmax(dtype=torch.float32)
    assert logits.dtype == torch.float32
    return logits.softmax(dim=-1, dtype=torch.float32)


def _v3_scores(logits, bias):  # DeepSeek-V3: float32 logits, sigmoid() + correction bias
    assert logits.dtype == torch.float32
    return logits.sigmoid() + bias


# family -> (model, the layer whose router is planted, its router class, its scores by hand)
FAMILIES = {
    "mixtral": (_mixtral, 1, "MixtralTopKRouter", _upcast_softmax),
    "olmoe": (_olmoe, 1, "OlmoeTopKRouter", _softmax_f32),
    "qwen2_moe": (_qwen2_moe, 1, "Qwen2MoeTopKRouter", _softmax_f32),
    "qwen3_next": (_qwen3_next, 2, "Qwen3NextTopKRouter", _softmax_f32),
    "qwen3_5_moe": (_qwen3_5_moe, 2, "Qwen3_5MoeTopKRouter", _softmax_f32),
    "deepseek_v2": (_deepseek_v2, 1, "DeepseekV2TopkRouter", _v2_softmax),
    "deepseek_v3": (_deepseek_v3, 1, "DeepseekV3TopkRouter", _v3_scores),
}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def model_of(family, dtype):
    torch.manual_seed(0)
    return FAMILIES[family][0]().eval().to(dtype)


class Plant:
    """Rewrites the logits the router's own ``F.linear`` returns, at flat row ``row`` only:
    the (k+1)-th ranked expert's logit set ``steps`` steps from the k-th's (negative:
    below). Keeps the logits and the ids the router returned, per router call."""

    def __init__(self, router, steps: int, row: int = ROW, call: int | None = None) -> None:
        self.router, self.steps, self.active, self.row = router, steps, False, row
        self.call, self.calls = call, 0  # the router call planted (None: every call)
        self.logits: list = []
        self.ids: list = []

    def __enter__(self):
        self.linear = torch.nn.functional.linear
        torch.nn.functional.linear = self._linear
        self.handles = [
            self.router.register_forward_pre_hook(self._pre),
            self.router.register_forward_hook(self._post),
        ]
        return self

    def __exit__(self, *exc):
        torch.nn.functional.linear = self.linear
        for h in self.handles:
            h.remove()

    def _pre(self, mod, args):
        self.active = self.call is None or self.calls == self.call
        self.calls += 1

    def _post(self, mod, args, out):
        self.active = False
        if self.call is None or self.calls - 1 == self.call:
            self.ids.append(out[2].clone())

    def _linear(self, x, w, b=None):
        y = self.linear(x, w, b)
        if not self.active:
            return y
        self.active = False  # the router's one F.linear: its logits
        y = y.clone()
        row = y[self.row]
        bias = getattr(self.router, "e_score_correction_bias", None)
        if bias is not None:  # DeepSeek-V3 ranks by sigmoid + bias: its score moved
            self._move_score(row, bias.double())
            self.logits.append(y.detach().clone())
            return y
        order = torch.argsort(row.float(), descending=True, stable=True)
        kth, nxt = int(order[K - 1]), int(order[K])
        if row.dtype == torch.float32:
            row[nxt] = row[kth] + self.steps * 2.0**-23
        else:
            toward = torch.tensor(
                float("inf") if self.steps > 0 else float("-inf"), dtype=row.dtype
            )
            v = row[kth]
            for _ in range(abs(self.steps)):
                v = torch.nextafter(v, toward)
            row[nxt] = v
        self.logits.append(y.detach().clone())
        return y

    def _move_score(self, row, bias):
        """The (k+1)-th expert's logit set so that its sigmoid + bias is the k-th's plus
        ``steps * 2**-23`` (in float64, then rounded to the float32 logit)."""
        score = row.double().sigmoid() + bias
        order = torch.argsort(score, descending=True, stable=True)
        kth, nxt = int(order[K - 1]), int(order[K])
        p = score[kth] + self.steps * 2.0**-23 - bias[nxt]
        row[nxt] = torch.log(p / (1 - p)).to(row.dtype)


def run(model, family, path, steps, dump=(), pad=0, row=ROW):
    """One capture of the two requests, the first left-padded by ``pad`` positions."""
    ids = torch.randint(1, VOCAB, (2, N), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(2, N, dtype=torch.long)
    mask[0, :pad] = 0
    rows = row_map_from_attention_mask(mask, REQUESTS)
    layer = FAMILIES[family][1]
    with Plant(model.model.layers[layer].mlp.gate, steps, row) as plant:
        with (
            torch.no_grad(),
            capture(model, path, row_map=rows, modules=["", "model.*", "lm_head"], dump=dump),
        ):
            model(input_ids=ids, attention_mask=mask, use_cache=False)
    assert len(plant.logits) == 1  # the planted router ran once
    return plant


def by_hand(family, plant):
    """(top-k id sets per flat row, (k-th, (k+1)-th) float32 scores per row) by torch.topk on
    the router's scores recomputed from the planted logits; the router's own ids agree."""
    how, logits = FAMILIES[family][3], plant.logits[0]
    bias = getattr(plant.router, "e_score_correction_bias", None)
    scores = how(logits) if bias is None else how(logits, bias)
    vals, idx = torch.topk(scores, K + 1, dim=-1)
    sets = [sorted(int(e) for e in r) for r in idx[:, :K]]
    assert sets == [sorted(int(e) for e in r) for r in plant.ids[0]]  # as the model chose
    return sets, vals[:, K - 1 : K + 1].numpy()


def ulps_by_nextafter(hi: np.float32, lo: np.float32, limit: int = 1 << 12) -> int:
    """float32 values from ``lo`` up to ``hi``, counted one ``nextafter`` at a time."""
    n, v = 0, lo
    while v < hi and n < limit:
        v, n = np.nextafter(v, np.float32(np.inf)), n + 1
    return n


def ulps_by_bits(hi: np.float32, lo: np.float32) -> int:
    """The same count from the bit patterns (both scores are positive)."""
    return int(np.int64(np.float32(hi).view(np.int32)) - np.int64(np.float32(lo).view(np.int32)))


def n_routers(model, family):
    return sum(type(m).__name__ == FAMILIES[family][2] for m in model.modules())


CASES = [(f, d) for f in FAMILIES for d in DTYPES]


@pytest.mark.parametrize(("family", "dt"), CASES)
def test_a_planted_flip_is_named_with_its_margins(tmp_path, family, dt):
    model = model_of(family, DTYPES[dt])
    pa = run(model, family, tmp_path / "a", steps=-4)
    pb = run(model, family, tmp_path / "b", steps=+4)
    (sa, va), (sb, vb) = by_hand(family, pa), by_hand(family, pb)
    assert [i for i in range(2 * N) if sa[i] != sb[i]] == [ROW]  # the oracle's one flip
    router = f"model.layers.{FAMILIES[family][1]}.mlp.gate"
    rep = compare_captures(tmp_path / "a", tmp_path / "b").attrs["routing"]
    assert rep["n_router_calls"] == n_routers(model, family)
    assert rep["n_flips"] == 1 and rep["not_judged"] == []
    (f,) = rep["flips"]
    assert (f["router"], f["request"], f["position"]) == (router, "second", T)
    assert (f["experts_a"], f["experts_b"]) == (sa[ROW], sb[ROW])
    assert f["left"] == sorted(set(sa[ROW]) - set(sb[ROW]))
    assert f["joined"] == sorted(set(sb[ROW]) - set(sa[ROW]))
    assert rep["per_router"] == {router: 1}
    for side, v in (("a", va[ROW]), ("b", vb[ROW])):
        assert f[f"margin_{side}"] == float(v[0]) - float(v[1])  # exact: float64 of two f32
        assert f[f"margin_ulp_{side}"] == ulps_by_bits(v[0], v[1]) > 0
    if pa.logits[0].dtype == torch.float32:  # a few float32 ULP apart: a near-tie in each run
        for side, v in (("a", va[ROW]), ("b", vb[ROW])):
            assert f[f"margin_ulp_{side}"] == ulps_by_nextafter(v[0], v[1]) <= 16
    # every token's recorded (k-th, (k+1)-th) scores are the oracle's, in both runs
    for path, v in ((tmp_path / "a", va), (tmp_path / "b", vb)):
        c = open_capture(path)
        got = values(c, c.boundary(f"{router}:router.margin"))
        np.testing.assert_array_equal(got, v)
        assert "routers_unread" not in c.coverage  # a scalar shared_expert_gate is no router
    # read from each forward
    kind = {"mixtral": "float-softmax", "deepseek_v3": "sigmoid+bias"}.get(family, "softmax")
    assert f["scores"] == kind
    line = f"position {T}: experts {sa[ROW]} -> {sb[ROW]}"
    assert any(line in s and s.endswith(f" on {kind}") for s in flip_lines(rep))


@pytest.mark.parametrize(("family", "dt"), CASES)
def test_a_margin_that_shrinks_without_a_flip_is_no_flip(tmp_path, family, dt):
    model = model_of(family, DTYPES[dt])
    pa = run(model, family, tmp_path / "a", steps=-8)
    pb = run(model, family, tmp_path / "b", steps=-2)
    (sa, va), (sb, vb) = by_hand(family, pa), by_hand(family, pb)
    assert sa == sb  # the oracle: no token's set changed
    assert 0 < float(vb[ROW, 0]) - float(vb[ROW, 1]) < float(va[ROW, 0]) - float(va[ROW, 1])
    router = f"model.layers.{FAMILIES[family][1]}.mlp.gate"
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    rep = df.attrs["routing"]
    assert rep["n_flips"] == 0 and rep["flips"] == [] and rep["per_router"] == {}
    assert rep["not_judged"] == []
    by = df.set_index("boundary")
    same = by.loc[f"{router}:router.indices", "identical"]
    assert same is not None and bool(same) and by.loc[f"{router}:router.indices", "role"] == "clean"
    moved = by.loc[f"{router}:router.margin", "identical"]
    assert moved is not None and not moved  # judged, and the margin moved
    for path, v in ((tmp_path / "a", va), (tmp_path / "b", vb)):
        c = open_capture(path)
        np.testing.assert_array_equal(values(c, c.boundary(f"{router}:router.margin")), v)
    assert flip_lines(rep)[0].startswith("routing: no expert set changed")


@pytest.mark.parametrize(("family", "dt"), [("mixtral", "f32"), ("mixtral", "bf16"),
                                             ("qwen3_next", "f32")])  # fmt: skip
def test_the_flipped_token_stands_out_downstream(tmp_path, capsys, family, dt):
    """The MoE block's output after the planted flip, request "second": the flipped token has
    the largest difference (numpy on the dumped rows), the flip's effect gives it and the
    largest elsewhere as numpy does, the positions whose rows differ (diff_positions, the
    request alone) are numpy's, and the block's note names the flip."""
    model = model_of(family, DTYPES[dt])
    run(model, family, tmp_path / "a", steps=-4, dump=["*mlp"])
    run(model, family, tmp_path / "b", steps=+4, dump=["*mlp"])
    block = f"model.layers.{FAMILIES[family][1]}.mlp"
    a, b = open_capture(tmp_path / "a"), open_capture(tmp_path / "b")
    xa = np.asarray(a.tensor(block, "second"), dtype=np.float64).reshape(N, -1)
    xb = np.asarray(b.tensor(block, "second"), dtype=np.float64).reshape(N, -1)
    per_pos = np.abs(xa - xb).max(axis=1)
    assert int(np.argmax(per_pos)) == T and per_pos[T] > 0  # the planted flip's expert swap
    full = compare_captures(a, b)
    (f,) = full.attrs["routing"]["flips"]
    others = np.delete(per_pos, T)
    top = int(np.argmax(per_pos * (np.arange(N) != T)))  # the largest elsewhere, if any
    assert f["effect"] == {
        "boundary": block, "at_flip": per_pos[T], "elsewhere": others.max(),
        "elsewhere_position": top if others.max() > 0 else None,
    }  # fmt: skip
    line = next(s for s in flip_lines(full.attrs["routing"]) if f"position {T}:" in s)
    assert f"at {block} max |diff| {per_pos[T]:.3g} here, {others.max():.3g} at most" in line
    # the same flip in `dmlib localize --json`
    assert main(["localize", str(tmp_path / "a"), str(tmp_path / "b"), "--json"]) == 1
    (g,) = json.loads(capsys.readouterr().out)["attrs"]["routing"]["flips"]
    assert g == f
    df = compare_captures(a, b, request="second").set_index("boundary")
    assert df.loc[block, "diff_positions"] == np.nonzero(per_pos)[0].tolist()
    assert f"expert flip at {block}.gate:router.indices" in df.loc[block, "note"]
    assert "position 5" in df.loc[block, "note"] and "'second'" in df.loc[block, "note"]


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_a_flip_in_a_left_padded_request_is_at_its_own_position(tmp_path, family):
    """The first request left-padded by 3: a flip planted at its flat row 3 + 2 is reported
    at request "first", position 2 (the padding counted out), and nothing else flips."""
    pad, pos = 3, 2
    model = model_of(family, torch.float32)
    pa = run(model, family, tmp_path / "a", steps=-4, pad=pad, row=pad + pos)
    pb = run(model, family, tmp_path / "b", steps=+4, pad=pad, row=pad + pos)
    (sa, va), (sb, vb) = by_hand(family, pa), by_hand(family, pb)
    assert [i for i in range(2 * N) if sa[i] != sb[i]] == [pad + pos]
    rep = compare_captures(tmp_path / "a", tmp_path / "b").attrs["routing"]
    (f,) = rep["flips"]
    assert (f["request"], f["position"]) == ("first", pos)
    assert (f["experts_a"], f["experts_b"]) == (sa[pad + pos], sb[pad + pos])
    assert f["margin_a"] == float(va[pad + pos, 0]) - float(va[pad + pos, 1])
    assert f["margin_b"] == float(vb[pad + pos, 0]) - float(vb[pad + pos, 1])


def test_a_flip_at_a_decode_step_is_at_the_position_fed(tmp_path):
    """generate() on tiny Mixtral (float32), two prompts of N tokens, 3 new tokens: the
    near-tie planted in layer 1's router at the last pass (decode step 2, batch row 1 =
    request "second") is the one flip reported, at step 2 and position N + 1 (the token that
    pass fed), with the oracle's experts and margins."""
    from dmlib.localize.hf import capture_generate

    model = model_of("mixtral", torch.float32)
    ids = torch.randint(1, VOCAB, (2, N), generator=torch.Generator().manual_seed(7))
    rows = row_map_from_attention_mask(torch.ones(2, N), REQUESTS)
    gen = dict(input_ids=ids, attention_mask=torch.ones(2, N, dtype=torch.long),  # noqa: C408
               max_new_tokens=3, do_sample=False, pad_token_id=0)  # fmt: skip
    plants = {}
    for side, steps in (("a", -4), ("b", +4)):
        with Plant(model.model.layers[1].mlp.gate, steps, row=1, call=2) as plants[side]:
            with torch.no_grad():
                capture_generate(model, tmp_path / side, row_map=rows, generate_kwargs=gen)
        assert plants[side].calls == 3 and len(plants[side].logits) == 1
    (sa, va), (sb, vb) = by_hand("mixtral", plants["a"]), by_hand("mixtral", plants["b"])
    assert [i for i in range(2) if sa[i] != sb[i]] == [1]  # the planted row alone
    rep = compare_captures(tmp_path / "a", tmp_path / "b").attrs["routing"]
    assert rep["n_router_calls"] == 2 * 3
    (f,) = rep["flips"]
    assert (f["request"], f["step"], f["position"]) == ("second", 2, N + 1)
    assert (f["experts_a"], f["experts_b"]) == (sa[1], sb[1])
    assert f["margin_a"] == float(va[1, 0]) - float(va[1, 1])
    assert f["margin_b"] == float(vb[1, 0]) - float(vb[1, 1])


def test_a_group_limited_deepseek_v2_router_records_its_margins(tmp_path):
    """DeepSeek-V2 with ``topk_method="group_limited_greedy"`` (2 groups of 4, one kept):
    the ids are the router's own; the margin row per token is the lowest chosen softmax
    score and the highest score not chosen in any group (negative where the group limit
    passed over a higher one), by hand from the router's logits."""
    model = model_of("deepseek_v2", torch.float32)
    model.model.layers[1].mlp.gate.topk_method = "group_limited_greedy"
    seen = []
    gate = model.model.layers[1].mlp.gate
    h = gate.register_forward_hook(lambda m, a, out: seen.append((out[0].clone(), out[2].clone())))
    rows = row_map_from_attention_mask(torch.ones(2, N), REQUESTS)
    try:
        with torch.no_grad(), capture(model, tmp_path / "a", row_map=rows):
            model(input_ids=torch.randint(1, VOCAB, (2, N)), use_cache=False)
    finally:
        h.remove()
    (logits, idx), c = seen[0], open_capture(tmp_path / "a")
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    groups = scores.view(-1, 2, 4).max(dim=-1).values.argmax(dim=-1)
    assert all(set((idx[i] // 4).tolist()) == {int(groups[i])} for i in range(2 * N))
    got = values(c, c.boundary("model.layers.1.mlp.gate:router.margin"))
    chosen = scores.gather(1, idx).min(dim=1).values
    other = scores.scatter(1, idx, float("-inf")).max(dim=1).values
    np.testing.assert_array_equal(got, torch.stack([chosen, other], 1).numpy())
    got_ids = values(c, c.boundary("model.layers.1.mlp.gate:router.indices"))
    np.testing.assert_array_equal(got_ids, idx.numpy())


def _llama4():
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        **SMALL, intermediate_size=16, intermediate_size_mlp=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=1, interleave_moe_layer_step=1,
    ))  # fmt: skip


def _dbrx():
    # clip_qkv set: transformers 5.25's DBRX attention calls clamp with it, None fails
    return transformers.DbrxForCausalLM(transformers.DbrxConfig(
        vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2},
    ))  # fmt: skip


@pytest.mark.parametrize(("make", "cls"), [(_llama4, "Llama4Router"), (_dbrx, "DbrxRouter")])
def test_a_router_without_ids_is_listed_not_judged(tmp_path, make, cls):
    """Llama 4's router returns (the chosen scores scattered over all experts, the logits),
    DBRX's its logits alone (its caller chooses): no ids to read. Every such router (found
    here by a plain walk of the modules) is listed in the capture's coverage and as not
    judged in the routing report and its text."""
    torch.manual_seed(0)
    model = make().eval()
    expected = [n for n, m in model.named_modules() if type(m).__name__ == cls]
    assert len(expected) == 2
    rows = row_map_from_attention_mask(torch.ones(2, N), REQUESTS)
    ids = torch.randint(1, VOCAB, (2, N), generator=torch.Generator().manual_seed(7))
    for side in ("a", "b"):
        with torch.no_grad(), capture(model, tmp_path / side, row_map=rows):
            model(input_ids=ids, use_cache=False)
    c = open_capture(tmp_path / "a")
    listed = c.coverage["routers_unread"]
    assert [u["module"] for u in listed] == expected
    assert all(f"{cls} returned" in u["reason"] for u in listed)
    assert not any(x.router for x in c.boundaries)
    rep = compare_captures(tmp_path / "a", tmp_path / "b").attrs["routing"]
    assert rep["n_router_calls"] == 0 and rep["n_flips"] == 0
    assert [u["boundary"] for u in rep["not_judged"]] == expected
    text = flip_lines(rep)
    assert text[0] == "routing: no expert set changed (0 router calls); 2 not judged"
    assert [s.split(": ")[1] for s in text[1:]] == expected


def test_a_router_of_a_class_not_in_the_table_says_its_margins_are_on_logits(tmp_path):
    """AFMoE's router (not in SCORES) ranks by sigmoid plus a bias its caller passes: its ids
    are recorded as the router returned them, its margins on the logits, and the capture and
    the report's text say so; the ``Linear`` named ``gate`` inside it (its logits, no ids)
    is not listed as an unread router, its router being read."""
    torch.manual_seed(0)
    cfg = transformers.AfmoeConfig(
        **SMALL, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=K, num_shared_experts=1,
        global_attn_every_n_layers=2, sliding_window=16,
    )  # fmt: skip
    model = transformers.AfmoeForCausalLM(cfg).eval()
    router = "model.layers.1.mlp.router"
    assert type(model.get_submodule(f"{router}.gate")).__name__ == "Linear"
    seen = []
    h = model.get_submodule(router).register_forward_hook(
        lambda m, a, out: seen.append((out[0].clone(), out[2].clone()))
    )
    rows = row_map_from_attention_mask(torch.ones(2, N), REQUESTS)
    try:
        with torch.no_grad(), capture(model, tmp_path / "a", row_map=rows):
            model(input_ids=torch.randint(1, VOCAB, (2, N)), use_cache=False)
    finally:
        h.remove()
    (logits, idx), c = seen[0], open_capture(tmp_path / "a")
    assert "routers_unread" not in c.coverage
    kind = "logits (AfmoeTokenChoiceRouter not in SCORES)"
    assert c.coverage["router_scores"] == {router: kind}
    np.testing.assert_array_equal(values(c, c.boundary(f"{router}:router.indices")), idx)
    chosen = logits.gather(1, idx).min(dim=1).values
    other = logits.scatter(1, idx, float("-inf")).max(dim=1).values
    margin = values(c, c.boundary(f"{router}:router.margin"))
    np.testing.assert_array_equal(margin, torch.stack([chosen, other], 1).numpy())
