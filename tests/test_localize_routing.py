"""The routing report: an MoE router's expert choices per token, compared between runs.

A tiny random-init ``Qwen3MoeForCausalLM`` from its config (8 experts, top-2, 2 layers).
A near-tie is planted, never left to this CPU: a forward hook on layer 1's router moves the
logit of token ``T``'s third expert just below its second's (run A) or just above it
(run B), a few float32 ULP of their softmax scores apart (in bfloat16: one ULP of the
logit), and recomputes the router's outputs as the router does (softmax in float32, top-2,
renormalised). The oracle is ``torch.topk`` on the hooked logits' softmax, by hand.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dmlib.cli import main  # noqa: E402
from dmlib.localize.boundaries import CaptureVerdict, compare_captures  # noqa: E402
from dmlib.localize.capture import capture, open_capture  # noqa: E402
from dmlib.localize.capture.routers import router_outputs  # noqa: E402
from dmlib.localize.hf import row_map_from_attention_mask  # noqa: E402

VOCAB, N, T, ULPS = 64, 10, 6, 4


def moe(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
        max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(cfg).eval().to(dtype)


class NearTie:
    """On the router's logits of token ``T`` (flat row), the third-ranked expert's logit is
    set ``ULPS * 2**-23`` below (``up=False``) or above (``up=True``) the second's; the
    router's outputs are recomputed from those logits. Keeps the logits it produced."""

    def __init__(self, router, up: bool) -> None:
        self.up, self.logits = up, None
        self.top_k, self.norm = router.top_k, router.norm_topk_prob
        self.handle = router.register_forward_hook(self.hook)

    def hook(self, mod, args, out):
        logits = out[0].clone()
        row = logits[T]
        order = torch.argsort(row.float(), descending=True)
        second, third = int(order[1]), int(order[2])
        if row.dtype == torch.float32:
            # a few float32 ULP of the softmax scores: exp() carries an absolute change d of
            # a logit into a relative change d of its probability
            delta = ULPS * 2.0**-23
            row[third] = row[second] + (delta if self.up else -delta)
        else:  # bfloat16 logits: one ULP of the logit itself, above or below
            toward = torch.tensor(float("inf") if self.up else float("-inf"), dtype=row.dtype)
            row[third] = torch.nextafter(row[second], toward)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm:
            top = top / top.sum(dim=-1, keepdim=True)
        self.logits = logits
        return logits, top.to(logits.dtype), idx

    def remove(self) -> None:
        self.handle.remove()


def run(model, path, up: bool):
    ids = torch.randint(1, VOCAB, (1, N), generator=torch.Generator().manual_seed(4))
    rows = row_map_from_attention_mask(torch.ones(1, N), ["probe"])
    plant = NearTie(model.model.layers[1].mlp.gate, up)
    try:
        with (
            torch.no_grad(),
            capture(model, path, row_map=rows, modules=["", "model.*", "lm_head"], dump=["*mlp"]),
        ):
            model(input_ids=ids, use_cache=False)
    finally:
        plant.remove()
    return plant.logits


def by_hand(logits):
    """(top-2 sets per token, k-th minus (k+1)-th softmax score per token), by torch.topk."""
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    vals, idx = torch.topk(probs, 3, dim=-1)
    sets = [sorted(int(e) for e in r) for r in idx[:, :2]]
    return sets, (vals[:, 1] - vals[:, 2]).numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_planted_near_tie_is_reported_as_one_flip(tmp_path, capsys, dtype):
    model = moe(dtype)
    la, lb = run(model, tmp_path / "a", up=False), run(model, tmp_path / "b", up=True)
    sa, ma = by_hand(la)
    sb, mb = by_hand(lb)
    changed = [t for t in range(N) if sa[t] != sb[t]]
    assert changed == [T]  # the oracle: exactly the planted token's top-2 set changed
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    rep = df.attrs["routing"]
    assert rep["n_router_calls"] == 2 and rep["n_flips"] == 1
    (f,) = rep["flips"]
    assert f["router"] == "model.layers.1.mlp.gate" and f["position"] == T
    assert (f["experts_a"], f["experts_b"]) == (sa[T], sb[T])
    assert f["left"] == sorted(set(sa[T]) - set(sb[T]))
    assert f["joined"] == sorted(set(sb[T]) - set(sa[T]))
    # the margins, in both runs, as the oracle's k-th minus (k+1)-th score
    assert f["margin_a"] == pytest.approx(float(ma[T]), abs=0)
    assert f["margin_b"] == pytest.approx(float(mb[T]), abs=0)
    # ULP between the k-th and (k+1)-th float32 scores, by their bit patterns (both > 0)
    for side, probs in (("a", la), ("b", lb)):
        vals = torch.topk(torch.softmax(probs, dtype=torch.float, dim=-1)[T], 3).values
        bits = vals.numpy().astype(np.float32).view(np.int32).astype(np.int64)
        assert f[f"margin_ulp_{side}"] == bits[1] - bits[2]
        assert f[f"margin_ulp_{side}"] > 0
        if dtype == torch.float32:
            assert f[f"margin_ulp_{side}"] <= 4 * ULPS  # a near-tie, in both runs
    assert rep["per_router"] == {"model.layers.1.mlp.gate": 1}
    # the router's indices are a flip, the MoE block after it differs downstream of it
    by = df.set_index("boundary")
    assert by.loc["model.layers.1.mlp.gate:router.indices", "role"] == "flip"
    v = CaptureVerdict.of(df)
    assert "routing: 1 token changed experts" in str(v)
    assert main(["localize", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert f"position {T}: experts {sa[T]} -> {sb[T]}" in out


def test_the_flipped_token_stands_out_downstream(tmp_path):
    """The MoE block's output after the flip: the positions whose rows differ, per
    position (oracle: the dumped rows compared by numpy), the flipped token among them, and
    the note names the flip."""
    model = moe()
    run(model, tmp_path / "a", up=False)
    run(model, tmp_path / "b", up=True)
    a, b = open_capture(tmp_path / "a"), open_capture(tmp_path / "b")
    xa = np.asarray(a.tensor("model.layers.1.mlp", "probe"))
    xb = np.asarray(b.tensor("model.layers.1.mlp", "probe"))
    rows = np.nonzero((xa != xb).reshape(N, -1).any(axis=1))[0].tolist()
    # the flipped token differs; others may too where an expert's batch of gathered rows
    # changed size (which, on this CPU, is not asserted: only what numpy sees is)
    assert T in rows
    df = compare_captures(a, b).set_index("boundary")
    note = df.loc["model.layers.1.mlp", "note"]
    assert "expert flip at model.layers.1.mlp.gate:router.indices" in note
    assert df.loc["model.layers.1.mlp", "diff_positions"] == rows


def test_no_flip_without_the_plant(tmp_path):
    model = moe()
    run(model, tmp_path / "a", up=False)
    run(model, tmp_path / "b", up=False)
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    assert df.attrs["routing"]["n_flips"] == 0
    assert df.attrs["status"] == "identical"


def test_routers_are_found_by_their_outputs():
    logits = torch.randn(5, 8)
    idx = torch.topk(logits, 2).indices
    assert router_outputs((logits, torch.rand(5, 2), idx)) is not None
    assert router_outputs(logits) is None  # a plain Linear gate's logits: no choice in it
    assert router_outputs((logits, torch.rand(5, 8))) is None


def test_router_values_that_do_not_fit_their_boundary_are_refused(tmp_path):
    import json

    from dmlib.errors import CaptureError

    model = moe()
    run(model, tmp_path / "a", up=False)
    run(model, tmp_path / "b", up=True)
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    name = "model.layers.1.mlp.gate:router.indices"
    m["coverage"]["routers"][name] = m["coverage"]["routers"][name][:-1]  # a token short
    (tmp_path / "b" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CaptureError, match="router values of"):
        compare_captures(tmp_path / "a", tmp_path / "b")


def test_the_report_section_lists_the_flips(tmp_path):
    """The capture notebook's routing cell (report.sections_captures.routing) on the two
    captures: the flip the routing report found, one row, and the numbers recorded."""
    from dmlib import report
    from dmlib.report import sections_captures as sections

    model = moe()
    la, lb = run(model, tmp_path / "a", up=False), run(model, tmp_path / "b", up=True)
    sa, _ = by_hand(la)
    sb, _ = by_hand(lb)
    report.configure(figure_dir=tmp_path / "stage" / "figures", notebook="routing_test")
    try:
        df = compare_captures(tmp_path / "a", tmp_path / "b")
        table = sections.routing(sections.Captures(study=None, results={"a vs b": df}))
        assert list(table["position"]) == [T]
        assert (table["experts_a"].iloc[0], table["experts_b"].iloc[0]) == (sa[T], sb[T])
        # the flip's effect in columns: the MoE block's largest |difference| at the flipped
        # position and at any other, by numpy on the dumped rows
        xa = np.asarray(open_capture(tmp_path / "a").tensor("model.layers.1.mlp", "probe"))
        xb = np.asarray(open_capture(tmp_path / "b").tensor("model.layers.1.mlp", "probe"))
        per = np.abs(xa.astype(np.float64) - xb.astype(np.float64)).reshape(N, -1).max(axis=1)
        assert table["diff_at_flip"].iloc[0] == per[T] > 0
        assert table["diff_elsewhere"].iloc[0] == np.delete(per, T).max()
        n = report.load_numbers(report.numbers_path())
        assert n["routing_flips"] == {"a vs b": 1}
    finally:
        report.configure(figure_dir=Path("reports") / "figures", notebook="notebook")


def test_a_deepseek_v3_router_is_recorded_with_its_choices(tmp_path):
    """DeepSeek-V3's group-limited router (sigmoid scores plus a correction bias): its
    chosen ids as plain forward hooks see them; its margin row is the lowest chosen and
    the highest other score (sigmoid + bias, by hand from the hooked logits)."""
    from dmlib.localize.routing import values

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
        n_group=2, topk_group=1, n_shared_experts=1, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    gate = model.model.layers[1].mlp.gate
    seen = []

    def hook(mod, args, out):
        seen.append((out[0].clone(), out[2].clone()))

    h = gate.register_forward_hook(hook)
    try:
        with (
            torch.no_grad(),
            capture(model, tmp_path / "a", row_map=[[("p", j) for j in range(9)]]),
        ):
            model(input_ids=torch.randint(1, VOCAB, (1, 9)), use_cache=False)
    finally:
        h.remove()
    (logits, idx), c = seen[0], open_capture(tmp_path / "a")
    name = "model.layers.1.mlp.gate"
    assert np.array_equal(values(c, c.boundary(f"{name}:router.indices")), idx.numpy())
    scores = logits.float().sigmoid() + gate.e_score_correction_bias.float()
    chosen = scores.gather(1, idx).min(dim=1).values
    other = scores.scatter(1, idx, float("-inf")).max(dim=1).values
    margin = values(c, c.boundary(f"{name}:router.margin"))
    assert np.array_equal(margin, torch.stack([chosen, other], 1).numpy())
