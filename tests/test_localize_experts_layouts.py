"""Expert rows of every experts layout transformers' ``use_experts_implementation`` classes
have: gated (``gate_up_proj``: DeepSeek-V3, Jamba) or not (``up_proj`` and an activation:
Nemotron-H), stored (E, out, in) or transposed (E, in, out) with biases (GPT-OSS), under
eager, grouped_mm and batched_mm, float32 and bfloat16, on tiny random-init models from
transformers' own config classes (Jamba's Mamba and Nemotron-H's Mamba2 layers on their
torch fallbacks).

Oracles, all written here in plain torch:
- the routing and inputs each experts module received, from plain forward pre-hooks;
- each (expert, token) row recomputed from the module's weights and those inputs in the
  implementation's order and op (eager: per expert on the tokens of ``torch.where`` over
  the (k, T) mask, ``F.linear(x, w[e])`` or, transposed, ``x @ w[e]``; grouped_mm: the
  same per expert group of ``hidden[perm // k]``, ``perm`` from the test's own
  ``torch.sort`` of the routing; batched_mm: one ``torch.bmm`` over the flattened
  (token, slot) pairs with the gathered weights), the bias added after the matmul and the
  gate (GPT-OSS's own ``_apply_gate``) or the activation alone between the stages, each
  row hashed with ``hashlib.sha256`` of its bytes before its bias;
- a planted +1 ULP in one element of one (expert, token) row of the last experts module's
  down_proj output: a TorchFunctionMode of the test finds that row from what it sees the
  module run (eager: the matmul on the expert's slice of ``down_proj``, row by the
  ``torch.where`` order; grouped_mm: the second grouped matmul, row by the permutation the
  module's own ``torch.sort`` returned; batched_mm: the second ``bmm``, row ``t * k + slot``),
  so exactly that key must differ.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from dmlib.localize.experts import (  # noqa: E402
    STAGES,
    UNGATED_STAGES,
    compare_expert_rows,
    experts_modules,
    record_expert_rows,
    stages_of,
)

FAMILIES = ("deepseek_v3", "gpt_oss", "jamba", "nemotron_h")
IMPLS = ("eager", "grouped_mm", "batched_mm")
DTYPES = ("float32", "bfloat16")
PROBE = torch.tensor([[5, 9, 1, 33, 7, 60, 2, 18, 44, 3, 12, 27]])
TOKEN = 6  # the planted row's token
COMMON = dict(
    vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def config(family: str) -> Any:
    t = transformers
    if family == "deepseek_v3":
        return t.DeepseekV3Config(
            **COMMON, num_hidden_layers=2, intermediate_size=32, moe_intermediate_size=16,
            n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, n_shared_experts=1,
        )  # fmt: skip
    if family == "gpt_oss":
        return t.GptOssConfig(
            **COMMON, num_hidden_layers=2, intermediate_size=16, num_local_experts=8,
            num_experts_per_tok=2, head_dim=8, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
    if family == "jamba":  # layers: mamba, mamba+MoE, attention, mamba+MoE
        return t.JambaConfig(
            **COMMON, num_hidden_layers=4, intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
            attn_layer_period=4, attn_layer_offset=2, mamba_d_state=8, mamba_d_conv=4,
            mamba_expand=2, mamba_dt_rank=4,
        )  # fmt: skip
    return t.NemotronHConfig(
        **COMMON, layers_block_type=["mamba", "moe", "attention", "mamba", "moe"],
        intermediate_size=32, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
        mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, mamba_n_groups=1,
        conv_kernel=4, head_dim=8, chunk_size=4,
    )  # fmt: skip


@functools.cache
def _model(family: str, dtype: str) -> Any:
    cfg = config(family)
    torch.manual_seed(0)
    model = getattr(transformers, type(cfg).__name__.replace("Config", "ForCausalLM"))(cfg)
    model = model.eval().to(getattr(torch, dtype))
    with torch.no_grad():  # random biases (GPT-OSS's are zeros at init: nothing to add)
        g = torch.Generator().manual_seed(4)
        for _, mod in experts_modules(model):
            for b in ("gate_up_proj_bias", "up_proj_bias", "down_proj_bias"):
                if torch.is_tensor(getattr(mod, b, None)):
                    w = getattr(mod, b)
                    w.copy_(torch.randn(w.shape, generator=g) * 0.1)
    return model


def model_for(family: str, dtype: str, impl: str) -> Any:
    model = _model(family, dtype)
    for _, mod in experts_modules(model):
        mod.config._experts_implementation = impl
    return model


class _Nothing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def run(model: Any, plant: Any = None) -> tuple[Any, dict[str, tuple[Any, ...]]]:
    """dmlib's record of one forward, and each experts module's inputs seen by plain hooks."""
    seen: dict[str, tuple[Any, ...]] = {}
    hs = [
        m.register_forward_pre_hook(
            lambda m, a, n=n: seen.__setitem__(n, tuple(x.detach().clone() for x in a))
        )
        for n, m in experts_modules(model)
    ]
    try:
        with torch.no_grad(), plant or _Nothing(), record_expert_rows(model) as rec:
            model(input_ids=PROBE)
    finally:
        for h in hs:
            h.remove()
    return rec, seen


def digest(row: Any) -> str:
    return hashlib.sha256(row.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _mm(x: Any, w: Any, transposed: bool) -> Any:
    """One expert's matmul as the implementations write it for the layout."""
    return x @ w if transposed else F.linear(x, w)


def _between(mod: Any, out: Any, bias: Any) -> Any:
    """What runs between the two stages: the bias, then the gate or the activation alone."""
    if bias is not None:
        out = out + bias
    return mod._apply_gate(out) if mod.has_gate else mod.act_fn(out)


def _bias(mod: Any, stage: str, ids: Any) -> Any:
    b = getattr(mod, f"{stage}_bias", None)
    return b[ids] if mod.has_bias and b is not None else None


def _grouped(mod: Any, x: Any, experts: Any, stage: str) -> Any:
    """One matmul per expert group of ``x`` (in row order), rows put back in place."""
    w = getattr(mod, stage)
    out = torch.empty(x.shape[0], w.shape[2] if mod.is_transposed else w.shape[1], dtype=x.dtype)
    for e in experts.unique().tolist():
        sel = (experts == e).nonzero().flatten()
        out[sel] = _mm(x[sel], w[e], mod.is_transposed)
    return out


def _bmm(mod: Any, x: Any, w: Any) -> Any:
    if mod.is_transposed:
        return torch.bmm(x.unsqueeze(1), w).squeeze(1)
    return torch.bmm(w, x.unsqueeze(-1)).squeeze(-1)


def oracle(mod: Any, hidden: Any, index: Any, impl: str) -> dict[tuple[int, int, str], str]:
    """Each (expert, token, stage) row recomputed in the implementation's order and op."""
    first, down = stages_of(mod)
    k, flat, rows = index.shape[1], index.reshape(-1), {}
    if impl == "eager":
        for e in index.unique().tolist():
            _, tok = torch.where((index == e).T)
            up = _mm(hidden[tok], getattr(mod, first)[e], mod.is_transposed)
            dn = _mm(_between(mod, up, _bias(mod, first, e)), mod.down_proj[e], mod.is_transposed)
            for r, t in enumerate(tok.tolist()):
                rows[(e, t, first)], rows[(e, t, down)] = digest(up[r]), digest(dn[r])
        return rows
    if impl == "grouped_mm":
        perm = torch.sort(flat).indices  # the same values sorted again: the same order
        experts, pairs = flat[perm], perm
        up = _grouped(mod, hidden[perm // k], experts, first)
        dn = _grouped(mod, _between(mod, up, _bias(mod, first, experts)), experts, down)
    else:
        experts, pairs = flat, torch.arange(flat.numel())
        up = _bmm(mod, hidden.repeat_interleave(k, dim=0), getattr(mod, first)[flat])
        dn = _bmm(mod, _between(mod, up, _bias(mod, first, flat)), mod.down_proj[flat])
    for i, (e, p) in enumerate(zip(experts.tolist(), pairs.tolist(), strict=True)):
        rows[(e, p // k, first)], rows[(e, p // k, down)] = digest(up[i]), digest(dn[i])
    return rows


class PlantRow(TorchFunctionMode):
    """+1 ULP in the largest element of (expert, TOKEN)'s ``stage`` row of experts module
    ``name`` (its first call), the row found from what the module runs (module docstring:
    batched_mm's first or second ``bmm`` by the stage); ``planted`` is the key."""

    def __init__(self, model: Any, name: str, stage: str = "down_proj") -> None:
        super().__init__()
        self.mod = dict(model.named_modules())[name]
        self.stage, self.nth = stage, 2 if stage == "down_proj" else 1
        self.name, self.inside, self.perm, self.bmms = name, False, None, 0
        self.index: Any = None
        self.planted: tuple[Any, ...] | None = None
        self.hs = [
            self.mod.register_forward_pre_hook(self._pre),
            self.mod.register_forward_hook(lambda *_: setattr(self, "inside", False)),
        ]

    def _pre(self, mod: Any, args: Any) -> None:
        self.inside, self.index, self.perm, self.bmms = True, args[1], None, 0

    def remove(self) -> None:
        for h in self.hs:
            h.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.inside or self.planted is not None:
            return out
        impl = self.mod.config._experts_implementation
        k, flat = self.index.shape[1], self.index.reshape(-1)
        e = int(self.index[TOKEN, 0])
        weight = getattr(self.mod, self.stage)
        if func is torch.sort and torch.equal(args[0], flat):
            self.perm = out.indices
        elif func is torch.bmm:
            self.bmms += 1
            if self.bmms == self.nth:  # batched_mm: the flattened (token, slot) pairs
                self._bump(out.reshape(out.shape[0], -1)[TOKEN * k], e)
        elif impl == "grouped_mm" and len(args) > 1 and self._is(args[1], weight):
            row = (self.perm == TOKEN * k).nonzero().item()
            self._bump(out[row], e)
        elif impl == "eager" and len(args) > 1 and self._is(args[1], weight, expert=e):
            _, tok = torch.where((self.index == e).T)
            self._bump(out[tok.tolist().index(TOKEN)], e)
        return out

    @staticmethod
    def _is(w: Any, whole: Any, expert: int | None = None) -> bool:
        """``w`` is ``whole`` itself (any view of its 3 axes) or, given ``expert``, its
        slice ``whole[expert]``."""
        if (
            not torch.is_tensor(w)
            or w.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()
        ):
            return False
        if expert is None:
            return w.dim() == 3
        return (
            w.dim() == 2 and w.storage_offset() == whole.storage_offset() + expert * whole.stride(0)
        )

    def _bump(self, row: Any, e: int) -> None:
        with torch._C.DisableTorchFunction():
            bits = {2: torch.int16, 4: torch.int32}[row.element_size()]
            flat = row.reshape(-1)
            i = int(flat.argmax())
            flat[i : i + 1].view(bits).add_(1)
        self.planted = (self.name, 0, e, TOKEN, self.stage)


CASES = [(f, i, d) for f in FAMILIES for i in IMPLS for d in DTYPES]


@pytest.mark.parametrize(("family", "impl", "dtype"), CASES)
def test_rows_equal_the_recomputation_in_the_implementations_order(family, impl, dtype):
    model = model_for(family, dtype, impl)
    rec, seen = run(model)
    assert rec.not_judged == {}
    mods = dict(experts_modules(model))
    assert seen and set(seen) == set(mods)
    want = {}
    for name, (hidden, index, _) in seen.items():
        with torch.no_grad():
            got = oracle(mods[name], hidden, index, impl)
        want |= {(name, 0, *key): d for key, d in got.items()}
    assert want and rec.rows == want


@pytest.mark.parametrize(("family", "impl", "dtype"), CASES)
def test_one_ulp_planted_in_one_down_proj_row_is_that_key(family, impl, dtype):
    model = model_for(family, dtype, impl)
    last = experts_modules(model)[-1][0]
    plant = PlantRow(model, last)
    try:
        a, _ = run(model)
        b, _ = run(model, plant)
    finally:
        plant.remove()
    assert plant.planted is not None
    got = compare_expert_rows(a, b)
    assert got["differ"] == [plant.planted]
    assert got["one_side"] == [] and got["not_judged"] == {}
    assert got["identical"] == len(a.rows) - 1


def test_each_family_has_the_layout_it_is_here_for():
    """The layouts tested, read from the modules the decorator built (not assumed)."""
    layout = {}
    for family in FAMILIES:
        (_, mod), *_ = experts_modules(_model(family, "float32"))
        layout[family] = (stages_of(mod), mod.is_transposed, mod.has_bias)
    assert layout == {
        "deepseek_v3": (STAGES, False, False),
        "gpt_oss": (STAGES, True, True),
        "jamba": (STAGES, False, False),
        "nemotron_h": (UNGATED_STAGES, False, False),
    }


def _alone(cls: Any, cfg: Any, dtype: Any) -> Any:
    """An experts module of ``cls`` alone in a wrapper (its weights random), as a model."""

    class Wrap(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = cls(cfg)

        def forward(self, *args: Any) -> Any:
            return self.experts(*args)

    torch.manual_seed(0)
    m = Wrap()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape))
    return m.to(dtype)


def _ergo() -> tuple[Any, Any]:
    from transformers.models.ergo.modeling_ergo import ErgoExperts

    cfg = transformers.ErgoConfig(
        hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2
    )
    return ErgoExperts, cfg


def _privacy_filter() -> tuple[Any, Any]:
    from transformers.models.openai_privacy_filter import modeling_openai_privacy_filter as mod

    cfg = transformers.OpenAIPrivacyFilterConfig(
        hidden_size=16, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2
    )
    return mod.OpenAIPrivacyFilterExperts, cfg


def _aria() -> tuple[Any, Any]:
    from transformers.models.aria.modeling_aria import AriaExperts

    cfg = transformers.AriaTextConfig(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
        moe_num_experts=4, moe_topk=2,
    )  # fmt: skip
    return AriaExperts, cfg


def _muse_spark() -> tuple[Any, Any]:
    from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

    cfg = transformers.MuseSparkTextConfig(
        hidden_size=16, num_attention_heads=2, num_key_value_heads=1, moe_hidden_size=16,
        moe_intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return MuseSparkExperts, cfg


MAKERS = {
    "ergo": _ergo,
    "privacy_filter": _privacy_filter,
    "aria": _aria,
    "muse_spark": _muse_spark,
}
EAGER_ROWS = "eager: expert 0's up_proj input rows are not hidden_states of its routed tokens"
NO_SLICE = "no per-expert F.linear or matmul on a slice of its weights was seen"
# (module, dtype, implementation) -> why not judged (None: judged, rows equal the oracle's)
ALONE = {
    # Ergo (up_proj, transposed) repeats each token k times and gathers per route, token
    # by token: its eager rows are not in the (k, T) mask's order; the other two run the
    # implementations' own code on the repeated rows, which map back to tokens
    ("ergo", "float32", "eager"): EAGER_ROWS,
    ("ergo", "float32", "grouped_mm"): None,
    ("ergo", "float32", "batched_mm"): None,
    # the privacy filter (transposed, biases) casts each expert's slice with .float(): the
    # same tensor in float32, a copy in bfloat16
    ("privacy_filter", "float32", "eager"): None,
    ("privacy_filter", "bfloat16", "eager"): NO_SLICE,
    ("privacy_filter", "bfloat16", "grouped_mm"): None,
    ("privacy_filter", "bfloat16", "batched_mm"): None,
    # Aria (gated, transposed, x @ w[e] in eager) and MuseSpark (a norm after each
    # expert's down_proj: its rows are taken before it), read everywhere
    **{(m, d, i): None for m in ("aria", "muse_spark") for d in DTYPES for i in IMPLS},
}


@pytest.mark.parametrize(("which", "dtype", "impl"), list(ALONE))
def test_other_layouts_are_read_or_listed_not_judged_with_the_reason(which, dtype, impl):
    cls, cfg = MAKERS[which]()
    cfg._experts_implementation = impl
    model = _alone(cls, cfg, getattr(torch, dtype))
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 16, generator=g).to(getattr(torch, dtype))
    index = torch.tensor([[0, 1], [2, 1], [3, 0], [1, 2], [0, 3], [2, 3]])
    weights = torch.rand(6, 2, generator=g).to(getattr(torch, dtype))
    with torch.no_grad(), record_expert_rows(model) as rec:
        model(hidden, index, weights)
    why = ALONE[(which, dtype, impl)]
    if why is not None:
        assert rec.rows == {}
        assert list(rec.not_judged) == ["experts"] and rec.not_judged["experts"].startswith(why)
        return
    assert rec.not_judged == {}
    with torch.no_grad():
        want = oracle(model.experts, hidden, index, impl)
    assert len(want) == 6 * 2 * 2
    assert rec.rows == {("experts", 0, *key): d for key, d in want.items()}
