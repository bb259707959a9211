"""Values computed outside any module recorded by name (dmlib.record) and judged: a planted
difference in a log_softmax outside the model is found there, every module identical."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dmlib  # noqa: E402
from dmlib.localize.boundaries import compare_captures  # noqa: E402

IDS = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
ROWS = [[("r0", j) for j in range(5)], [("r1", j) for j in range(5)]]


def _model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).float().eval()


def _run(m, path, upcast):
    with torch.no_grad(), dmlib.capture(m, path, row_map=ROWS, overwrite=True,
                                        modules=("", "model.layers.*", "lm_head")):  # fmt: skip
        logits = m(input_ids=IDS).logits
        x = logits.float() if upcast else logits.bfloat16()  # the planted difference
        lp = dmlib.record("logprobs", torch.log_softmax(x, -1).float())
        picked = dmlib.record("picked", lp[..., :1])
    return lp, picked


def test_a_difference_entering_outside_modules_is_found_at_the_recorded_value(tmp_path):
    m = _model()
    lp_a, _ = _run(m, tmp_path / "a", upcast=True)
    lp_b, _ = _run(m, tmp_path / "b", upcast=False)
    assert not torch.equal(lp_a, lp_b)  # the plant took
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    roles = dict(zip(df["boundary"], df["role"], strict=True))
    modules = [n for n in roles if n not in ("logprobs", "picked")]
    same = df[df["boundary"].isin(modules)]["identical"]
    assert same.fillna(False).sum() > 20  # every module judged is identical
    assert same.fillna(True).all()
    assert df.attrs["first_divergent_boundary"] == "logprobs"
    assert df.attrs["culprit"] == "logprobs" and roles["picked"] == "carrier"
    c = dmlib.open_capture(tmp_path / "a")
    b = c.boundary("logprobs")
    assert b.category.name == "recorded" and b.row_dims == 2  # per request through the row map
    assert set(b.requests) == {"r0", "r1"}


def test_record_is_a_no_op_outside_a_capture_and_the_decorator_records(tmp_path):
    t = torch.arange(6.0).reshape(2, 3)
    assert dmlib.record("x", t) is t

    @dmlib.recorded("scaled")
    def scale(x, temperature):
        return x / temperature

    assert torch.equal(scale(t, 2.0), t / 2.0)  # outside: the function alone
    lin = torch.nn.Linear(3, 3)
    with dmlib.capture(lin, tmp_path / "c", dump=("scaled*",)) as _:
        scale(lin(t), 2.0)
        scale(lin(t), 2.0)
    c = dmlib.open_capture(tmp_path / "c")
    assert "scaled" in c and "scaled#1" in c
    assert c.boundary("scaled").recorded and c.boundary("scaled").category.name == "recorded"
    with torch.no_grad():
        want = (lin(t) / 2.0).numpy()
    assert np.array_equal(c.tensor("scaled"), want) and np.array_equal(c.tensor("scaled#1"), want)
