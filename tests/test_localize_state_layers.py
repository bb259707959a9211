"""A state is judged against what feeds it: its own layer's boundaries, not everything
recorded before it in the pass. The cache is walked at the end of a pass, so in record
order every state follows every module; a difference entering in a later layer must not
make an earlier layer's state its "carrier" (nor a flip's downstream). Tiny Qwen3-Next
(bfloat16) under generate(), differences planted (never left to this CPU): +1 ULP in layer
0's recurrent state after the prefill, and +1.0 on one element of layer 2's linear-attention
output in the prefill (written after layer 2's state, so no state of layer 2 or before sees it)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import pandas as pd  # noqa: E402
from test_localize_state import STATE0, dmlib_states, hybrid, one_ulp, oracle_differs, run  # noqa: E402

from dmlib.localize.boundaries import compare_captures  # noqa: E402

pytestmark = pytest.mark.slow  # generate() captures of a hybrid: several seconds each

LATER = "model.layers.2.linear_attn"


def _plant_later(model):
    """+1.0 on element 3 of layer 2's linear-attention output, prefill only."""
    calls = []

    def hook(mod, args, out):
        calls.append(1)
        if len(calls) == 1:
            out = out.clone()
            out.reshape(-1)[3:4].add_(1.0)  # big enough to survive the residual sum in bf16
            return out
        return None

    return model.get_submodule(LATER).register_forward_hook(hook)


def test_an_earlier_layers_state_is_its_own_culprit_when_a_later_layer_differs(tmp_path):
    model = hybrid()
    a = run(model, tmp_path / "a", padded=False)
    handle = _plant_later(model)
    try:
        b = run(model, tmp_path / "b", padded=False, plant=one_ulp)
    finally:
        handle.remove()
    # the oracle's walk: layer 0's state (planted), layer 3's keys/values (fed by layer 2's
    # output, planted); layer 2's own states are written before its output was changed
    differs = oracle_differs(a, b)
    assert "layers.0.recurrent_states.0" in differs
    assert not any(k.startswith(("layers.1.", "layers.2.")) for k in differs)
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    states = dmlib_states(df)
    assert {k for k, v in states.items() if v is False} == differs
    role = dict(zip(df["boundary"], df["role"], strict=True))
    same = dict(zip(df["boundary"], df["identical"], strict=True))
    # everything of layer 0 recorded in the prefill (judged) is identical; layer 2's output not
    layer0 = [v for k, v in same.items() if k.startswith("model.layers.0") and "#" not in k]
    assert layer0 and all(v is True or bool(v) for v in layer0 if v is not pd.NA)
    # layer 2's recorded boundaries (its linear_attn is no default module: its sum with the
    # residual, the decoder layer's output, and what follows) differ in record order before
    # any state: the rule "anything before it differs" would make layer 0's state a carrier
    later = [k for k, v in same.items() if k.startswith("model.layers.2") and "#" not in k
             and v is not pd.NA and not bool(v)]  # fmt: skip
    assert later
    assert role[STATE0] == "culprit"  # was "carrier": something recorded before it differed
    # a state of a layer the difference reached is its carrier
    for k in differs - {"layers.0.recurrent_states.0"}:
        assert role[f"(model):state.{k}"] == "carrier", k


def test_a_state_before_the_flips_layer_is_not_downstream_of_it():
    """The lab's moe_packed captures (committed files): the one flip is at layer 1's router;
    layer 0's recurrent state differs (1 ULP) with every layer-0 boundary identical, so it
    is its own culprit, and its note does not name the flip (a later layer's event)."""
    from pathlib import Path

    data = Path(__file__).resolve().parent.parent / "data" / "moe_packed" / "bf16"
    df = compare_captures(data / "alone", data / "packed", request="probe")
    flips = df.attrs["routing"]["flips"]
    assert [f["boundary"].split(":")[0] for f in flips] == ["model.layers.1.mlp.gate"]
    row = df.set_index("boundary").loc[STATE0]
    assert row["identical"] == False  # noqa: E712
    layer0 = df.loc[df["boundary"].str.startswith("model.layers.0"), "identical"].tolist()
    assert any(v is not pd.NA for v in layer0)
    assert all(bool(v) for v in layer0 if v is not pd.NA)  # judged: identical
    assert row["role"] == "culprit"
    assert "flip" not in (row["note"] or "")
