"""Expert internals judged per (expert, token) on a tiny random-init Qwen3-MoE.

Oracle: the routing seen by a plain forward pre-hook on each experts module, and, for
the planted run, the expert and token the plant touched, worked out in the test from
that routing; the plant itself adds 1 ULP to one row of one expert's down_proj output
through a TorchFunctionMode of the test's own."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.overrides import TorchFunctionMode  # noqa: E402

from dmlib.localize.experts import (  # noqa: E402
    compare_expert_rows,
    experts_modules,
    record_expert_rows,
)


def _model(impl: str = "eager") -> object:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        max_position_embeddings=64,
    )
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).eval()


IDS = torch.tensor([[5, 9, 1, 33, 7, 60, 2, 18, 44, 3, 12, 27]])


class _Plant(TorchFunctionMode):
    """+1 ULP on token ``token``'s row of expert ``expert``'s down_proj output in module
    ``mod``; the row is the one whose gate_up_proj input equals the token's hidden row (as
    the experts module received it), found here without any assumption on the order."""

    def __init__(self, mod: object, expert: int, token: int) -> None:
        super().__init__()
        self.mod, self.expert, self.token = mod, expert, token
        self.hidden: torch.Tensor | None = None
        self.row: int | None = None
        self.done = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is not torch.nn.functional.linear or self.hidden is None or len(args) < 2:
            return out
        with torch._C.DisableTorchFunction():
            if args[1].data_ptr() == self.mod.gate_up_proj[self.expert].data_ptr():
                hits = [
                    r
                    for r in range(args[0].shape[0])
                    if torch.equal(args[0][r], self.hidden[self.token])
                ]
                assert len(hits) == 1
                self.row = hits[0]
            elif args[1].data_ptr() == self.mod.down_proj[self.expert].data_ptr():
                out = out.clone()
                out[self.row, 0] = torch.nextafter(out[self.row, 0], torch.tensor(float("inf")))
                self.done += 1
        return out


def _routing(model: object, ids: torch.Tensor = IDS) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    hs = []
    for name, mod in model.named_modules():  # type: ignore[attr-defined]
        if type(mod).__name__ == "Qwen3MoeExperts":
            hs.append(
                mod.register_forward_pre_hook(
                    lambda m, a, n=name: seen.__setitem__(n, a[1].clone())
                )
            )
    with torch.no_grad():
        model(input_ids=ids)  # type: ignore[operator]
    for h in hs:
        h.remove()
    return seen


def test_planted_ulp_found_at_its_expert_and_token() -> None:
    model = _model()
    routing = _routing(model)
    assert sorted(routing) == [n for n, _ in experts_modules(model)]
    name = "model.layers.1.mlp.experts"
    index = routing[name]
    expert = int(index[4, 1])  # token 4's second choice
    with torch.no_grad(), record_expert_rows(model) as a:
        model(input_ids=IDS)
    mod = model.get_submodule(name)
    plant = _Plant(mod, expert, 4)
    h1 = mod.register_forward_pre_hook(lambda m, args: setattr(plant, "hidden", args[0].clone()))
    h2 = mod.register_forward_hook(lambda *_: setattr(plant, "hidden", None))
    with torch.no_grad(), plant, record_expert_rows(model) as b:  # the plant runs under the record
        model(input_ids=IDS)
    h1.remove()
    h2.remove()
    assert plant.done == 1
    res = compare_expert_rows(a, b)
    assert res["differ"] == [(name, 0, expert, 4, "down_proj")]
    # every routed (expert, token) pair of both layers, two stages each, judged
    n_pairs = sum(int(ix.numel()) for ix in routing.values())
    assert res["identical"] == 2 * n_pairs - 1
    assert res["one_side"] == [] and res["not_judged"] == {}


def test_token_routed_in_one_run_only_is_not_counted_identical() -> None:
    model = _model()
    with torch.no_grad(), record_expert_rows(model) as a:
        model(input_ids=IDS)
    with torch.no_grad(), record_expert_rows(model) as b:
        model(input_ids=IDS[:, :6])
    res = compare_expert_rows(a, b)
    # by hand from plain hooks: the (expert, token) pairs routed in one run only
    pairs_a = {
        (n, int(ix[t, k]), t)
        for n, ix in _routing(model).items()
        for t in range(12)
        for k in range(2)
    }
    pairs_b = {
        (n, int(ix[t, k]), t)
        for n, ix in _routing(model, IDS[:, :6]).items()
        for t in range(6)
        for k in range(2)
    }
    stages = ("gate_up_proj", "down_proj")
    assert set(res["one_side"]) == {
        (n, 0, e, t, s) for n, e, t in pairs_a ^ pairs_b for s in stages
    }
    assert res["identical"] + len(res["differ"]) == 2 * len(pairs_a & pairs_b)
    assert any(t >= 6 for _, _, _, t, _ in res["one_side"])


def test_grouped_mm_judged_for_every_routed_pair() -> None:
    # grouped_mm's row order is observed (the sort's permutation), so every routed
    # (expert, token) pair of both layers has its two rows, as under eager; the rows'
    # values against a recomputation by hand: tests/test_localize_experts_impls.py
    model = _model("grouped_mm")
    with torch.no_grad(), record_expert_rows(model) as a:
        model(input_ids=IDS)
    assert a.not_judged == {}
    want = {
        (n, 0, int(ix[t, k]), t, s)
        for n, ix in _routing(model).items()
        for t in range(12)
        for k in range(2)
        for s in ("gate_up_proj", "down_proj")
    }
    assert set(a.rows) == want


class _Oracle(TorchFunctionMode):
    """Plain record of each expert's gate_up_proj / down_proj output rows, each row's token
    found by its gathered input equal to that token's hidden row (no assumed order)."""

    def __init__(self, model: object) -> None:
        super().__init__()
        self.mods = {
            n: m for n, m in model.named_modules() if type(m).__name__ == "Qwen3MoeExperts"
        }  # type: ignore[attr-defined]
        self.hidden: tuple[str, torch.Tensor] | None = None
        self.tokens: list[int] = []
        self.rows: dict[tuple[str, int, int, str], bytes] = {}
        for n, m in self.mods.items():
            m.register_forward_pre_hook(
                lambda m, a, n=n: setattr(self, "hidden", (n, a[0].clone()))
            )
            m.register_forward_hook(lambda *_: setattr(self, "hidden", None))

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is not torch.nn.functional.linear or self.hidden is None or len(args) < 2:
            return out
        name, hidden = self.hidden
        mod = self.mods[name]
        with torch._C.DisableTorchFunction():
            for stage in ("gate_up_proj", "down_proj"):
                for e in range(getattr(mod, stage).shape[0]):
                    if args[1].data_ptr() != getattr(mod, stage)[e].data_ptr():
                        continue
                    if stage == "gate_up_proj":
                        self.tokens = []
                        for r in range(args[0].shape[0]):
                            hits = [
                                t
                                for t in range(hidden.shape[0])
                                if torch.equal(args[0][r], hidden[t])
                            ]
                            assert len(hits) == 1
                            self.tokens.append(hits[0])
                    for r, t in enumerate(self.tokens):
                        self.rows[(name, e, t, stage)] = out[r].numpy().tobytes()
        return out


def test_request_alone_against_packed_with_planted_ulp() -> None:
    model = _model()
    name = "model.layers.0.mlp.experts"
    expert = int(_routing(model)[name][4, 0])  # token 4's first choice, alone
    other = torch.tensor([[40, 41, 8, 6, 50, 11, 13, 21, 30, 35, 36, 38]])
    packed = torch.cat([other, IDS])
    oa, ob = _Oracle(model), _Oracle(model)
    mod = model.get_submodule(name)
    plant = _Plant(mod, expert, 4)
    h1 = mod.register_forward_pre_hook(lambda m, args: setattr(plant, "hidden", args[0].clone()))
    h2 = mod.register_forward_hook(lambda *_: setattr(plant, "hidden", None))
    with torch.no_grad(), plant, oa, record_expert_rows(model) as a:
        model(input_ids=IDS)
    h1.remove()
    h2.remove()
    assert plant.done == 1
    with torch.no_grad(), ob, record_expert_rows(model) as b:
        model(input_ids=packed)
    res = compare_expert_rows(a, b, tokens={t: 12 + t for t in range(12)})
    # by hand from the oracle: B's rows of the probe (flat tokens 12..23) against A's
    rb = {(n, e, t - 12, s): v for (n, e, t, s), v in ob.rows.items() if t >= 12}
    common = oa.rows.keys() & rb.keys()
    want = sorted(
        (n, 0, e, t, s) for n, e, t, s in common if oa.rows[(n, e, t, s)] != rb[(n, e, t, s)]
    )
    assert res["differ"] == want
    assert (name, 0, expert, 4, "down_proj") in res["differ"]
    assert res["identical"] == len(common) - len(want)
    assert res["one_side"] == sorted((n, 0, e, t, s) for n, e, t, s in oa.rows.keys() ^ rb.keys())


def test_mode_on_the_stack_only_while_an_experts_module_runs() -> None:
    # oracle: torch's own torch-function stack depth, read by plain hooks: 1 in the
    # activation each experts module calls inside its forward, 0 in every module outside
    # the experts modules and after the block; a forward that raises inside an experts
    # module leaves nothing on the stack, and the next forward is recorded in full
    model = _model()
    experts = dict(experts_modules(model))
    inside = {f"{n}.act_fn" for n in experts}
    depth: dict[str, set[int]] = {}
    hs = [
        m.register_forward_pre_hook(
            lambda m, a, n=n: depth.setdefault(n, set()).add(torch._C._len_torch_function_stack())
        )
        for n, m in model.named_modules()  # type: ignore[attr-defined]
        if n not in experts
    ]
    first = next(iter(experts))
    boom = experts[first].act_fn.register_forward_hook(_raise)
    try:
        with torch.no_grad(), record_expert_rows(model) as out:
            with pytest.raises(RuntimeError, match="planted"):
                model(input_ids=IDS)
            assert torch._C._len_torch_function_stack() == 0
            boom.remove()
            depth.clear()
            model(input_ids=IDS)
    finally:
        boom.remove()
        for h in hs:
            h.remove()
    assert torch._C._len_torch_function_stack() == 0
    assert {n: depth[n] for n in inside} == {n: {1} for n in inside}
    assert {d for n, ds in depth.items() if n not in inside for d in ds} == {0}
    want = {
        (n, 1 if n == first else 0, int(ix[t, k]), t, s)
        for n, ix in _routing(model).items()
        for t in range(12)
        for k in range(2)
        for s in ("gate_up_proj", "down_proj")
    }
    assert out.not_judged == {}
    assert {k for k in out.rows if k[1] == (1 if k[0] == first else 0)} == want


def _raise(*_: object) -> None:
    raise RuntimeError("planted")
