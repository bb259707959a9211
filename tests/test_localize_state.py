"""The state a forward pass leaves in its cache, captured and judged (kind ``state``).

A tiny random-init ``Qwen3NextForCausalLM`` from its config (3 Gated DeltaNet layers on the
torch fallback, 1 attention layer, MoE), bfloat16, under ``generate()``. Differences are
planted in the cache after the prefill (a forward hook on the model edits layer 0's
recurrent state in place), never left to this CPU. The oracle walks the cache by hand in
a plain forward hook: each layer's ``recurrent_states``/``conv_states`` and ``keys``/
``values``, the probe's batch row (and, for keys/values, its positions) compared with
``torch.equal``.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dmlib.cli._common import EXIT_INCONCLUSIVE, exit_code  # noqa: E402
from dmlib.localize.boundaries import CaptureVerdict, compare_captures  # noqa: E402
from dmlib.localize.capture import open_capture  # noqa: E402
from dmlib.localize.capture.states import state_tensors  # noqa: E402
from dmlib.localize.hf import capture_generate, row_map_from_attention_mask  # noqa: E402

pytestmark = pytest.mark.slow  # a few captures of generate(): about 30 s in all

VOCAB, N_PROBE, PAD = 64, 12, 0
STATE0 = "(model):state.layers.0.recurrent_states.0"


def hybrid():
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=64, pad_token_id=PAD,
    )  # fmt: skip
    assert cfg.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    return transformers.Qwen3NextForCausalLM(cfg).eval().to(torch.bfloat16)


def probe_ids():
    return torch.randint(1, VOCAB, (1, N_PROBE), generator=torch.Generator().manual_seed(1))


def batch_kwargs(padded: bool):
    """(generate kwargs, row map, the probe's batch row, its left padding)."""
    probe = probe_ids()
    if not padded:
        mask = torch.ones(1, N_PROBE, dtype=torch.long)
        return {"input_ids": probe, "attention_mask": mask}, ["probe"], 0, 0
    g = torch.Generator().manual_seed(2)
    lens = [N_PROBE + 3, 9, N_PROBE, 5]  # the probe is row 2, left-padded by 3
    width = max(lens)
    ids = torch.full((4, width), PAD, dtype=torch.long)
    mask = torch.zeros(4, width, dtype=torch.long)
    for r, n in enumerate(lens):
        ids[r, width - n :] = probe[0] if r == 2 else torch.randint(1, VOCAB, (n,), generator=g)
        mask[r, width - n :] = 1
    return {"input_ids": ids, "attention_mask": mask}, ["o0", "o1", "probe", "o3"], 2, 3


class CacheWalk:
    """A plain forward hook on the model: the oracle's copy of every state after pass 0,
    walked by hand (not by dmlib's walk); with ``plant``, it first edits layer 0's
    recurrent state of batch row ``row`` in place (``plant(state_row)``)."""

    def __init__(self, model, row: int, plant=None) -> None:
        self.row, self.plant, self.calls, self.after_prefill = row, plant, 0, None
        self.handle = model.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, mod, args, kwargs, out):
        cache = out.past_key_values
        if self.calls == 0:
            if self.plant is not None:
                self.plant(cache.layers[0].recurrent_states[0][self.row])
            states = {}
            for i, layer in enumerate(cache.layers):
                for part in ("conv_states", "recurrent_states"):
                    if isinstance(getattr(layer, part, None), dict):
                        states[f"layers.{i}.{part}.0"] = getattr(layer, part)[0].clone()
                for part in ("keys", "values"):
                    if torch.is_tensor(getattr(layer, part, None)):
                        states[f"layers.{i}.{part}"] = getattr(layer, part).clone()
            self.after_prefill = states
        self.calls += 1

    def remove(self) -> None:
        self.handle.remove()


def one_ulp(row):
    """+1 ULP (one step of the bit pattern) in element 3 of a float32 state row."""
    assert row.dtype == torch.float32
    row.reshape(-1)[3:4].view(torch.int32).add_(1)


def run(model, path, padded, plant=None, new_tokens=2):
    kw, ids, row, pad = batch_kwargs(padded)
    rows = row_map_from_attention_mask(kw["attention_mask"], ids)
    walk = CacheWalk(model, row, plant)
    try:
        gen = dict(kw, max_new_tokens=new_tokens, do_sample=False)
        capture_generate(model, path, row_map=rows, generate_kwargs=gen)
    finally:
        walk.remove()
    return walk.after_prefill, row, pad


def oracle_differs(a, b) -> set[str]:
    """The states whose probe rows differ after the prefill, by torch.equal."""
    (sa, ra, pa), (sb, rb, pb) = a, b
    out = set()
    for k in sa:
        x, y = sa[k][ra], sb[k][rb]
        if k.endswith(("keys", "values")):  # (heads, positions, dim): the probe's positions
            x, y = x[:, pa:], y[:, pb:]
        if not torch.equal(x, y):
            out.add(k)
    return out


def dmlib_states(df, step: int = 0) -> dict[str, bool | None]:
    """Step ``step``'s state boundaries: path in the cache -> identical (None: not judged)."""
    suffix = "" if step == 0 else f"#{step}"
    out = {}
    for name, same in zip(df["boundary"], df["identical"], strict=True):
        if ":state." in name and name.endswith(suffix) and (step or "#" not in name):
            key = name.split(":state.", 1)[1].removesuffix(suffix)
            out[key] = None if same is pd_na() else bool(same)
    return out


def pd_na():
    import pandas as pd

    return pd.NA


def test_every_cache_tensor_is_a_state_boundary(tmp_path):
    model = hybrid()
    chosen: dict[str, list] = {}  # the oracle: each router's indices output, plain hooks
    hooks = [
        model.model.layers[i].mlp.gate.register_forward_hook(
            lambda mod, args, out, i=i: chosen.setdefault(f"model.layers.{i}.mlp.gate", []).append(
                out[2].clone()
            )
        )
        for i in range(4)
    ]
    try:
        got, _, _ = run(model, tmp_path / "a", padded=False, new_tokens=1)
    finally:
        for h in hooks:
            h.remove()
    c = open_capture(tmp_path / "a")
    names = {b.name.split(":state.", 1)[1] for b in c if b.state and b.step == 0}
    assert names == set(got)  # the hand walk's tensors, no more, no fewer
    assert all(b.category.name == "state" for b in c if b.state)
    # the MoE routers (Qwen3NextTopKRouter) of the 4 layers, each pass: ids and margins
    routers = {b.module for b in c if b.router}
    assert routers == {f"model.layers.{i}.mlp.gate" for i in range(4)}
    assert all(b.category.name == "router" for b in c if b.router)
    from dmlib.localize.routing import values

    for name, outs in chosen.items():
        x = c.boundary(f"{name}:router.indices")  # the prefill's call
        assert np.array_equal(values(c, x), outs[0].numpy())


def test_one_ulp_in_a_recurrent_state_is_found_at_that_state(tmp_path):
    model = hybrid()
    a = run(model, tmp_path / "a", padded=False)
    b = run(model, tmp_path / "b", padded=False, plant=one_ulp)
    assert oracle_differs(a, b) == {"layers.0.recurrent_states.0"}
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    states = dmlib_states(df)
    assert {k for k, v in states.items() if v is False} == {"layers.0.recurrent_states.0"}
    assert df.attrs["first_divergent_boundary"] == STATE0
    assert df.attrs["culprit"] == STATE0
    assert df.attrs["steps"][0]["first_divergent_boundary"] == STATE0


def test_a_decode_step_is_judged_with_the_state_it_consumed(tmp_path):
    model = hybrid()

    def doubled(row):  # a planted difference big enough to reach the next pass's outputs
        row.mul_(2.0)

    run(model, tmp_path / "a", padded=False)
    run(model, tmp_path / "b", padded=False, plant=doubled)
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    step1 = df.attrs["steps"][1]
    assert step1["first_divergent_boundary"] is not None
    assert step1["state_consumed"] == STATE0
    by = df.set_index("boundary")
    assert by.loc[step1["first_divergent_boundary"], "role"] == "carrier"
    # nothing in pass 1 is blamed: the difference came in with the state
    assert step1["culprit"] is None


def test_alone_against_left_padded_batch_states_match_the_hand_walk(tmp_path):
    model = hybrid()
    a = run(model, tmp_path / "a", padded=False)
    b = run(model, tmp_path / "b", padded=True, plant=one_ulp)
    expected = oracle_differs(a, b)
    assert "layers.0.recurrent_states.0" in expected  # planted
    df = compare_captures(tmp_path / "a", tmp_path / "b", request="probe")
    states = dmlib_states(df)
    assert set(states) == set(a[0])
    assert None not in states.values()  # the probe fills its batch row alone: all judged
    assert {k for k, v in states.items() if v is False} == expected
    assert df.attrs["status"] == "different"


def test_a_state_not_judged_is_never_identical(tmp_path):
    """A packed row (two requests sharing batch row 0) cannot be split per sequence: its
    states are unjudged with the reason, and the verdict is not 'identical'."""
    model = hybrid()
    probe = probe_ids()
    other = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(5))
    both = torch.cat([probe, other], dim=1)
    kw = {"input_ids": both, "attention_mask": torch.ones_like(both), "max_new_tokens": 1,
          "do_sample": False}  # fmt: skip
    rows = [[("probe", i) for i in range(N_PROBE)] + [("x", i) for i in range(4)]]
    for side in ("a", "b"):
        capture_generate(model, tmp_path / side, row_map=rows, generate_kwargs=kw)
    df = compare_captures(tmp_path / "a", tmp_path / "b", request="probe")
    un = [u for u in df.attrs["unjudged"] if ":state." in u["boundary"]]
    assert un and all("also holds request(s)" in u["reason"] for u in un)
    v = CaptureVerdict.of(df)
    assert v.status == "inconclusive" and exit_code(v) == EXIT_INCONCLUSIVE


def test_the_walk_finds_tensors_by_attribute_not_by_class():
    """A cache of a class dmlib never heard of: every tensor in its attributes, lists,
    tuples and dicts is found; 0-d counters are not states."""

    class Layer:
        def __init__(self):
            self.keys = torch.zeros(2, 1, 5, 4)
            self.values = torch.ones(2, 1, 5, 4)
            self.ssm = {0: torch.zeros(2, 3, 3)}
            self.count = torch.tensor(5)

    class Odd:
        def __init__(self):
            self.layers = [Layer(), Layer()]
            self.extra = (torch.zeros(2, 7),)

    from dmlib.localize.capture.states import find_cache

    odd = Odd()
    assert find_cache((torch.zeros(1), odd)) == ("output1", odd)  # return_dict=False
    assert find_cache((torch.zeros(1),)) is None
    found = {slot: how for slot, _, how in state_tensors(odd)}
    assert found == {
        "state.layers.0.keys": "positions", "state.layers.0.values": "positions",
        "state.layers.0.ssm.0": "batch", "state.layers.1.keys": "positions",
        "state.layers.1.values": "positions", "state.layers.1.ssm.0": "batch",
        "state.extra.0": "batch",
    }  # fmt: skip


def test_mamba_states_are_captured_and_a_planted_ulp_found(tmp_path):
    """A Mamba model (float32): its conv and SSM states, walked by hand after the prefill,
    are the capture's state boundaries, and +1 ULP in layer 1's SSM state is found there."""
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8,
                                   num_hidden_layers=2, conv_kernel=4, expand=2)  # fmt: skip
    model = transformers.MambaForCausalLM(cfg).eval()
    ids = probe_ids()
    rows = row_map_from_attention_mask(torch.ones(1, N_PROBE), ["probe"])
    got = {}
    for side, plant in (("a", False), ("b", True)):
        seen = []

        def hook(mod, args, kwargs, out, plant=plant, seen=seen):
            if not seen:
                layers = out.past_key_values.layers
                if plant:
                    one_ulp(layers[1].recurrent_states[0][0])
                seen.append({f"layers.{i}.{part}.0": getattr(layer, part)[0].clone()
                             for i, layer in enumerate(layers)
                             for part in ("conv_states", "recurrent_states")})  # fmt: skip

        h = model.register_forward_hook(hook, with_kwargs=True)
        try:
            gen = {"input_ids": ids, "max_new_tokens": 2, "do_sample": False}
            capture_generate(model, tmp_path / side, row_map=rows, generate_kwargs=gen)
        finally:
            h.remove()
        got[side] = seen[0]
    expected = {k for k in got["a"] if not torch.equal(got["a"][k], got["b"][k])}
    assert expected == {"layers.1.recurrent_states.0"}
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    states = dmlib_states(df)
    assert set(states) == set(got["a"])
    assert {k for k, v in states.items() if v is False} == expected
    assert df.attrs["first_divergent_boundary"] == "(model):state.layers.1.recurrent_states.0"
