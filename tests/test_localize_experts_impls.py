"""Expert rows per (expert, token) under every transformers experts implementation
(eager, grouped_mm, batched_mm) and MoE family (Qwen3-MoE, Mixtral, OLMoE, Qwen3-Next),
float32 and bfloat16, on tiny random-init models from transformers' own config classes.

Oracles, all written here in plain torch:
- the routing and inputs each experts module received, from plain forward pre-hooks;
- each (expert, token) row recomputed from the module's weights and those inputs, in
  the order and with the op the implementation runs (eager: ``F.linear`` per expert on
  the tokens of ``torch.where`` over the (k, T) mask; grouped_mm: ``F.linear`` per expert
  group on ``hidden[perm // k]``, ``perm`` from the test's own ``torch.sort`` of the same
  routing tensor; batched_mm: one ``torch.bmm`` over the flattened (token, slot) pairs),
  hashed with ``hashlib.sha256`` of the row's bytes. On this CPU these recomputations
  give the implementations' bits (checked by the equality below); the differing rows
  between two runs are then the oracle's, never assumed;
- a planted +1 ULP in one element of one (expert, token) row of the last experts
  module's down_proj output (a TorchFunctionMode of the test finds the row by its content:
  its gate_up input equal to the token's hidden row, within the expert's group or beside
  the expert's gathered weight), so exactly that key must differ.
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
    compare_expert_rows,
    record_expert_rows,
)

FAMILIES = ("qwen3_moe", "mixtral", "olmoe", "qwen3_next")
IMPLS = ("eager", "grouped_mm", "batched_mm")
DTYPES = ("float32", "bfloat16")
EXPERTS = ("Qwen3MoeExperts", "MixtralExperts", "OlmoeExperts", "Qwen3NextExperts")
PROBE = torch.tensor([[5, 9, 1, 33, 7, 60, 2, 18, 44, 3, 12, 27]])
OTHER = torch.tensor([[40, 41, 8, 6, 50, 11, 13, 21, 30, 35, 36, 38]])
COMMON = dict(
    vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def _config(family: str) -> Any:
    t = transformers
    if family == "qwen3_moe":
        return t.Qwen3MoeConfig(
            **COMMON, intermediate_size=64, moe_intermediate_size=16, head_dim=8,
            num_experts=8, decoder_sparse_step=1,
        )  # fmt: skip
    if family == "mixtral":
        return t.MixtralConfig(**COMMON, intermediate_size=16, head_dim=8, num_local_experts=8)
    if family == "olmoe":
        return t.OlmoeConfig(**COMMON, intermediate_size=16, num_experts=8)
    return t.Qwen3NextConfig(
        **{**COMMON, "num_attention_heads": 2, "num_key_value_heads": 1},
        intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8,
        decoder_sparse_step=1, layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip


@functools.cache
def _model(family: str, dtype: str) -> Any:
    cfg = _config(family)
    torch.manual_seed(0)
    model = getattr(transformers, type(cfg).__name__.replace("Config", "ForCausalLM"))(cfg)
    return model.eval().to(getattr(torch, dtype))


def _experts(model: Any) -> dict[str, Any]:
    return {n: m for n, m in model.named_modules() if type(m).__name__ in EXPERTS}


def _run(model: Any, ids: Any, plant: Any = None) -> tuple[Any, dict[str, tuple[Any, ...]]]:
    """dmlib's record of one forward, and each experts module's inputs seen by plain hooks."""
    seen: dict[str, tuple[Any, ...]] = {}
    hs = [
        m.register_forward_pre_hook(
            lambda m, a, n=n: seen.__setitem__(n, tuple(x.detach().clone() for x in a))
        )
        for n, m in _experts(model).items()
    ]
    try:
        with torch.no_grad(), plant or _Nothing(), record_expert_rows(model) as rec:
            model(input_ids=ids)
    finally:
        for h in hs:
            h.remove()
    return rec, seen


class _Nothing(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _digest(row: Any) -> str:
    return hashlib.sha256(row.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _per_group(x: Any, experts: Any, weight: Any) -> Any:
    """``F.linear`` per expert on its rows of ``x`` (in their order), rows put back in place."""
    out = torch.empty(x.shape[0], weight.shape[1], dtype=x.dtype)
    for e in experts.unique().tolist():
        sel = (experts == e).nonzero().flatten()
        out[sel] = F.linear(x[sel], weight[e])
    return out


def _oracle(mod: Any, hidden: Any, index: Any, impl: str) -> dict[tuple[int, int, str], str]:
    """Each (expert, token, stage) row recomputed in the implementation's order and op."""
    k = index.shape[1]
    gate = mod.act_fn
    rows: dict[tuple[int, int, str], str] = {}
    if impl == "eager":
        for e in index.unique().tolist():
            _, tok = torch.where((index == e).T)
            gu = F.linear(hidden[tok], mod.gate_up_proj[e])
            g, u = gu.chunk(2, dim=-1)
            dn = F.linear(gate(g) * u, mod.down_proj[e])
            for r, t in enumerate(tok.tolist()):
                rows[(e, t, STAGES[0])], rows[(e, t, STAGES[1])] = _digest(gu[r]), _digest(dn[r])
        return rows
    flat = index.reshape(-1)
    if impl == "grouped_mm":
        perm = torch.sort(flat).indices  # the same values sorted again: the same order
        experts = flat[perm]
        gu = _per_group(hidden[perm // k], experts, mod.gate_up_proj)
        g, u = gu.chunk(2, dim=-1)
        dn = _per_group(gate(g) * u, experts, mod.down_proj)
    else:
        perm, experts = torch.arange(flat.numel()), flat
        x = hidden.repeat_interleave(k, dim=0)
        gu = torch.bmm(mod.gate_up_proj[flat], x.unsqueeze(-1)).squeeze(-1)
        g, u = gu.chunk(2, dim=-1)
        dn = torch.bmm(mod.down_proj[flat], (gate(g) * u).unsqueeze(-1)).squeeze(-1)
    for i, (p, e) in enumerate(zip(perm.tolist(), experts.tolist(), strict=True)):
        rows[(e, p // k, STAGES[0])], rows[(e, p // k, STAGES[1])] = _digest(gu[i]), _digest(dn[i])
    return rows


def _want(model: Any, seen: dict[str, tuple[Any, ...]], impl: str) -> dict[Any, str]:
    return {
        (n, 0, e, t, s): d
        for n, (hidden, index, *_) in seen.items()
        for (e, t, s), d in _oracle(model.get_submodule(n), hidden, index, impl).items()
    }


CASES = [(f, i, d) for f in FAMILIES for i in IMPLS for d in DTYPES]


@pytest.mark.parametrize(("family", "impl", "dtype"), CASES)
def test_rows_alone_and_packed_equal_the_recomputation(family: str, impl: str, dtype: str) -> None:
    model = _model(family, dtype)
    model.set_experts_implementation(impl)
    a, seen_a = _run(model, PROBE)
    b, seen_b = _run(model, torch.cat([OTHER, PROBE]))  # the probe is flat tokens 12..23
    assert sorted(seen_a) == sorted(_experts(model)) and len(seen_a) == 2
    assert a.not_judged == {} and b.not_judged == {}
    wa, wb = _want(model, seen_a, impl), _want(model, seen_b, impl)
    assert a.rows == wa
    assert b.rows == wb
    res = compare_expert_rows(a, b, tokens={t: 12 + t for t in range(12)})
    wb_probe = {(n, c, e, t - 12, s): d for (n, c, e, t, s), d in wb.items() if t >= 12}
    common = wa.keys() & wb_probe.keys()
    differ = sorted(key for key in common if wa[key] != wb_probe[key])
    assert res["differ"] == differ
    assert res["identical"] == len(common) - len(differ)
    assert res["one_side"] == sorted(wa.keys() ^ wb_probe.keys())
    assert res["not_judged"] == {}


class _Plant(TorchFunctionMode):
    """+1 ULP on element 0 of token ``token``'s down_proj output row of expert ``expert``
    in ``mod``, whichever implementation runs; the row is found by content (its gate_up
    input equals the token's hidden row, inside the expert's group or beside its
    weights), never by an assumed order."""

    def __init__(self, mod: Any, expert: int, token: int) -> None:
        super().__init__()
        self.mod, self.e, self.t = mod, expert, token
        self.hidden: Any = None
        self.row: int | None = None
        self.done = 0
        self.handles = [
            mod.register_forward_pre_hook(lambda m, a: setattr(self, "hidden", a[0].clone())),
            mod.register_forward_hook(lambda *_: setattr(self, "hidden", None)),
        ]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.hidden is None or len(args) < 2:
            return out
        fallback = torch.ops.transformers.grouped_mm_fallback
        with torch._C.DisableTorchFunction():
            if func is F.linear:
                return self._linear(args[0], args[1], out)
            if func in (torch._grouped_mm, fallback, fallback.default):
                return self._grouped(args[0], args[1], kwargs["offs"], out)
            if func is torch.bmm:
                return self._bmm(args[0], args[1], out)
        return out

    def _hits(self, x: Any, rows: Any) -> int:
        hits = [r for r in rows if torch.equal(x[r].reshape(-1), self.hidden[self.t])]
        assert len(hits) == 1
        return hits[0]

    def _bump(self, out: Any, index: tuple[Any, ...]) -> Any:
        out = out.clone()
        out[index] = torch.nextafter(out[index], torch.tensor(float("inf"), dtype=out.dtype))
        self.done += 1
        return out

    def _linear(self, x: Any, w: Any, out: Any) -> Any:
        if w.data_ptr() == self.mod.gate_up_proj[self.e].data_ptr():
            self.row = self._hits(x, range(x.shape[0]))
        elif w.data_ptr() == self.mod.down_proj[self.e].data_ptr():
            return self._bump(out, (self.row, 0))
        return out

    def _grouped(self, x: Any, w: Any, offs: Any, out: Any) -> Any:
        if w.data_ptr() == self.mod.gate_up_proj.data_ptr():
            start = int(offs[self.e - 1]) if self.e else 0
            self.row = self._hits(x, range(start, int(offs[self.e])))
        elif w.data_ptr() == self.mod.down_proj.data_ptr():
            return self._bump(out, (self.row, 0))
        return out

    def _bmm(self, w: Any, x: Any, out: Any) -> Any:
        if w.shape[1:] == self.mod.gate_up_proj.shape[1:]:
            rows = [
                s for s in range(w.shape[0]) if torch.equal(w[s], self.mod.gate_up_proj[self.e])
            ]
            self.row = self._hits(x, rows)
        elif w.shape[1:] == self.mod.down_proj.shape[1:]:
            return self._bump(out, (self.row, 0, 0))
        return out


@pytest.mark.parametrize(("family", "impl", "dtype"), CASES)
def test_planted_ulp_named_at_its_expert_and_token(family: str, impl: str, dtype: str) -> None:
    model = _model(family, dtype)
    model.set_experts_implementation(impl)
    a, seen = _run(model, PROBE)
    name = sorted(seen)[-1]  # the last layer's experts: nothing after them is recorded
    expert = int(seen[name][1][4, 1])  # token 4's second choice, from the plain hook
    plant = _Plant(model.get_submodule(name), expert, 4)
    try:
        b, _ = _run(model, PROBE, plant)
    finally:
        for h in plant.handles:
            h.remove()
    assert plant.done == 1
    res = compare_expert_rows(a, b)
    assert res["differ"] == [(name, 0, expert, 4, "down_proj")]
    n_pairs = sum(int(s[1].numel()) for s in seen.values())
    assert res["identical"] == 2 * n_pairs - 1
    assert res["one_side"] == [] and res["not_judged"] == {}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_same_keys_under_every_implementation(family: str, dtype: str) -> None:
    # one experts module called on the same inputs under each implementation: the same
    # routing by construction, so the same (expert, token, stage) keys; values not compared
    model = _model(family, dtype)
    model.set_experts_implementation("eager")
    _, seen = _run(model, torch.cat([OTHER, PROBE]))
    name = sorted(seen)[0]
    hidden, index, weights = seen[name]
    want = {(name, 0, int(e), t, s) for t in range(24) for e in index[t] for s in STAGES}
    assert len(want) == 2 * 24 * 2
    for impl in IMPLS:
        model.set_experts_implementation(impl)
        with torch.no_grad(), record_expert_rows(model) as rec:
            model.get_submodule(name)(hidden, index, weights)
        assert rec.not_judged == {}, impl
        assert set(rec.rows) == want, impl
    # the whole model under each implementation: each module's keys are its own routing's
    # (seen by plain hooks), and the first experts module, whose input no experts
    # computation precedes, has the same keys under all three
    first = {}
    for impl in IMPLS:
        model.set_experts_implementation(impl)
        rec, seen = _run(model, torch.cat([OTHER, PROBE]))
        assert set(rec.rows) == {
            (n, 0, int(e), t, s)
            for n, (_, ix, _) in seen.items()
            for t in range(24)
            for e in ix[t]
            for s in STAGES
        }
        first[impl] = {key for key in rec.rows if key[0] == name}
    assert first["eager"] == first["grouped_mm"] == first["batched_mm"] == want


class _Seen(TorchFunctionMode):
    """The names of the torch functions called, as a plain mode sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(str(getattr(func, "__name__", func)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("entry", ["default", "fallback_op", "no_F_grouped_mm"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_mm_entries(entry: str, dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers' _grouped_mm calls F.grouped_mm where torch has it (on CPU from torch
    # 2.10; F.grouped_mm is plain Python calling torch._grouped_mm, which is what a mode
    # sees), torch._grouped_mm where only that exists, and its own registered op where
    # neither can be used; each is read the same way
    moe = pytest.importorskip("transformers.integrations.moe")
    if entry == "fallback_op":
        monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *a: False)
    elif entry == "no_F_grouped_mm":
        monkeypatch.delattr(torch.nn.functional, "grouped_mm", raising=False)
    model = _model("qwen3_moe", dtype)
    model.set_experts_implementation("grouped_mm")
    seen_ops = _Seen()
    rec, seen = _run(model, torch.cat([OTHER, PROBE]), seen_ops)
    want_op = "grouped_mm_fallback" if entry == "fallback_op" else "_grouped_mm"
    assert seen_ops.names.count(want_op) == 2 * len(seen)  # two grouped matmuls a call
    assert rec.not_judged == {}
    assert rec.rows == _want(model, seen, "grouped_mm")


def _fresh() -> Any:
    cfg = _config("qwen3_moe")
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def test_other_implementation_not_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = pytest.importorskip("transformers.integrations.moe")
    # an implementation of another name (as deepgemm or sonicmoe would be): its kernels
    # are not read, whatever it calls
    mapping = moe.ExpertsInterface._global_mapping
    monkeypatch.setitem(mapping, "dmlib_test", mapping["batched_mm"])
    model = _fresh()
    model.set_experts_implementation("dmlib_test")
    rec, seen = _run(model, PROBE)
    assert len(seen) == 2
    assert rec.rows == {}
    assert sorted(rec.not_judged) == sorted(seen)
    assert all("'dmlib_test'" in r for r in rec.not_judged.values())
    res = compare_expert_rows(rec, rec)
    assert res["identical"] == 0 and res["differ"] == [] and len(res["not_judged"]) == 2


def test_grouped_mm_unseen_is_not_judged(monkeypatch: pytest.MonkeyPatch) -> None:
    # grouped_mm run where no torch function mode sees it: no sort, no matmul observed,
    # so no row is mapped to a token and the module is not judged (never identical)
    moe = pytest.importorskip("transformers.integrations.moe")
    real = moe.ExpertsInterface._global_mapping["grouped_mm"]

    def hidden_run(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return real(*args, **kwargs)

    monkeypatch.setitem(moe.ExpertsInterface._global_mapping, "grouped_mm", hidden_run)
    model = _fresh()
    model.set_experts_implementation("grouped_mm")
    rec, seen = _run(model, PROBE)
    assert rec.rows == {}
    assert sorted(rec.not_judged) == sorted(seen)
    assert all("stages recorded: none" in r for r in rec.not_judged.values())


def test_token_routed_twice_to_one_expert_not_judged() -> None:
    model = _fresh()
    model.set_experts_implementation("grouped_mm")
    name = sorted(_experts(model))[0]
    hidden = torch.randn(3, 32, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([[1, 2], [3, 3], [0, 5]])  # token 1 twice to expert 3
    with torch.no_grad(), record_expert_rows(model) as rec:
        model.get_submodule(name)(hidden, index, torch.full((3, 2), 0.5))
    assert rec.not_judged == {name: "a token routed twice to one expert"}
    assert compare_expert_rows(rec, rec)["identical"] == 0


def _ties_reversed(flat: Any) -> Any:
    """A valid sort of ``flat`` whose equal values keep the reverse of their order (as an
    unstable sort may): the permutation, by hand."""
    order = sorted(range(flat.numel()), key=lambda i: (int(flat[i]), -i))
    return torch.tensor(order)


class _UnstableSort(TorchFunctionMode):
    """torch.sort of a 1-D integer tensor answered with :func:`_ties_reversed`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.sort, torch.Tensor.sort) and args[0].dim() == 1:
            with torch._C.DisableTorchFunction():
                if not args[0].is_floating_point():
                    perm = _ties_reversed(args[0])
                    return type(out)((args[0][perm], perm))
        return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_mm_rows_follow_the_permutation_the_sort_returned(dtype: str) -> None:
    # the sort's ties answered in reverse order: the rows within each expert's group are
    # then in another order than a stable sort's, and each must still land on its token
    model = _model("mixtral", dtype)
    model.set_experts_implementation("grouped_mm")
    rec, seen = _run(model, torch.cat([OTHER, PROBE]), _UnstableSort())
    assert rec.not_judged == {}
    want = {}
    for n, (hidden, index, *_) in seen.items():
        mod, flat = model.get_submodule(n), index.reshape(-1)
        perm = _ties_reversed(flat)
        assert not torch.equal(perm, torch.sort(flat, stable=True).indices)
        experts = flat[perm]
        gu = _per_group(hidden[perm // 2], experts, mod.gate_up_proj)
        g, u = gu.chunk(2, dim=-1)
        dn = _per_group(mod.act_fn(g) * u, experts, mod.down_proj)
        for i, (p, e) in enumerate(zip(perm.tolist(), experts.tolist(), strict=True)):
            want[(n, 0, e, p // 2, STAGES[0])] = _digest(gu[i])
            want[(n, 0, e, p // 2, STAGES[1])] = _digest(dn[i])
    assert rec.rows == want


class _LyingSort(TorchFunctionMode):
    """torch.sort of a 1-D integer tensor answered with the right values but the identity
    permutation: transformers then groups rows by the values while gathering by the
    permutation, so no row's expert can be told from the sort."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.sort, torch.Tensor.sort) and args[0].dim() == 1:
            with torch._C.DisableTorchFunction():
                if not args[0].is_floating_point():
                    return type(out)((out.values, torch.arange(args[0].numel())))
        return out


def test_grouped_mm_rows_whose_groups_disagree_with_the_sort_not_judged() -> None:
    model = _model("qwen3_moe", "float32")
    model.set_experts_implementation("grouped_mm")
    rec, seen = _run(model, PROBE, _LyingSort())
    flat = seen[sorted(seen)[0]][1].reshape(-1)
    assert not torch.equal(flat, flat.sort().values)  # the identity does not sort it
    assert rec.rows == {}
    assert sorted(rec.not_judged) == sorted(seen)
    assert all("groups do not hold the experts" in r for r in rec.not_judged.values())
