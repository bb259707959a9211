"""Hybrid Mamba + MoE models through the capture: Jamba (Mamba layers, attention, MoE of
gated experts) and Nemotron-H (Mamba2 layers, attention, MoE of experts without a gate),
tiny random-init models from transformers' own configs, their Mamba mixers on the torch
fallbacks this CPU gets, float32 and bfloat16.

Every difference is planted, never left to this CPU:
- the state a forward leaves: +1 ULP (one step of the bit pattern) in one element of
  layer 0's Mamba recurrent (SSM) state of the probe's batch row, written into the cache
  object by a plain forward hook on the model right after the prefill. The oracle walks
  the cache by hand in that hook (each layer's ``conv_states`` / ``recurrent_states`` and
  ``keys`` / ``values``; the probe's batch row, and its own positions of keys/values),
  compared with ``torch.equal``;
- a router near-tie: the logits the router's own ``F.linear`` returns rewritten for one
  token, the (k+1)-th expert put a few steps below the k-th in run A and above it in run
  B. The oracle recomputes the scores the router ranks by (Jamba: softmax in float32;
  Nemotron-H: float32 logits, sigmoid plus its correction bias) and takes ``torch.topk``
  by hand; the ids the router returned (a plain forward hook) must equal the oracle's;
- an expert row: +1 ULP in one (expert, token) row of Nemotron-H's ``up_proj`` output, the
  row found by the test's own TorchFunctionMode (the ``F.linear`` on the expert's slice,
  its input rows matched to the tokens' hidden rows).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import numpy as np
import pandas as pd
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dmlib  # noqa: E402
from dmlib.cli._common import EXIT_INCONCLUSIVE, exit_code  # noqa: E402
from dmlib.localize.boundaries import CaptureVerdict, compare_captures  # noqa: E402
from dmlib.localize.capture import open_capture  # noqa: E402
from dmlib.localize.capture.hooks import NOT_HOOKED  # noqa: E402
from dmlib.localize.hf import capture_generate, row_map_from_attention_mask  # noqa: E402
from dmlib.localize.routing import values  # noqa: E402
from tests.test_localize_experts_layouts import PlantRow, config  # noqa: E402

FAMILIES = ("jamba", "nemotron_h")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
CASES = [(f, d) for f in FAMILIES for d in DTYPES]
VOCAB, N_PROBE, PAD, K = 64, 12, 0, 2
STATE0 = "layers.0.recurrent_states.0"  # both families: layer 0 is a Mamba layer


@functools.cache
def _model(family: str, dtype: str) -> Any:
    cfg = config(family)
    torch.manual_seed(0)
    model = getattr(transformers, type(cfg).__name__.replace("Config", "ForCausalLM"))(cfg)
    model = model.eval().to(DTYPES[dtype])
    for mod in model.modules():  # a correction bias that decides something
        if torch.is_tensor(getattr(mod, "e_score_correction_bias", None)):
            b = mod.e_score_correction_bias
            g = torch.Generator().manual_seed(3)
            b.copy_(torch.randn(b.shape, generator=g) * 0.02)
    return model


def probe_ids() -> Any:
    return torch.randint(1, VOCAB, (1, N_PROBE), generator=torch.Generator().manual_seed(1))


def batch_kwargs(padded: bool) -> tuple[dict[str, Any], list[str], int, int]:
    """(generate kwargs, request ids, the probe's batch row, its left padding)."""
    probe = probe_ids()
    if not padded:
        return {"input_ids": probe, "attention_mask": torch.ones_like(probe)}, ["probe"], 0, 0
    g = torch.Generator().manual_seed(2)
    lens = [N_PROBE + 3, 9, N_PROBE, 5]  # the probe is row 2, left-padded by 3
    width = max(lens)
    ids = torch.full((4, width), PAD, dtype=torch.long)
    mask = torch.zeros(4, width, dtype=torch.long)
    for r, n in enumerate(lens):
        ids[r, width - n :] = probe[0] if r == 2 else torch.randint(1, VOCAB, (n,), generator=g)
        mask[r, width - n :] = 1
    return {"input_ids": ids, "attention_mask": mask}, ["o0", "o1", "probe", "o3"], 2, 3


def one_ulp(t: Any) -> None:
    """+1 ULP (one step of the bit pattern) in element 3 of a float32 / bfloat16 tensor."""
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype]
    t.reshape(-1)[3:4].view(bits).add_(1)


def doubled(t: Any) -> None:
    """A planted difference big enough to reach the next pass's outputs."""
    t.mul_(2.0)


class CacheWalk:
    """A plain forward hook on the model: after pass 0 (the prefill), optionally plants
    a difference in layer 0's recurrent state of batch row ``row`` (``plant``: True for
    :func:`one_ulp`, or a function of that row), then keeps the oracle's copy of every
    state, walked by hand (not by dmlib's walk)."""

    def __init__(self, model: Any, row: int, plant: Any = False) -> None:
        self.row, self.plant, self.calls, self.after_prefill = row, plant, 0, {}
        self.handle = model.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, mod: Any, args: Any, kwargs: Any, out: Any) -> None:
        cache = out.past_key_values
        if self.calls == 0:
            if self.plant:
                how = one_ulp if self.plant is True else self.plant
                how(cache.layers[0].recurrent_states[0][self.row])
            for i, layer in enumerate(cache.layers):
                for part in ("conv_states", "recurrent_states"):
                    if isinstance(getattr(layer, part, None), dict):
                        for j, t in getattr(layer, part).items():
                            self.after_prefill[f"layers.{i}.{part}.{j}"] = t.clone()
                for part in ("keys", "values"):
                    if torch.is_tensor(getattr(layer, part, None)):
                        self.after_prefill[f"layers.{i}.{part}"] = getattr(layer, part).clone()
        self.calls += 1


def generate(model: Any, path: Any, padded: bool, plant: Any = False, **kw: Any) -> Any:
    """A capture of generate() (2 new tokens); the oracle's walk, the probe's row and padding."""
    gen, ids, row, pad = batch_kwargs(padded)
    rows = row_map_from_attention_mask(gen["attention_mask"], ids)
    walk = CacheWalk(model, row, plant)
    try:
        gen = dict(gen, max_new_tokens=2, do_sample=False)
        capture_generate(model, path, row_map=rows, generate_kwargs=gen, **kw)
    finally:
        walk.handle.remove()
    assert walk.after_prefill
    return walk.after_prefill, row, pad


def oracle_differs(a: Any, b: Any) -> set[str]:
    """The states whose probe rows differ after the prefill, by torch.equal."""
    (sa, ra, pa), (sb, rb, pb) = a, b
    assert set(sa) == set(sb)
    out = set()
    for k in sa:
        x, y = sa[k][ra], sb[k][rb]
        if k.endswith(("keys", "values")):  # (heads, positions, dim): the probe's positions
            x, y = x[:, pa:], y[:, pb:]
        if not torch.equal(x, y):
            out.add(k)
    return out


def dmlib_states(df: Any) -> dict[str, bool | None]:
    """The prefill's state boundaries: path in the cache -> identical (None: not judged)."""
    out = {}
    for name, same in zip(df["boundary"], df["identical"], strict=True):
        if ":state." in name and "#" not in name:
            out[name.split(":state.", 1)[1]] = None if same is pd.NA else bool(same)
    return out


@pytest.mark.parametrize(("family", "dt"), CASES)
def test_one_ulp_in_a_mamba_state_is_the_first_divergence(tmp_path, family, dt):
    model = _model(family, dt)
    a = generate(model, tmp_path / "a", padded=False)
    b = generate(model, tmp_path / "b", padded=False, plant=True)
    assert oracle_differs(a, b) == {STATE0}
    c = open_capture(tmp_path / "a")
    walked = {x.name.split(":state.", 1)[1] for x in c if x.state and x.step == 0}
    assert walked == set(a[0])  # the hand walk's tensors, no more, no fewer
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    states = dmlib_states(df)
    assert {k for k, v in states.items() if v is False} == {STATE0}
    assert None not in states.values()
    assert df.attrs["first_divergent_boundary"] == f"(model):state.{STATE0}"
    assert df.attrs["culprit"] == f"(model):state.{STATE0}"
    assert df.attrs["status"] == "different"


@pytest.mark.parametrize(("family", "dt"), CASES)
def test_alone_against_a_left_padded_batch_states_match_the_hand_walk(tmp_path, family, dt):
    model = _model(family, dt)
    a = generate(model, tmp_path / "a", padded=False)
    b = generate(model, tmp_path / "b", padded=True, plant=True)
    expected = oracle_differs(a, b)
    assert STATE0 in expected  # planted
    df = compare_captures(tmp_path / "a", tmp_path / "b", request="probe")
    states = dmlib_states(df)
    assert set(states) == set(a[0])
    assert None not in states.values()  # the probe fills its batch row alone: all judged
    assert {k for k, v in states.items() if v is False} == expected
    assert df.attrs["status"] == "different"


@pytest.mark.parametrize(("family", "dt"), CASES)
def test_a_decode_step_is_judged_with_the_mamba_state_it_consumed(tmp_path, family, dt):
    """Layer 0's state doubled after the prefill: decode step 1 differs, and its first
    divergent boundary is the consumed state's carrier (state_consumed), no culprit in
    that pass."""
    model = _model(family, dt)
    a = generate(model, tmp_path / "a", padded=False)
    b = generate(model, tmp_path / "b", padded=False, plant=doubled)
    assert oracle_differs(a, b) == {STATE0}
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    step1 = df.attrs["steps"][1]
    assert step1["first_divergent_boundary"] is not None
    assert step1["state_consumed"] == f"(model):state.{STATE0}"
    assert df.set_index("boundary").loc[step1["first_divergent_boundary"], "role"] == "carrier"
    assert step1["culprit"] is None


# family -> (the first MoE layer's router, its scores by hand from its logits, SCORES kind)
ROUTERS = {
    "jamba": ("model.layers.1.feed_forward.router", "softmax"),
    "nemotron_h": ("model.layers.1.mixer.gate", "sigmoid+bias"),
    "gpt_oss": ("model.layers.0.mlp.router", "logits"),  # no hybrid: its top-k is of logits
}
ROUTER_CASES = [*CASES, ("gpt_oss", "f32"), ("gpt_oss", "bf16")]
TOKEN = 6  # the planted token's position (the probe alone: its flat row too)


def scores_by_hand(router: Any, logits: Any) -> Any:
    """The scores each router ranks by, read from its forward: Jamba ``softmax(logits,
    dtype=float)``; Nemotron-H float32 logits, ``sigmoid() + e_score_correction_bias``
    (one group: its group limit leaves every expert in); GPT-OSS ``topk(logits)`` itself
    (its softmax over the chosen after)."""
    if type(router).__name__ == "JambaTopKRouter":
        return torch.nn.functional.softmax(logits, dim=-1, dtype=torch.float)
    if type(router).__name__ == "GptOssTopKRouter":
        return logits.float()
    assert logits.dtype == torch.float32 and router.num_group == 1
    return logits.sigmoid() + router.e_score_correction_bias


class NearTie:
    """Rewrites the logits the router's own ``F.linear`` returns, at row TOKEN of its first
    call: the (k+1)-th ranked expert's score set ``steps`` steps from the k-th's (negative:
    below). A step: ``2**-23`` of a float32 logit (Jamba) or of the score itself
    (Nemotron-H: the logit set so that its sigmoid plus bias lands there, in float64, then
    rounded), one bfloat16 ULP of a bfloat16 logit. Keeps the planted logits and the ids
    the router returned."""

    def __init__(self, router: Any, steps: int) -> None:
        self.router, self.steps, self.active, self.calls = router, steps, False, 0
        self.logits: list[Any] = []
        self.ids: list[Any] = []

    def __enter__(self) -> NearTie:
        self.linear = torch.nn.functional.linear
        torch.nn.functional.linear = self._linear
        self.handles = [
            self.router.register_forward_pre_hook(self._pre),
            self.router.register_forward_hook(self._post),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.nn.functional.linear = self.linear
        for h in self.handles:
            h.remove()

    def _pre(self, mod: Any, args: Any) -> None:
        self.active = self.calls == 0
        self.calls += 1

    def _post(self, mod: Any, args: Any, out: Any) -> None:
        self.active = False
        self.ids.append(out[2].clone())

    def _linear(self, x: Any, w: Any, b: Any = None) -> Any:
        y = self.linear(x, w, b)
        if not self.active:
            return y
        self.active = False  # the router's one F.linear: its logits
        y = y.clone()
        row = y[TOKEN]
        bias = getattr(self.router, "e_score_correction_bias", None)
        if bias is not None:
            score = row.double().sigmoid() + bias.double()
            order = torch.argsort(score, descending=True, stable=True)
            kth, nxt = int(order[K - 1]), int(order[K])
            p = score[kth] + self.steps * 2.0**-23 - bias.double()[nxt]
            row[nxt] = torch.log(p / (1 - p)).to(row.dtype)
        else:
            order = torch.argsort(row.float(), descending=True, stable=True)
            kth, nxt = int(order[K - 1]), int(order[K])
            if row.dtype == torch.float32:
                row[nxt] = row[kth] + self.steps * 2.0**-23
            else:
                inf = torch.tensor(float("inf") if self.steps > 0 else float("-inf"))
                v = row[kth]
                for _ in range(abs(self.steps)):
                    v = torch.nextafter(v, inf.to(row.dtype))
                row[nxt] = v
        self.logits.append(y.detach().clone())
        return y


def forward_with_tie(model: Any, family: str, path: Any, steps: int) -> tuple[NearTie, dict]:
    """One capture of the probe alone (a plain forward, no cache), a near-tie planted; and
    every router's chosen id sets per token, from plain forward hooks."""
    ids = probe_ids()
    rows = row_map_from_attention_mask(torch.ones_like(ids), ["probe"])
    router = dict(model.named_modules())[ROUTERS[family][0]]
    chosen: dict[str, list[list[int]]] = {}
    hooks = [
        m.register_forward_hook(
            lambda m, a, out, n=n: chosen.__setitem__(n, [sorted(r) for r in out[2].tolist()])
        )
        for n, m in model.named_modules()
        if type(m) is type(router)
    ]
    try:
        with NearTie(router, steps) as tie, torch.no_grad():
            with dmlib.capture(model, path, row_map=rows):
                model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    assert len(tie.logits) == 1
    return tie, chosen


def by_hand(tie: NearTie) -> tuple[list[list[int]], Any]:
    """(the top-k id set per token, (k-th, (k+1)-th) float32 scores per token), by
    torch.topk on the scores recomputed from the planted logits; the router agrees."""
    vals, idx = torch.topk(scores_by_hand(tie.router, tie.logits[0]), K + 1, dim=-1)
    sets = [sorted(int(e) for e in r) for r in idx[:, :K]]
    assert sets == [sorted(int(e) for e in r) for r in tie.ids[0]]  # as the model chose
    return sets, vals[:, K - 1 : K + 1].float().numpy()


def ulps(hi: Any, lo: Any) -> int:
    """float32 steps from ``lo`` up to ``hi`` (both positive), from their bit patterns."""
    return int(np.int64(np.float32(hi).view(np.int32)) - np.int64(np.float32(lo).view(np.int32)))


@pytest.mark.parametrize(("family", "dt"), ROUTER_CASES)
def test_a_planted_near_tie_is_a_flip_with_the_margins_by_hand(tmp_path, family, dt):
    """The planted router flips at the planted token alone; a later router may flip too
    where that flip changed its input (GPT-OSS's second layer does): every flip reported is
    one the plain hooks' id sets show, and no other."""
    model = _model(family, dt)
    ta, ca = forward_with_tie(model, family, tmp_path / "a", steps=-4)
    tb, cb = forward_with_tie(model, family, tmp_path / "b", steps=+4)
    (sa, va), (sb, vb) = by_hand(ta), by_hand(tb)
    assert [t for t in range(N_PROBE) if sa[t] != sb[t]] == [TOKEN]  # the oracle's one flip
    name, kind = ROUTERS[family]
    hooked = {(n, t) for n in ca for t in range(N_PROBE) if ca[n][t] != cb[n][t]}
    assert (name, TOKEN) in hooked and len(ca) == 2
    rep = compare_captures(tmp_path / "a", tmp_path / "b").attrs["routing"]
    assert rep["n_router_calls"] == len(ca) and rep["not_judged"] == []
    assert {(g["router"], g["position"]) for g in rep["flips"]} == hooked
    assert rep["n_flips"] == len(hooked)
    assert all((g["experts_a"], g["experts_b"]) == (ca[g["router"]][g["position"]],
               cb[g["router"]][g["position"]]) for g in rep["flips"])  # fmt: skip
    (f,) = [g for g in rep["flips"] if g["router"] == name]
    assert (f["router"], f["request"], f["position"]) == (name, "probe", TOKEN)
    assert (f["experts_a"], f["experts_b"]) == (sa[TOKEN], sb[TOKEN])
    assert f["scores"] == kind
    for side, v in (("a", va[TOKEN]), ("b", vb[TOKEN])):
        assert f[f"margin_{side}"] == float(v[0]) - float(v[1])
        assert f[f"margin_ulp_{side}"] == ulps(v[0], v[1]) > 0
    for path, v in ((tmp_path / "a", va), (tmp_path / "b", vb)):
        c = open_capture(path)  # every token's recorded (k-th, (k+1)-th) scores: the oracle's
        np.testing.assert_array_equal(values(c, c.boundary(f"{name}:router.margin")), v)
        assert "routers_unread" not in c.coverage
        assert c.coverage["router_scores"][name] == kind


# family -> (the first MoE layer's experts module, its first stage)
EXPERTS = {
    "jamba": ("model.layers.1.feed_forward.experts", "gate_up_proj"),
    "nemotron_h": ("model.layers.1.mixer.experts", "up_proj"),
}


@pytest.mark.parametrize(("family", "dt"), CASES)
def test_one_ulp_in_a_first_stage_expert_row_is_the_culprit_and_its_down_proj_a_carrier(
    tmp_path, family, dt
):
    """Under the implementation these configs default to (grouped_mm), +1 ULP in the largest
    element of one (expert, token) row of the first stage: that expert boundary is the first
    divergent and the one culprit; the same expert's down_proj row, which the plant reaches
    through the gate or activation, differs as its carrier (Nemotron-H's up_proj is its
    input, not a gate_up_proj)."""
    model = _model(family, dt)
    name, stage = EXPERTS[family]
    assert dict(model.named_modules())[name].config._experts_implementation == "grouped_mm"
    ids = probe_ids()
    rows = row_map_from_attention_mask(torch.ones_like(ids), ["probe"])
    plant = PlantRow(model, name, stage)
    try:
        for side, mode in (("a", None), ("b", plant)):
            with torch.no_grad(), mode or contextlib.nullcontext():
                with dmlib.capture(model, tmp_path / side, row_map=rows, experts=True):
                    model(input_ids=ids, use_cache=False)
    finally:
        plant.remove()
    assert plant.planted is not None
    _, _, e, token, _ = plant.planted
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    first = f"{name}:expert{e}.{stage}"
    assert df.attrs["first_divergent_boundary"] == first
    assert df.attrs["culprit"] == first
    ex = df.attrs["experts"]
    assert [(c["expert"], c["stage"], c["position"]) for c in ex["culprits"]] == [(e, stage, token)]
    role = df.set_index("boundary")["role"]
    down = f"{name}:expert{e}.down_proj"
    assert df.set_index("boundary").loc[down, "identical"] is not pd.NA
    if not df.set_index("boundary").loc[down, "identical"]:
        assert role[down] == "carrier"
    assert df.attrs["status"] == "different"
    c = open_capture(tmp_path / "a")
    assert not any("expert rows" in k for k in c.not_captured)  # every experts module read


@pytest.mark.parametrize("family", FAMILIES)
def test_what_the_default_capture_did_not_see_is_listed_and_never_identical(tmp_path, family):
    """bfloat16, the default modules (the model itself not hooked): Nemotron-H returns
    ``lm_head(...).float()``, a tensor no hooked module output, so its logits are listed as
    not captured and two runs of the same forward are inconclusive, not identical; Jamba
    returns lm_head's own output, captured there. Oracle: a plain forward hook on lm_head,
    its output against the model's logits by identity. Every router is read (none listed
    unread) and every cache tensor of a hand walk is a state boundary."""
    model = _model(family, "bf16")
    ids = probe_ids()
    rows = row_map_from_attention_mask(torch.ones_like(ids), ["probe"])
    head: list[Any] = []
    h = model.lm_head.register_forward_hook(lambda m, a, out: head.append(out))
    try:
        for side in ("a", "b"):
            with torch.no_grad(), dmlib.capture(model, tmp_path / side, row_map=rows):
                out = model(input_ids=ids)
    finally:
        h.remove()
    seen_by_head = out.logits is head[-1]
    assert seen_by_head is (family == "jamba")  # Nemotron-H: a float32 copy
    walked = set()
    for i, layer in enumerate(out.past_key_values.layers):
        for part in ("conv_states", "recurrent_states"):
            walked |= {f"layers.{i}.{part}.{j}" for j in getattr(layer, part, None) or {}}
        for part in ("keys", "values"):
            if torch.is_tensor(getattr(layer, part, None)):
                walked.add(f"layers.{i}.{part}")
    c = open_capture(tmp_path / "a")
    assert {x.name.split(":state.", 1)[1] for x in c if x.state} == walked
    assert "routers_unread" not in c.coverage
    assert set(c.coverage["router_scores"]) == {
        n
        for n, m in model.named_modules()
        if type(m).__name__.endswith(("TopKRouter", "TopkRouter"))
    }
    unseen = {u["what"]: u["reason"] for u in c.not_captured}
    v = CaptureVerdict.of(compare_captures(tmp_path / "a", tmp_path / "b"))
    if seen_by_head:
        assert unseen == {} and v.status == "identical" and exit_code(v) == 0
    else:
        assert unseen == {"(model):output0.logits": NOT_HOOKED}
        assert v.status == "inconclusive" and exit_code(v) == EXIT_INCONCLUSIVE
        assert "(model):output0.logits" in str(v)
