"""Factorised layers judged by their effective weight, with planted ground truth."""

from __future__ import annotations

import numpy as np
import pytest

import dmlib
from dmlib.forensics.factors import effective_weights

SVD = dmlib.FactorGroup.svd("{prefix}.u", "{prefix}.s", "{prefix}.v")


def _orthonormal(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((m, k)))
    return q


@pytest.fixture
def svd_layers() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(11)
    out = {}
    for prefix, (m, n, k) in {"blocks.0.attn": (12, 9, 4), "blocks.1.mlp": (16, 7, 5)}.items():
        out[f"{prefix}.u"] = _orthonormal(rng, m, k)
        out[f"{prefix}.s"] = np.sort(rng.uniform(0.5, 3.0, k))[::-1].copy()
        out[f"{prefix}.v"] = _orthonormal(rng, n, k)
    out["embed.weight"] = rng.standard_normal((5, 3))
    return out


def test_sign_flipped_factors_have_identical_effective_weight(svd_layers):
    b = dict(svd_layers)
    flips = np.array([1.0, -1.0, 1.0, -1.0])  # R = diag(flips), orthogonal, R R = I
    b["blocks.0.attn.u"] = svd_layers["blocks.0.attn.u"] * flips
    b["blocks.0.attn.v"] = svd_layers["blocks.0.attn.v"] * flips
    df = dmlib.compare_factors(svd_layers, b, SVD)
    assert list(df["group"]) == ["blocks.0.attn", "blocks.1.mlp"]
    row = df.set_index("group").loc["blocks.0.attn"]
    # (-u)(s)(-v) == u s v exactly in float64, so the effective weights are bit-identical
    assert row["rel_fro"] == 0.0
    assert row["max_abs"] == 0.0
    assert row["n_diff"] == 0
    # ... while the factors themselves differ in every element of the two flipped columns
    assert row["factor_n_diff"] == 2 * 12 + 2 * 9
    assert row["factor_numel"] == 12 * 4 + 4 + 9 * 4
    assert row["shape"] == [12, 9] and row["kind"] == "svd" and row["status"] == "ok"


def test_planted_singular_value_delta_gives_known_rel_fro(svd_layers):
    b = dict(svd_layers)
    s = svd_layers["blocks.1.mlp.s"]
    delta = 1e-3
    b["blocks.1.mlp.s"] = s + np.array([0, 0, delta, 0, 0])
    df = dmlib.compare_factors(svd_layers, b, [SVD])
    row = df.set_index("group").loc["blocks.1.mlp"]
    # dW = delta u_2 v_2^T with unit u_2, v_2: ||dW||_F = delta; ||W||_F = ||s||_2
    assert row["rel_fro"] == pytest.approx(delta / np.sqrt((s**2).sum()), rel=1e-9)
    u2, v2 = svd_layers["blocks.1.mlp.u"][:, 2], svd_layers["blocks.1.mlp.v"][:, 2]
    assert row["max_abs"] == pytest.approx(delta * np.abs(u2).max() * np.abs(v2).max(), rel=1e-9)
    assert row["factor_n_diff"] == 1
    assert row["norm"] == pytest.approx(np.sqrt((s**2).sum()), rel=1e-12)
    assert df.attrs["worst_group"] == "blocks.1.mlp"
    assert df.attrs["worst_rel_fro"] == row["rel_fro"]
    assert df.set_index("group").loc["blocks.0.attn", "rel_fro"] == 0.0


def test_lowrank_with_transposed_storage_and_float32_upcast():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((6, 2)).astype(np.float32)
    bmat = rng.standard_normal((2, 5)).astype(np.float32)
    b2 = bmat * np.float32(2)  # exact: the effective weight doubles, rel_fro = 1
    run_a = {"lora.q.A": a.T.copy(), "lora.q.B": bmat}  # A stored transposed
    run_b = {"lora.q.A": a.T.copy(), "lora.q.B": b2}
    group = dmlib.FactorGroup.lowrank("lora.{prefix}.A", "lora.{prefix}.B", transpose_a=True)
    df = dmlib.compare_factors(run_a, run_b, group)
    row = df.iloc[0]
    assert row["group"] == "q" and row["shape"] == [6, 5]
    assert row["rel_fro"] == 1.0
    w = a.astype(np.float64) @ bmat.astype(np.float64)
    assert row["max_abs"] == np.abs(w).max()
    assert row["factor_n_diff"] == 10
    eff = effective_weights(run_a, group)
    assert list(eff) == ["q"]
    w = eff["q"].load()
    assert w.dtype == np.float64
    np.testing.assert_array_equal(w, a.astype(np.float64) @ bmat.astype(np.float64))


def test_effective_weights_is_a_tensor_set_of_products(svd_layers):
    eff = effective_weights(svd_layers, SVD)
    assert isinstance(eff, dmlib.ArrayTensorSet)
    assert sorted(eff) == ["blocks.0.attn", "blocks.1.mlp"]
    u, s, v = (svd_layers[f"blocks.0.attn.{k}"] for k in "usv")
    np.testing.assert_allclose(
        eff["blocks.0.attn"].load(), u @ np.diag(s) @ v.T, rtol=0, atol=1e-14
    )


def test_layer_only_in_one_run_is_a_row(svd_layers):
    b = {k: v for k, v in svd_layers.items() if not k.startswith("blocks.1.")}
    df = dmlib.compare_factors(svd_layers, b, SVD).set_index("group")
    assert df.loc["blocks.1.mlp", "status"] == "only in a"
    assert df.loc["blocks.0.attn", "status"] == "ok"


def test_bad_groups():
    with pytest.raises(dmlib.DmlibError, match=r"must contain '\{prefix\}' exactly once"):
        dmlib.FactorGroup.svd("u", "{prefix}.s", "{prefix}.v")
    with pytest.raises(dmlib.DmlibError, match="unknown factor group kind"):
        dmlib.FactorGroup("tucker", ("{prefix}.a",), (False,))
    with pytest.raises(dmlib.TensorNotFoundError, match="no factorised layer matches"):
        dmlib.compare_factors({"x": np.ones(2)}, {"x": np.ones(2)}, SVD)
    bad = {"l.u": np.ones((4, 3)), "l.s": np.ones(2), "l.v": np.ones((5, 3))}
    with pytest.raises(dmlib.DmlibError, match=r"do not fit U\[m,k\] s\[k\] V\[n,k\]"):
        dmlib.compare_factors(bad, bad, SVD)


def test_factor_matrix_covers_every_pair_with_planted_deltas():
    """Three runs: b has singular value 0 scaled by (1 + d), c is a's exact copy."""
    from dmlib.forensics.factors import FactorGroup, factor_matrix

    rng = np.random.default_rng(5)
    u, _ = np.linalg.qr(rng.standard_normal((6, 3)))
    v, _ = np.linalg.qr(rng.standard_normal((5, 3)))
    s = np.array([3.0, 2.0, 1.0])
    d = 0.25
    s_b = s.copy()
    s_b[0] *= 1 + d
    runs = {
        "a": {"l.u": u, "l.s": s, "l.v": v},
        "b": {"l.u": u, "l.s": s_b, "l.v": v},
        "c": {"l.u": u.copy(), "l.s": s.copy(), "l.v": v.copy()},
    }
    df = factor_matrix(runs, FactorGroup.svd("{prefix}.u", "{prefix}.s", "{prefix}.v"))
    pairs = df.attrs["pairs"].set_index(["a", "b"])["rel_fro"]
    assert list(pairs.index) == [("a", "b"), ("a", "c"), ("b", "c")]
    # ||W_a - W_b||_F / ||W_a||_F = d * s0 / ||s|| since u, v have orthonormal columns
    expected = d * s[0] / np.linalg.norm(s)
    assert pairs[("a", "b")] == pytest.approx(expected, rel=1e-12)
    assert pairs[("a", "c")] == 0.0
    assert pairs[("b", "c")] == pytest.approx(d * s[0] / np.linalg.norm(s_b), rel=1e-12)
