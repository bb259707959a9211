"""compare_logprobs against numbers worked out by hand and against a plain numpy oracle
written here (per sequence, token by token, from the definitions in docs/logprobs.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from dmlib.errors import DmlibError
from dmlib.stats.logprobs import compare_logprobs, logprob_ladder, logprob_verdict

# -- the oracle -------------------------------------------------------------------------


def oracle(xs: list[np.ndarray], ys: list[np.ndarray]) -> dict[str, float]:
    """The sampled-token figures over all tokens, straight from the definitions."""
    x = np.concatenate([np.asarray(v, np.float64) for v in xs])
    y = np.concatenate([np.asarray(v, np.float64) for v in ys])
    d = y - x
    r = np.exp(y) / np.exp(x)
    return {
        "mean_abs_dlogprob": float(np.mean(np.abs(d))),
        "max_abs_dlogprob": float(np.max(np.abs(d))),
        "k1": float(np.mean(-np.log(r))),
        "k2": float(np.mean(np.log(r) ** 2 / 2)),
        "k3": float(np.mean((r - 1) - np.log(r))),
        "chi2": float(np.mean((r - 1) ** 2)),
        "mean_abs_dp": float(np.mean(np.abs(np.exp(y) - np.exp(x)))),
        "pearson_r": float(np.corrcoef(x, y)[0, 1]),
        "frac_over_ln2": float(np.mean(np.abs(d) > math.log(2))),
    }


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def coarse_kl(pa: dict[int, float], pb: dict[int, float]) -> float:
    """KL over the ids both top-k lists hold plus one bucket for the rest, by hand."""
    common = set(pa) & set(pb)
    total = sum(pa[i] * math.log(pa[i] / pb[i]) for i in common)
    ra = 1 - sum(pa[i] for i in common)
    rb = 1 - sum(pb[i] for i in common)
    if ra > 0:
        total += ra * math.log(ra / rb)
    return total


def pair(seed: int = 0, s: int = 5, t: int = 9, scale: float = 0.05):
    rng = np.random.default_rng(seed)
    a = (-np.abs(rng.normal(2.0, 1.0, (s, t))) - 1e-3).astype(np.float32)
    b = np.minimum(a + rng.normal(0, scale, (s, t)), -1e-3).astype(np.float32)
    tokens = rng.integers(0, 1000, (s, t))
    return a, b, tokens


# -- hand-computed ----------------------------------------------------------------------


def test_two_tokens_by_hand() -> None:
    df = compare_logprobs([np.array([-0.5, -1.0])], [np.array([-0.5, -1.25])])
    row = df.iloc[0]
    assert row["n_tokens"] == 2 and row["n_diff"] == 1
    assert row["mean_abs_dlogprob"] == 0.125
    assert row["max_abs_dlogprob"] == 0.25 and row["worst_position"] == 1
    assert row["k1"] == pytest.approx(0.125, rel=1e-15)
    assert row["k2"] == pytest.approx(0.0625 / 2 / 2, rel=1e-15)
    # the log ratio is 0 at token 0 and -0.25 at token 1: k3 = (exp(-0.25) - 1 + 0.25) / 2
    assert row["k3"] == pytest.approx((math.exp(-0.25) - 1 + 0.25) / 2, rel=1e-12)
    assert row["chi2"] == pytest.approx((1 - math.exp(-0.25)) ** 2 / 2, rel=1e-12)
    assert row["mean_abs_dp"] == pytest.approx((math.exp(-1.0) - math.exp(-1.25)) / 2)
    assert row["pearson_r"] == pytest.approx(1.0)
    assert row["frac_over_ln2"] == 0.0
    assert row["max_ulp"] == 2**50  # 0.25 apart in [1, 2): 0.25 / 2**-52 float64 steps
    v = logprob_verdict(df)
    assert v.status == "differs" and not v
    assert v.worst[0]["sequence"] == 0 and v.worst[0]["position"] == 1


def test_over_ln2_and_direction_by_hand() -> None:
    # B gives the second token 3x A's probability: log r = ln 3 > ln 2, k1 = -ln 3
    a = [np.array([math.log(0.1), math.log(0.2)])]
    b = [np.array([math.log(0.1), math.log(0.6)])]
    row = compare_logprobs(a, b).iloc[0]
    assert row["frac_over_ln2"] == 0.5
    assert row["k1"] == pytest.approx(-math.log(3) / 2)
    assert row["k3"] == pytest.approx((2 - math.log(3)) / 2)
    assert row["chi2"] == pytest.approx(4 / 2)
    assert row["mean_abs_dp"] == pytest.approx(0.4 / 2)


def test_identical_and_nothing_compared() -> None:
    a, _, tok = pair()
    v = logprob_verdict(
        compare_logprobs({"logprobs": a, "tokens": tok}, {"logprobs": a.copy(), "tokens": tok})
    )
    assert v.status == "identical" and v and v.n_diff == 0 and v.figures["max_ulp"] == 0
    mask = np.zeros(a.shape, bool)
    v = logprob_verdict(
        compare_logprobs({"logprobs": a, "mask": mask}, {"logprobs": a + 1, "mask": mask})
    )
    assert v.status == "inconclusive" and not v and v.n_tokens == 0


# -- against the oracle -----------------------------------------------------------------


def test_figures_match_numpy_per_sequence_and_overall() -> None:
    a, b, tok = pair(seed=3, s=6, t=40, scale=0.8)
    df = compare_logprobs({"logprobs": a, "tokens": tok}, {"logprobs": b, "tokens": tok})
    for s in range(a.shape[0]):
        row = df[df["sequence"] == s].iloc[0]
        want = oracle([a[s]], [b[s]])
        for k, v in want.items():
            assert row[k] == pytest.approx(v, rel=1e-9, abs=1e-15), (s, k)
        assert row["worst_position"] == int(np.argmax(np.abs(b[s].astype(float) - a[s])))
        ulp = np.abs(a[s].view(np.int32).astype(np.int64) - b[s].view(np.int32).astype(np.int64))
        same_sign = np.sign(a[s]) == np.sign(b[s])
        assert same_sign.all()  # negative log-probs: the ULP distance is the bit distance
        assert row["max_ulp"] == ulp.max()
    v = logprob_verdict(df)
    want = oracle(list(a), list(b))
    for k, val in want.items():
        assert v.figures[k] == pytest.approx(val, rel=1e-9, abs=1e-15), k
    flat = np.abs(b.astype(float) - a).ravel()
    order = np.argsort(-flat)[:5]
    assert [(w["sequence"], w["position"]) for w in v.worst] == [
        divmod(int(i), a.shape[1]) for i in order
    ]


def test_overall_is_over_tokens_not_a_mean_of_sequences() -> None:
    xs = [np.array([-1.0]), np.array([-1.0, -2.0, -3.0])]
    ys = [np.array([-2.0]), np.array([-1.0, -2.0, -3.0])]
    v = logprob_verdict(compare_logprobs(xs, ys))
    assert v.figures["mean_abs_dlogprob"] == 0.25  # 1 / 4 tokens (a mean of means: 0.5)


def test_padded_mask_counts_only_its_tokens() -> None:
    # 3 x 8 padded = 24 elements, 17 counted; the padding differs wildly and must not count
    rng = np.random.default_rng(1)
    lengths = np.array([8, 5, 4])
    mask = np.arange(8)[None, :] < lengths[:, None]
    assert mask.sum() == 17
    a = rng.normal(-2, 1, (3, 8)).astype(np.float32)
    b = a.copy()
    b[~mask] = 0.0
    b[1, 2] += np.float32(0.5)
    v = logprob_verdict(
        compare_logprobs({"logprobs": a, "mask": mask}, {"logprobs": b, "mask": mask})
    )
    assert v.n_tokens == 17 and v.n_diff == 1
    want = oracle([a[i][mask[i]] for i in range(3)], [b[i][mask[i]] for i in range(3)])
    assert v.figures["mean_abs_dlogprob"] == pytest.approx(want["mean_abs_dlogprob"])
    assert v.worst[0]["sequence"] == 1 and v.worst[0]["position"] == 2
    # lengths instead of a mask, and a mask given beside the inputs, count the same
    v2 = logprob_verdict(
        compare_logprobs({"logprobs": a, "lengths": lengths}, {"logprobs": b, "lengths": lengths})
    )
    v3 = logprob_verdict(compare_logprobs({"logprobs": a}, {"logprobs": b}, mask=mask))
    assert v2.n_tokens == v3.n_tokens == 17
    assert v2.figures == v.figures == v3.figures


def test_position_is_among_counted_tokens_with_left_padding() -> None:
    a = np.array([[0.0, 0.0, -1.0, -2.0]], np.float32)
    b = np.array([[9.0, 9.0, -1.0, -2.5]], np.float32)
    mask = np.array([[0, 0, 1, 1]])
    v = logprob_verdict(compare_logprobs({"logprobs": a, "mask": mask}, [np.array([-1.0, -2.5])]))
    assert v.n_tokens == 2 and v.worst[0]["position"] == 1
    v = logprob_verdict(
        compare_logprobs({"logprobs": a, "mask": mask}, {"logprobs": b, "mask": mask})
    )
    assert v.n_tokens == 2 and v.n_diff == 1 and v.worst[0]["position"] == 1


def test_planted_one_ulp() -> None:
    a, _, tok = pair(seed=5)
    b = a.copy()
    b[3, 4] = np.nextafter(b[3, 4], np.float32(0))
    v = logprob_verdict(
        compare_logprobs({"logprobs": a, "tokens": tok}, {"logprobs": b, "tokens": tok})
    )
    assert v.n_diff == 1 and v.figures["max_ulp"] == 1
    assert (v.worst[0]["sequence"], v.worst[0]["position"]) == (3, 4)
    assert v.figures["max_abs_dlogprob"] == abs(float(b[3, 4]) - float(a[3, 4]))


def test_two_dtypes_have_no_ulp_and_compare_values() -> None:
    ml_dtypes = pytest.importorskip("ml_dtypes")
    a = np.array([-1.0, -2.0, -0.5], np.float32)
    b = a.astype(ml_dtypes.bfloat16)
    v = logprob_verdict(compare_logprobs([a], [b]))
    assert v.status == "identical" and v.figures["max_ulp"] is None
    assert (v.dtype_a, v.dtype_b) == ("float32", "bfloat16")


def test_nonfinite_tokens_are_counted_apart() -> None:
    a = [np.array([-1.0, -np.inf, -np.inf, -2.0])]
    b = [np.array([-1.5, -np.inf, -3.0, -2.0])]
    v = logprob_verdict(compare_logprobs(a, b))
    assert v.n_nonfinite == 2 and v.n_diff == 2  # -1 vs -1.5, and -inf vs -3
    assert v.figures["mean_abs_dlogprob"] == 0.25  # over the 2 finite tokens
    assert v.worst[0]["position"] == 2 and v.worst[0]["abs_dlogprob"] == math.inf


def test_control_beside() -> None:
    a, b, tok = pair(seed=7, scale=0.1)
    c = a.copy()
    c[0, 0] += np.float32(0.001)
    df = compare_logprobs(
        {"logprobs": a, "tokens": tok},
        {"logprobs": b, "tokens": tok},
        control={"logprobs": c, "tokens": tok},
    )
    v = logprob_verdict(df)
    want = oracle(list(a), list(c))
    assert v.control["mean_abs_dlogprob"] == pytest.approx(want["mean_abs_dlogprob"])
    assert v.ratio_to_control == pytest.approx(
        oracle(list(a), list(b))["mean_abs_dlogprob"] / want["mean_abs_dlogprob"]
    )
    assert set(df["role"]) == {"pair", "control"}
    with pytest.raises(DmlibError, match="control is not comparable"):
        compare_logprobs(
            {"logprobs": a, "tokens": tok},
            {"logprobs": b, "tokens": tok},
            control={"logprobs": c, "tokens": tok + 1},
        )


# -- whole distributions ----------------------------------------------------------------


def test_full_logits_kl_and_overlap_match_numpy() -> None:
    rng = np.random.default_rng(11)
    s, t, vocab = 2, 5, 30
    za = rng.normal(0, 2, (s, t, vocab))
    zb = za + rng.normal(0, 0.3, (s, t, vocab))
    lp = lambda z: np.log(softmax(z))  # noqa: E731
    tokens = rng.integers(0, vocab, (s, t))
    side = lambda z: {  # noqa: E731
        "logprobs": np.take_along_axis(lp(z), tokens[..., None], -1)[..., 0],
        "tokens": tokens,
        "logits": z,
    }
    v = logprob_verdict(compare_logprobs(side(za), side(zb), top_k=5))
    pa, pb = softmax(za).reshape(-1, vocab), softmax(zb).reshape(-1, vocab)
    kl_ab = np.sum(pa * np.log(pa / pb), axis=1)
    kl_ba = np.sum(pb * np.log(pb / pa), axis=1)
    overlap = [
        len(set(np.argsort(-pa[i])[:5]) & set(np.argsort(-pb[i])[:5])) / 5 for i in range(s * t)
    ]
    assert v.figures["kl_ab"] == pytest.approx(kl_ab.mean(), rel=1e-9)
    assert v.figures["kl_ba"] == pytest.approx(kl_ba.mean(), rel=1e-9)
    assert v.figures["max_kl_ab"] == pytest.approx(kl_ab.max(), rel=1e-9)
    assert v.figures["topk_overlap"] == pytest.approx(np.mean(overlap))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_topk_kl_matches_the_hand_rule_and_bounds_the_whole_kl(dtype: type) -> None:
    rng = np.random.default_rng(12)
    n, vocab, k = 40, 25, 6
    za = rng.normal(0, 1.5, (n, vocab))
    zb = za + rng.normal(0, 0.6, (n, vocab))
    pa, pb = softmax(za), softmax(zb)
    ia, ib = np.argsort(-pa, axis=1)[:, :k], np.argsort(-pb, axis=1)[:, :k]
    ib = ib[:, ::-1].copy()  # the order of a list must not matter
    la = np.log(np.take_along_axis(pa, ia, 1)).astype(dtype)
    lb = np.log(np.take_along_axis(pb, ib, 1)).astype(dtype)
    tokens = ia[:, 0]
    side = lambda lpk, ids, p: {  # noqa: E731
        "logprobs": np.log(p[np.arange(n), tokens])[None],
        "tokens": tokens[None],
        "top_logprobs": lpk[None],
        "top_ids": ids[None],
    }
    v = logprob_verdict(compare_logprobs(side(la, ia, pa), side(lb, ib, pb)))
    # the oracle's probabilities: exp of the stored log-probs, in float64
    qa = [dict(zip(ia[i].tolist(), np.exp(la[i].astype(np.float64)).tolist())) for i in range(n)]
    qb = [dict(zip(ib[i].tolist(), np.exp(lb[i].astype(np.float64)).tolist())) for i in range(n)]
    ab = [coarse_kl(qa[i], qb[i]) for i in range(n)]
    ba = [coarse_kl(qb[i], qa[i]) for i in range(n)]
    overlap = [len(set(ia[i]) & set(ib[i])) / k for i in range(n)]
    assert v.figures["kl_topk_ab"] == pytest.approx(np.mean(ab), rel=1e-9)
    assert v.figures["kl_topk_ba"] == pytest.approx(np.mean(ba), rel=1e-9)
    assert v.figures["topk_overlap"] == pytest.approx(np.mean(overlap))
    assert 0 < np.mean(overlap) < 1  # the lists differ somewhere, agree somewhere
    full = np.sum(pa * np.log(pa / pb), axis=1)
    assert v.figures["kl_topk_ab"] <= full.mean() + 1e-6


@pytest.fixture(params=["compiled", "numpy"])
def topk_engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each top-k test twice: the compiled pass (``_fused.topk``) and the numpy path."""
    from dmlib.stats import logprob_figures as figs

    if request.param == "compiled" and figs.compiled_topk() is None:
        pytest.skip("dmlib.kernels._fused (with topk) not built, or DMLIB_KERNELS=numpy")
    monkeypatch.setattr(figs, "USE_COMPILED", request.param == "compiled")
    return str(request.param)


def test_topk_kl_over_many_blocks_on_threads(topk_engine: str) -> None:
    from dmlib.stats.logprob_figures import topk_kl

    rng = np.random.default_rng(14)
    n, k = 1000, 4
    ia = np.stack([rng.permutation(9)[:k] for _ in range(n)]).astype(np.int32)
    ib = np.stack([rng.permutation(9)[:k] for _ in range(n)]).astype(np.int32)
    la = np.log(rng.dirichlet(np.ones(12), n)[:, :k]).astype(np.float32)
    lb = np.log(rng.dirichlet(np.ones(12), n)[:, :k]).astype(np.float32)
    whole = topk_kl(la, ia, lb, ib, rows=n)
    pieces = topk_kl(la, ia, lb, ib, rows=7)
    for key, val in whole.items():
        assert np.array_equal(val, pieces[key]), key
    qa = [dict(zip(ia[i].tolist(), np.exp(la[i].astype(float)).tolist())) for i in range(n)]
    qb = [dict(zip(ib[i].tolist(), np.exp(lb[i].astype(float)).tolist())) for i in range(n)]
    assert whole["kl_topk_ab"] == pytest.approx([coarse_kl(qa[i], qb[i]) for i in range(n)])
    assert whole["topk_overlap"] == pytest.approx(
        [len(set(ia[i]) & set(ib[i])) / k for i in range(n)]
    )


def test_topk_by_hand() -> None:
    # A: ids 1, 2 with p 0.5, 0.3 (rest 0.2); B: ids 2, 3 with 0.4, 0.4 (rest 0.2 -> 0.6
    # once id 3 goes to the rest). Common: {2}. KL(A||B) = 0.3 ln(0.3/0.4) + 0.7 ln(0.7/0.6)
    a = {
        "logprobs": [np.log([0.5])],
        "top_logprobs.0": np.log([[0.5, 0.3]]),
        "top_ids.0": np.array([[1, 2]]),
    }
    b = {
        "logprobs": [np.log([0.5])],
        "top_logprobs.0": np.log([[0.4, 0.4]]),
        "top_ids.0": np.array([[2, 3]]),
    }
    a = {"logprobs.0": a.pop("logprobs")[0], **a}
    b = {"logprobs.0": b.pop("logprobs")[0], **b}
    v = logprob_verdict(compare_logprobs(a, b))
    assert v.figures["kl_topk_ab"] == pytest.approx(
        0.3 * math.log(0.3 / 0.4) + 0.7 * math.log(0.7 / 0.6)
    )
    assert v.figures["kl_topk_ba"] == pytest.approx(
        0.4 * math.log(0.4 / 0.3) + 0.6 * math.log(0.6 / 0.7)
    )
    assert v.figures["topk_overlap"] == 0.5


# -- the identity gate ------------------------------------------------------------------


def test_misaligned_inputs_are_not_comparable() -> None:
    # the sampler's log-probs scored one position off: their correlation is poor, but
    # that is misalignment, not numerics, and must never be reported as a difference
    rng = np.random.default_rng(13)
    tok = rng.integers(0, 1000, (4, 12))
    a = rng.normal(-2, 1, (4, 12)).astype(np.float32)
    shifted_tok, shifted_a = np.roll(tok, 1, axis=1), np.roll(a, 1, axis=1)
    assert abs(np.corrcoef(a.ravel(), shifted_a.ravel())[0, 1]) < 0.5
    df = compare_logprobs(
        {"logprobs": a, "tokens": tok}, {"logprobs": shifted_a, "tokens": shifted_tok}
    )
    v = logprob_verdict(df)
    assert v.status == "not comparable" and not v and len(df) == 0
    assert v.reason == f"tokens differ at sequence 0, position 0 (A {tok[0, 0]}, B {tok[0, -1]})"
    assert v.figures == {} and "not comparable" in str(v).lower()


def test_gate_on_counts_positions_masks_and_metadata() -> None:
    a, b, tok = pair()
    assert (
        "5 sequences in A, 4 in B"
        in logprob_verdict(compare_logprobs({"logprobs": a}, {"logprobs": b[:4]})).reason
    )
    ragged = [b[i][: 9 - (i == 2)] for i in range(5)]
    assert logprob_verdict(compare_logprobs({"logprobs": a}, ragged)).reason == (
        "sequence 2 has 9 counted tokens in A, 8 in B"
    )
    pos = np.tile(np.arange(9), (5, 1))
    pos_b = pos.copy()
    pos_b[1, 3] = 7
    r = logprob_verdict(
        compare_logprobs({"logprobs": a, "positions": pos}, {"logprobs": b, "positions": pos_b})
    ).reason
    assert r == "positions differ at sequence 1, position 3 (A 3, B 7)"
    m1 = np.ones((5, 9), bool)
    m1[0, 8] = False
    m2 = np.ones((5, 9), bool)
    m2[0, 0] = False
    assert (
        "masks differ at sequence 0"
        in logprob_verdict(
            compare_logprobs({"logprobs": a, "mask": m1}, {"logprobs": b, "mask": m2})
        ).reason
    )


def test_gate_on_metadata(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    a, b, tok = pair()
    save_file(
        {"logprobs": a, "tokens": tok},
        tmp_path / "a.safetensors",
        metadata={"weights_hash": "abc", "temperature": "1.0"},
    )
    save_file(
        {"logprobs": b, "tokens": tok},
        tmp_path / "b.safetensors",
        metadata={"weights_hash": "abd", "temperature": "1"},
    )
    save_file(
        {"logprobs": b, "tokens": tok},
        tmp_path / "c.safetensors",
        metadata={"weights_hash": "abc", "temperature": "1"},
    )
    v = logprob_verdict(compare_logprobs(tmp_path / "a.safetensors", tmp_path / "b.safetensors"))
    assert v.status == "not comparable" and "metadata 'weights_hash' differs" in v.reason
    v = logprob_verdict(compare_logprobs(tmp_path / "a.safetensors", tmp_path / "c.safetensors"))
    assert v.status == "differs"  # 1.0 and 1 are the same temperature


# -- layouts and files ------------------------------------------------------------------


def test_every_layout_and_format_gives_the_same_figures(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.numpy import save_file

    a, b, tok = pair(seed=21, s=4, t=7, scale=0.2)
    lengths = np.array([7, 3, 5, 1])
    keep = [slice(0, n) for n in lengths]
    want = logprob_verdict(
        compare_logprobs([a[i][keep[i]] for i in range(4)], [b[i][keep[i]] for i in range(4)])
    ).figures
    save_file({"logprobs": a, "lengths": lengths, "tokens": tok}, tmp_path / "a.safetensors")
    np.savez(tmp_path / "a.npz", logprobs=a, mask=np.arange(7)[None] < lengths[:, None], tokens=tok)
    torch.save([torch.from_numpy(b[i][keep[i]].copy()) for i in range(4)], tmp_path / "b.pt")
    with open(tmp_path / "b.jsonl", "w") as f:
        f.write(json.dumps({"metadata": {"temperature": 1.0}}) + "\n")
        for i in range(4):
            f.write(
                json.dumps(
                    {
                        "tokens": tok[i][keep[i]].tolist(),
                        "logprobs": b[i][keep[i]].astype(float).tolist(),
                    }
                )
                + "\n"
            )
    for pa in ("a.safetensors", "a.npz"):
        for pb in ("b.pt", "b.jsonl"):
            got = logprob_verdict(compare_logprobs(tmp_path / pa, tmp_path / pb)).figures
            for k, v in want.items():
                if k == "max_ulp":
                    continue  # JSONL holds float64: the dtypes differ
                assert got[k] == pytest.approx(v, rel=1e-12), (pa, pb, k)
    v = logprob_verdict(compare_logprobs(tmp_path / "a.npz", tmp_path / "b.jsonl"))
    assert v.unchecked == [
        "positions (given by neither side)",
        "metadata 'temperature' (given by B only)",
    ]


def test_bad_layouts_name_the_problem(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(
        {"weight": np.zeros((2, 2), np.float32), "bias": np.zeros(2, np.float32)},
        tmp_path / "w.safetensors",
    )
    with pytest.raises(DmlibError, match="no log-probs found") as info:
        compare_logprobs(tmp_path / "w.safetensors", tmp_path / "w.safetensors")
    assert "w.safetensors" in str(info.value)
    with pytest.raises(DmlibError, match="expected \\[2, 3\\]"):
        compare_logprobs(
            {"logprobs": np.zeros((2, 3)), "tokens": np.zeros((2, 4), int)}, [np.zeros(3)]
        )
    with pytest.raises(DmlibError, match="booleans or 0/1"):
        compare_logprobs({"logprobs": np.zeros((1, 2)), "mask": np.array([[0, 2]])}, [np.zeros(2)])
    with pytest.raises(DmlibError, match="tokens has dtype float"):
        compare_logprobs({"logprobs": np.zeros((1, 2)), "tokens": np.zeros((1, 2))}, [np.zeros(2)])


# -- the ladder -------------------------------------------------------------------------


def test_ladder_rows_per_run_and_step() -> None:
    a, b, tok = pair(seed=30, scale=0.01)
    drift = {"logprobs": a + np.float32(0.3), "tokens": tok}
    runs = {
        "policy": {
            0: ({"logprobs": a, "tokens": tok}, {"logprobs": b, "tokens": tok}),
            10: ({"logprobs": a, "tokens": tok}, drift),
        },
        "lr0": {
            0: ({"logprobs": a, "tokens": tok}, {"logprobs": b, "tokens": tok}),
            10: ({"logprobs": a, "tokens": tok}, {"logprobs": a, "tokens": tok + 1}),
        },
    }
    df = logprob_ladder(runs, control="lr0")
    assert list(zip(df["run"], df["step"], df["status"], strict=True)) == [
        ("policy", 0, "differs"),
        ("policy", 10, "differs"),
        ("lr0", 0, "differs"),
        ("lr0", 10, "not comparable"),
    ]
    assert df.loc[1, "k3"] == pytest.approx(oracle(list(a), list(a + np.float32(0.3)))["k3"])
    assert df.loc[0, "mean_abs_dlogprob"] == pytest.approx(
        oracle(list(a), list(b))["mean_abs_dlogprob"]
    )
    assert math.isnan(df.loc[3, "k3"]) and "tokens differ" in df.loc[3, "reason"]
    assert list(df["is_control"]) == [False, False, True, True]
    with pytest.raises(DmlibError, match="control run 'x'"):
        logprob_ladder(runs, control="x")


def test_empty_sequences_between_others() -> None:
    xs = [np.array([-1.0, -2.0]), np.array([]), np.array([-0.5, -0.25, -3.0]), np.array([])]
    ys = [np.array([-1.0, -2.5]), np.array([]), np.array([-0.5, -0.25, -2.0]), np.array([])]
    df = compare_logprobs(xs, ys)
    v = logprob_verdict(df)
    assert df["n_tokens"].tolist() == [2, 0, 3, 0]
    assert df["max_abs_dlogprob"].tolist()[0] == 0.5 and df["worst_position"].tolist() == [
        1,
        -1,
        2,
        -1,
    ]
    assert np.isnan(df["mean_abs_dlogprob"].tolist()[1])
    assert [(w["sequence"], w["position"]) for w in v.worst] == [(2, 2), (0, 1)]
    assert v.figures["mean_abs_dlogprob"] == pytest.approx(1.5 / 5)
    assert v.figures["pearson_r"] == pytest.approx(
        np.corrcoef(np.concatenate(xs), np.concatenate(ys))[0, 1]
    )


def test_many_blocks_give_the_figures_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from dmlib.stats import logprobs as lp_mod

    rng = np.random.default_rng(40)
    s, t, vocab = 6, 5, 40
    za = rng.normal(0, 1, (s, t, vocab))
    zb = za + rng.normal(0, 0.1, (s, t, vocab))
    mask = rng.random((s, t)) > 0.3

    def side(z: np.ndarray) -> dict[str, np.ndarray]:
        return {"logprobs": z[..., 0] - np.log(np.exp(z).sum(-1)), "logits": z, "mask": mask}

    one = logprob_verdict(compare_logprobs(side(za), side(zb)))
    monkeypatch.setattr(lp_mod, "BLOCK_BYTES", 4 * vocab * 3)  # 3 tokens' logits per block
    monkeypatch.setattr(lp_mod, "BLOCK_TOKENS", 3)
    many = logprob_verdict(compare_logprobs(side(za), side(zb)))
    for k, v in one.figures.items():
        assert many.figures[k] == pytest.approx(v, rel=1e-12), k
    assert many.worst == one.worst
    x = np.concatenate([side(za)["logprobs"][i][mask[i]] for i in range(s)])
    y = np.concatenate([side(zb)["logprobs"][i][mask[i]] for i in range(s)])
    assert many.figures["pearson_r"] == pytest.approx(np.corrcoef(x, y)[0, 1], rel=1e-12)


def test_jsonl_mask_and_positions(tmp_path: Path) -> None:
    lines = [
        {
            "tokens": [5, 6, 7],
            "logprobs": [-1.0, -2.0, -9.0],
            "mask": [1, 1, 0],
            "positions": [0, 1, 2],
        },
        {"tokens": [8, 9], "logprobs": [-0.5, -0.25], "mask": [0, 1], "positions": [0, 1]},
    ]
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    q = tmp_path / "b.ndjson"
    lines[0]["logprobs"][2] = 0.0  # a masked position: never counted
    lines[1]["logprobs"][1] = -0.75
    q.write_text("".join(json.dumps(x) + "\n" for x in lines))
    v = logprob_verdict(compare_logprobs(p, q))
    assert v.n_tokens == 3 and v.n_diff == 1 and v.unchecked == []
    assert (v.worst[0]["sequence"], v.worst[0]["position"]) == (1, 0)  # the first counted token
    assert v.figures["max_abs_dlogprob"] == 0.5


def test_whole_distributions_given_by_one_side_are_said() -> None:
    a = {"logprobs": np.array([[-1.0, -2.0]]), "top_logprobs": np.full((1, 2, 2), -1.0)}
    a["top_ids"] = np.array([[[1, 2], [3, 4]]])
    v = logprob_verdict(compare_logprobs(a, [np.array([-1.0, -2.0])]))
    assert "top-k figures (top_logprobs and top_ids given by A only)" in v.unchecked
    assert "kl_topk_ab" not in v.figures and v.status == "identical"


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_an_id_repeated_within_a_list_is_matched_once(dtype: type, topk_engine: str) -> None:
    from dmlib.stats.logprob_figures import topk_kl

    ia = np.array([[5, 5, 7], [1, 2, 3]])
    ib = np.array([[5, 9, 7], [3, 3, 3]])
    la = np.log(np.array([[0.3, 0.2, 0.1], [0.5, 0.2, 0.1]])).astype(dtype)
    lb = np.log(np.array([[0.3, 0.2, 0.1], [0.4, 0.1, 0.1]])).astype(dtype)
    got = topk_kl(la, ia, lb, ib)
    assert got["topk_overlap"].tolist() == [2 / 3, 1 / 3]


def test_a_repeated_id_counts_with_its_first_entry(topk_engine: str) -> None:
    from dmlib.stats.logprob_figures import topk_kl

    # A lists 7 twice (0.1 first, 0.3 after); B lists 7 twice too (0.2 first, 0.05 after)
    ia, ib = np.array([[7, 7, 2]]), np.array([[9, 7, 7]])
    la, lb = np.log([[0.1, 0.3, 0.2]]), np.log([[0.5, 0.2, 0.05]])
    got = topk_kl(la, ia, lb, ib)
    # the common ids: {7}, with A's 0.1 and B's 0.2; the rest: 0.9 in A, 0.8 in B
    want_ab = 0.1 * math.log(0.1 / 0.2) + 0.9 * math.log(0.9 / 0.8)
    want_ba = 0.2 * math.log(0.2 / 0.1) + 0.8 * math.log(0.8 / 0.9)
    assert got["kl_topk_ab"][0] == pytest.approx(want_ab, rel=1e-12)
    assert got["kl_topk_ba"][0] == pytest.approx(want_ba, rel=1e-12)
    assert got["topk_overlap"][0] == pytest.approx(1 / 3)


def dict_topk(la: np.ndarray, ia: np.ndarray, lb: np.ndarray, ib: np.ndarray) -> np.ndarray:
    """``[n, 3]``: kl_topk_ab, kl_topk_ba, topk_overlap token by token with plain dicts
    (an id's first entry in its list counts; docs/logprobs.md)."""

    def first(ids: np.ndarray, lps: np.ndarray) -> dict[int, float]:
        out: dict[int, float] = {}
        for i, v in zip(ids.tolist(), lps.astype(np.float64).tolist(), strict=True):
            out.setdefault(i, v)
        return out

    def bucket(p: float, q: float) -> float:
        if p == 0:
            return 0.0
        return math.inf if q == 0 else p * (math.log(p) - math.log(q))

    def kl(xa: dict[int, float], xb: dict[int, float], common: list[int]) -> float:
        total = 0.0
        for c in common:
            p = math.exp(xa[c])
            total += p * (xa[c] - xb[c]) if p > 0 else 0.0
        rest_a = max(1.0 - sum(math.exp(xa[c]) for c in common), 0.0)
        rest_b = max(1.0 - sum(math.exp(xb[c]) for c in common), 0.0)
        return total + bucket(rest_a, rest_b)

    k = min(ia.shape[1], ib.shape[1])
    rows = []
    for t in range(len(la)):
        xa, xb = first(ia[t], la[t]), first(ib[t], lb[t])
        common = [c for c in xa if c in xb]
        rows.append([kl(xa, xb, common), kl(xb, xa, common), len(common) / k])
    return np.array(rows)


@pytest.mark.parametrize("ka, kb", [(6, 6), (20, 20), (6, 4), (17, 33), (64, 64), (70, 70)])
@pytest.mark.parametrize(
    ("dtype", "id_dtype"),
    [(np.float32, np.int64), (np.float64, np.int64), (np.float32, np.int32)],
)
def test_topk_matching_against_plain_dicts(
    ka: int, kb: int, dtype: type, id_dtype: type, topk_engine: str
) -> None:
    from dmlib.stats.logprob_figures import compiled_topk, topk_kl

    rng = np.random.default_rng(ka * 100 + kb)
    n = 3000
    # ids from a small pool (the other list lacks some), distinct in most lists and one
    # repeated in about a third; ids equal in their low 16 bits (7, 7 + 2**16, 7 + 2**40)
    # are different ids; int32 lists (the compiled pass compares them as stored) hold
    # 0 (what a lane past a list's end would read as) and the largest int32
    if id_dtype == np.int32:
        extra = [7, 7 + (1 << 16), 0, 2**31 - 1, 70_000, 3]
    else:
        extra = [7, 7 + (1 << 16), 7 + (1 << 40), 2**46 - 1, 70_000, 3]
    pool = np.array(extra + [100 + i for i in range(max(ka, kb))], dtype=id_dtype)

    def lists(k: int) -> np.ndarray:
        ids = np.stack([rng.permutation(pool)[:k] for _ in range(n)])
        twice = np.flatnonzero(rng.random(n) < 0.3)
        ids[twice, rng.integers(0, k, len(twice))] = ids[twice, rng.integers(0, k, len(twice))]
        return ids

    ia, ib = lists(ka), lists(kb)
    agree = rng.random(n) < 0.3  # some tokens list the same ids in the same order
    ib[agree, : min(ka, kb)] = ia[agree, : min(ka, kb)]
    # values from a small set (ties within and across the lists) and -inf
    levels = np.array([-0.1, -0.7, -1.5, -3.0, -8.0])
    la = levels[rng.integers(0, len(levels), (n, ka))].astype(dtype)
    lb = levels[rng.integers(0, len(levels), (n, kb))].astype(dtype)
    la[rng.random(la.shape) < 0.5 / ka] = -np.inf
    lb[rng.random(lb.shape) < 0.5 / kb] = -np.inf
    want = dict_topk(la, ia, lb, ib)
    assert (want[:, 2] < 1).any() and (want[:, 2] > 0).any()
    assert np.isinf(want[:, :2]).any() and np.isfinite(want[:, :2]).any()
    repeated = np.array([len(set(r)) < ka for r in ia.tolist()])
    assert repeated.any() and (~repeated).any()
    for rows in (1 << 13, 7):
        got = topk_kl(la, ia, lb, ib, rows=rows)
        for col, key in enumerate(("kl_topk_ab", "kl_topk_ba", "topk_overlap")):
            assert got[key] == pytest.approx(want[:, col], rel=1e-12, abs=1e-15), (key, rows)
    topk = compiled_topk()
    if topk_engine == "compiled" and topk is not None:  # the hash table's matching as well
        out = [np.empty(n) for _ in range(3)]
        widths = (la.itemsize, lb.itemsize, ia.itemsize, ib.itemsize)
        topk(la, ia, lb, ib, *out, n, ka, kb, *widths, True)
        for col in range(3):
            assert out[col] == pytest.approx(want[:, col], rel=1e-12, abs=1e-15), col


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_topk_against_the_numpy_path_on_extreme_values(
    dtype: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NaN, +-inf, values whose exp overflows or is subnormal, ids as int64 and int32 and
    a list of each length: the compiled pass gives the numpy path's figures (to the order
    of the float64 sums; NaN where it gives NaN, inf where it gives inf)."""
    from dmlib.stats import logprob_figures as figs

    if figs.compiled_topk() is None:
        pytest.skip("dmlib.kernels._fused (with topk) not built, or DMLIB_KERNELS=numpy")
    rng = np.random.default_rng(5)
    n, ka, kb = 4000, 8, 5
    odd = np.array([np.nan, np.inf, -np.inf, 720.0, -720.0, -740.0, -1e30, 0.0])
    ia = rng.integers(0, 12, (n, ka))
    ib = rng.integers(0, 12, (n, kb)).astype(np.int32)
    # each list holds part of the mass: 1 - (its sum) is no cancellation near 0
    la = np.log(rng.dirichlet(np.ones(ka + 6), n)[:, :ka]).astype(dtype)
    lb = np.log(rng.dirichlet(np.ones(kb + 6), n)[:, :kb]).astype(dtype)
    for arr in (la, lb):
        where = rng.random(arr.shape) < 0.08
        arr[where] = rng.choice(odd, int(where.sum())).astype(dtype)
    monkeypatch.setattr(figs, "USE_COMPILED", False)
    with np.errstate(invalid="ignore"):  # inf - inf of +inf log-probs: NaN, as wanted
        want = figs.topk_kl(la, ia, lb, ib)
    monkeypatch.setattr(figs, "USE_COMPILED", True)
    got = figs.topk_kl(la, ia, lb, ib, rows=333)
    for key in want:
        assert np.isnan(want[key]).any() or key == "topk_overlap"
        np.testing.assert_allclose(got[key], want[key], rtol=1e-9, atol=1e-12, err_msg=key)


def test_topk_lists_of_unlike_shapes_are_refused_before_the_kernel() -> None:
    from dmlib.stats.logprob_figures import topk_kl

    la, ia = np.zeros((5, 4), np.float32), np.zeros((5, 4), np.int64)
    with pytest.raises(DmlibError, match="top_ids"):
        topk_kl(la, ia[:, :3], la, ia)  # A lists 4 log-probs and 3 ids per token
    with pytest.raises(DmlibError, match="5 tokens in A, 4 in B"):
        topk_kl(la, ia, la[:4], ia[:4])
    with pytest.raises(DmlibError, match="expected one"):
        topk_kl(la.ravel(), ia.ravel(), la, ia)


def test_the_compiled_topk_checks_every_length_it_is_given() -> None:
    """Called directly with lengths that lie about its buffers, the C refuses (it reads
    nothing past what it checked); non-contiguous buffers are refused by the buffer
    protocol."""
    from dmlib.stats import logprob_figures as figs

    if figs.compiled_topk() is None:
        pytest.skip("dmlib.kernels._fused (with topk) not built, or DMLIB_KERNELS=numpy")
    topk = figs.compiled_topk()
    la, ia = np.zeros((5, 4), np.float32), np.zeros((5, 4), np.int64)
    outs = [np.zeros(5) for _ in range(3)]
    topk(la, ia, la, ia, *outs, 5, 4, 4, 4, 4, 8, 8)  # the honest call
    np.testing.assert_array_equal(outs[2], [0.25] * 5)  # id 0 in both lists: 1 of 4 ids
    for lie in (
        (6, 4, 4, 4, 4, 8, 8),  # one token more than the buffers hold
        (5, 5, 4, 4, 4, 8, 8),  # A's lists one longer
        (5, 4, 8, 4, 4, 8, 8),  # B's lists twice as long
        (5, 4, 4, 8, 4, 8, 8),  # A's log-probs read as float64
        (5, 4, 4, 4, 4, 4, 8),  # A's ids read as int32
        (5, 4, 4, 4, 3, 8, 8),  # a width that is no float
        (5, 0, 4, 4, 4, 8, 8),  # empty lists
        (-1, 4, 4, 4, 4, 8, 8),
    ):
        with pytest.raises(ValueError, match="do not match"):
            topk(la, ia, la, ia, *outs, *lie)
    with pytest.raises(ValueError, match="do not match"):
        topk(la, ia, la, ia, outs[0][:4], outs[1], outs[2], 5, 4, 4, 4, 4, 8, 8)
    with pytest.raises((BufferError, TypeError, ValueError)):
        topk(la[:, ::2], ia[:, ::2], la, ia, *outs, 5, 2, 4, 4, 4, 8, 8)


def _topk_sides(seed: int, s: int, t: int, k: int) -> tuple[dict, dict]:
    """Two padded sides with top-k lists: B's log-probs moved on some tokens and some of
    its ids replaced."""
    rng = np.random.default_rng(seed)
    a, b, tok = pair(seed=seed, s=s, t=t)
    ia = np.stack([rng.permutation(3 * k)[:k] for _ in range(s * t)]).reshape(s, t, k)
    ib = ia.copy()
    ib[..., -2:] = rng.integers(0, 3 * k, (s, t, 2))
    la = np.log(rng.dirichlet(np.ones(2 * k), (s, t))[..., :k]).astype(np.float32)
    lb = (la + rng.normal(0, 0.05, la.shape)).astype(np.float32)
    side_a = {"logprobs": a, "tokens": tok, "top_logprobs": la, "top_ids": ia.astype(np.int32)}
    side_b = {"logprobs": b, "tokens": tok, "top_logprobs": lb, "top_ids": ib.astype(np.int32)}
    return side_a, side_b


def test_blocks_on_threads_give_the_figures_of_one_block(
    monkeypatch: pytest.MonkeyPatch, topk_engine: str
) -> None:
    from dmlib.stats import logprobs as lp_mod

    sa, sb = _topk_sides(50, s=23, t=11, k=5)
    one = compare_logprobs(sa, sb)
    monkeypatch.setattr(lp_mod, "BLOCK_TOKENS", 13)  # 20 blocks of 1 or 2 sequences
    for threads in (1, 4):
        monkeypatch.setattr(lp_mod, "BLOCK_THREADS", threads)
        many = compare_logprobs(sa, sb)
        assert many.drop(columns="role").equals(one.drop(columns="role")), threads
        v, w = logprob_verdict(many), logprob_verdict(one)
        assert v.worst == w.worst
        for key, val in w.figures.items():
            assert v.figures[key] == pytest.approx(val, rel=1e-13, abs=1e-300), (threads, key)
    # the oracles: the sampled tokens' figures, and the top-k ones from plain dicts
    x, y = sa["logprobs"].reshape(-1), sb["logprobs"].reshape(-1)
    for key, val in oracle([x], [y]).items():
        assert v.figures[key] == pytest.approx(val, rel=1e-9), key
    per_token = dict_topk(
        sa["top_logprobs"].reshape(-1, 5),
        sa["top_ids"].reshape(-1, 5),
        sb["top_logprobs"].reshape(-1, 5),
        sb["top_ids"].reshape(-1, 5),
    )
    for col, key in enumerate(("kl_topk_ab", "kl_topk_ba", "topk_overlap")):
        assert v.figures[key] == pytest.approx(per_token[:, col].mean(), rel=1e-12), key


def test_a_block_refused_on_a_thread_is_refused_as_on_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dmlib.stats import logprobs as lp_mod

    sa, sb = _topk_sides(51, s=9, t=4, k=3)
    sb["top_ids"][6, 2, 1] = -5  # in the fourth block of 2 sequences
    monkeypatch.setattr(lp_mod, "BLOCK_TOKENS", 8)
    for threads in (1, 3):
        monkeypatch.setattr(lp_mod, "BLOCK_THREADS", threads)
        with pytest.raises(DmlibError, match="top_ids of B hold ids outside 0 .. 2\\*\\*46"):
            compare_logprobs(sa, sb)


@pytest.mark.parametrize(
    ("dtype", "bad", "refused"),
    [
        (np.int32, -1, True),
        (np.int64, -1, True),
        (np.int64, 1 << 46, True),
        (np.int64, (1 << 46) - 1, False),
        (np.uint64, 1 << 46, True),
        (np.uint32, (1 << 32) - 1, False),
        (np.int16, -3, True),
    ],
)
def test_ids_outside_the_range_are_refused_by_kind(dtype: type, bad: int, refused: bool) -> None:
    sa, sb = _topk_sides(52, s=2, t=3, k=3)
    for side in (sa, sb):
        side["top_ids"] = side["top_ids"].astype(dtype)
    sa["top_ids"][1, 2, 0] = bad
    if refused:
        with pytest.raises(DmlibError, match="top_ids of A hold ids outside"):
            compare_logprobs(sa, sb)
    else:
        v = logprob_verdict(compare_logprobs(sa, sb))
        assert v.figures["topk_overlap"] < 1  # the id is A's alone at that token


def test_on_threads_keeps_order_and_raises_the_first_failure() -> None:
    from dmlib.stats.logprob_figures import on_threads

    def square(i: int) -> int:
        if i in (5, 9):
            raise ValueError(f"item {i}")
        return i * i

    assert on_threads(square, list(range(5)), 3) == [0, 1, 4, 9, 16]
    assert on_threads(square, [], 3) == []
    for workers in (1, 4):
        with pytest.raises(ValueError, match="item 5"):
            on_threads(square, list(range(12)), workers)


@pytest.mark.parametrize("n_worst", [1, 3, 5, 8])
@pytest.mark.parametrize("n_seq", [2, 3])
def test_worst_positions_are_the_largest_first_tokens_among_ties(
    n_worst: int, n_seq: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against a plain sort of every token by (-|dlogprob|, sequence, position): fewer
    sequences than worst positions asked for, several worst ones in one sequence, ties at
    the cut (the first tokens win), and identical tokens never listed."""
    from dmlib.stats import logprobs as lp_mod

    x = [np.full(6, -1.0), np.full(4, -1.0), np.full(3, -1.0)][:n_seq]
    y = [
        np.array([-1.0, -1.5, -1.25, -2.0, -1.25, -1.0]),  # |d| 0, .5, .25, 1, .25, 0
        np.array([-1.25, -1.0, -1.25, -1.5]),  # .25, 0, .25, .5
        np.array([-1.0, -1.0, -1.0]),
    ][:n_seq]
    want = sorted(
        (-abs(float(b - a)), s, p)
        for s, (xa, yb) in enumerate(zip(x, y, strict=True))
        for p, (a, b) in enumerate(zip(xa, yb, strict=True))
        if a != b
    )[:n_worst]
    for block in (1 << 18, 4, 1):  # one block; several; one sequence per block
        monkeypatch.setattr(lp_mod, "BLOCK_TOKENS", block)
        v = logprob_verdict(compare_logprobs(x, y, n_worst=n_worst))
        got = [(-w["abs_dlogprob"], w["sequence"], w["position"]) for w in v.worst]
        assert got == want, block


def test_finite_pairs_whose_difference_overflows_count_as_finite() -> None:
    """Finiteness is of the two log-probs, not of their difference: -1e308 against 1e308
    overflows d to inf, yet both are finite (n_nonfinite 0, by hand); a NaN pair is not."""
    x = [np.array([-1e308, -1.0, -2.0])]
    y = [np.array([1e308, -1.0, -2.5])]
    with np.errstate(over="ignore", invalid="ignore"):  # exp and inf - inf in the figures
        v = logprob_verdict(compare_logprobs(x, y))
    assert (v.n_tokens, v.n_diff, v.n_nonfinite) == (3, 2, 0)
    v = logprob_verdict(compare_logprobs(x, [np.array([np.nan, -1.0, -2.5])]))
    assert (v.n_tokens, v.n_diff, v.n_nonfinite) == (3, 2, 1)
    assert v.figures["max_abs_dlogprob"] == 0.5 and v.worst[0]["position"] == 0
