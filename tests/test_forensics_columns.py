"""First divergent column, column cosines and sign flips, on a QR with a known perturbation."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import dmlib
from dmlib.forensics.columns import (
    first_column_summary,
    first_divergent_columns,
    sign_flip_table,
)

# ---------------------------------------------------------------------------
# a small Householder QR whose column-norm reduction can be perturbed


def _norm_forward(x: np.ndarray) -> np.floating:
    acc = x.dtype.type(0)
    for v in x:  # strictly sequential, so the order is the one written here
        acc = acc + v * v
    return np.sqrt(acc)


def _norm_reversed(x: np.ndarray) -> np.floating:
    return _norm_forward(x[::-1])


def householder_q(a: np.ndarray, *, perturb_from: int | None = None, mode: str = "ulp"):
    """Thin Q of a Householder QR of ``a`` (m >= n), in a's dtype.

    From iteration ``perturb_from`` on, the reductions are perturbed: ``"ulp"`` nudges
    the column norm and the reflector's norm up by one ULP, ``"order"`` sums the column
    norm in reverse order. Returns (Q, norms), the column norm each iteration used.
    """
    r = np.array(a, copy=True)
    m, n = r.shape
    vs, norms = [], []
    for j in range(n):
        x = r[j:, j].copy()
        perturbed = perturb_from is not None and j >= perturb_from
        if perturbed and mode == "order":
            norm = _norm_reversed(x)
        else:
            norm = _norm_forward(x)
            if perturbed:
                norm = np.nextafter(norm, np.inf, dtype=r.dtype)
        norms.append(norm)
        alpha = -norm if x[0] >= 0 else norm
        v = x.copy()
        v[0] = v[0] - alpha
        vnorm = _norm_forward(v)
        if perturbed and mode == "ulp":
            # the second reduction of the iteration: a nudge here reaches every element of v
            vnorm = np.nextafter(vnorm, np.inf, dtype=r.dtype)
        v = v / vnorm
        full = np.zeros(m, dtype=r.dtype)
        full[j:] = v
        vs.append(full)
        # R <- H_j R, H_j = I - 2 v v^T
        r[j:, j:] -= (2 * v)[:, None] * (v @ r[j:, j:])[None, :]
    # column j of Q = H_0 ... H_j e_j: it uses reflectors 0..j only
    q = np.zeros((m, n), dtype=r.dtype)
    for j in range(n):
        col = np.zeros(m, dtype=r.dtype)
        col[j] = 1
        for i in range(j, -1, -1):
            col = col - (2 * vs[i]) * (vs[i] @ col)
        q[:, j] = col
    return q, np.array(norms)


@pytest.fixture(scope="module")
def mat32() -> np.ndarray:
    return np.random.default_rng(7).standard_normal((24, 10)).astype(np.float32)


def test_householder_helper_is_a_qr(mat32):
    q, _ = householder_q(mat32.astype(np.float64))
    np.testing.assert_allclose(q.T @ q, np.eye(10), atol=1e-12)
    # Q spans the columns of A: projecting A onto Q reproduces A
    a = mat32.astype(np.float64)
    np.testing.assert_allclose(q @ (q.T @ a), a, atol=1e-10)


def test_unperturbed_qr_is_identical(mat32):
    q1, _ = householder_q(mat32)
    q2, _ = householder_q(mat32)
    assert dmlib.first_divergent_column(q1, q2) is None


@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_one_ulp_nudge_from_iteration_k_diverges_at_column_k(mat32, k):
    q_ref, _ = householder_q(mat32)
    q_pert, _ = householder_q(mat32, perturb_from=k)
    assert dmlib.first_divergent_column(q_ref, q_pert) == k
    # the same reading on the transposed layout, with axis=0
    assert dmlib.first_divergent_column(q_ref.T, q_pert.T, axis=0) == k


def test_summation_order_change_reads_first_disagreeing_iteration(mat32):
    # Ground truth from the norms themselves: the first iteration where the two
    # processes' reductions disagree, whichever iteration the change of order began.
    k = 3
    q_ref, n_ref = householder_q(mat32)
    q_pert, n_pert = householder_q(mat32, perturb_from=k, mode="order")
    disagree = np.flatnonzero(n_ref.view(np.uint32) != n_pert.view(np.uint32))
    assert disagree.size, "the reversed order never changed a norm; pick another seed"
    assert disagree[0] >= k
    assert dmlib.first_divergent_column(q_ref, q_pert) == disagree[0]


def test_bit_semantics_nan_equal_and_signed_zero_differs():
    a = np.array([[1.0, np.nan, 0.0]], dtype=np.float32)
    assert dmlib.first_divergent_column(a, a.copy()) is None  # same NaN bits: equal
    b = a.copy()
    b[0, 2] = -0.0
    assert dmlib.first_divergent_column(a, b) == 2  # -0 vs +0: differs
    c = a.copy()
    c.view(np.uint32)[0, 1] = 0x7FC00001  # another NaN payload
    assert dmlib.first_divergent_column(a, c) == 1


def test_first_divergent_column_bad_input():
    a = np.zeros((3, 4), np.float32)
    with pytest.raises(dmlib.DmlibError, match=r"shapes differ, \[3, 4\] vs \[4, 3\]"):
        dmlib.first_divergent_column(a, np.zeros((4, 3), np.float32))
    with pytest.raises(dmlib.DmlibError, match="dtypes differ"):
        dmlib.first_divergent_column(a, a.astype(np.float64))
    with pytest.raises(dmlib.DmlibError, match="axis 2 is out of range"):
        dmlib.first_divergent_column(a, a, axis=2)


def test_column_cosines_hand_cases():
    a = np.array([[1.0, 0.0, 0.0, 3.0, 1.0], [0.0, 0.0, 0.0, 4.0, 1.0]])
    b = np.array([[-1.0, 0.0, 2.0, 3.0, 1.0], [0.0, 0.0, 0.0, 4.0, -1.0]])
    cos = dmlib.column_cosines(a, b)
    assert cos.dtype == np.float64
    assert cos[0] == -1.0  # negated column
    assert cos[1] == 1.0  # zero in both: nothing differs
    assert np.isnan(cos[2])  # zero in one only: no direction
    assert cos[3] == 1.0
    assert cos[4] == 0.0  # orthogonal


def test_sign_flips_counts_negated_columns_against_scatter():
    rng = np.random.default_rng(1)
    q, _ = np.linalg.qr(rng.standard_normal((30, 8)))
    b = q.copy()
    b[:, [2, 5]] *= -1  # two flipped reflectors
    b[:, 6] += 1e-9 * rng.standard_normal(30)  # a sign-preserving scatter
    res = dmlib.sign_flips(q, b)
    assert res["n_cols"] == 8
    assert res["n_changed"] == 3
    assert res["n_flipped"] == 2
    assert res["flipped_cols"] == [2, 5]
    assert res["n_scatter"] == 1
    assert res["min_cosine"] == pytest.approx(-1.0)
    # no flips at all: a pure scatter
    only = dmlib.sign_flips(q, q + 1e-9)
    assert only["n_flipped"] == 0 and only["n_scatter"] == 8


def test_tables_over_runs(mat32):
    # runs A, B identical; C perturbed from column 2; D from column 5 on one tensor
    q0, _ = householder_q(mat32)
    q2, _ = householder_q(mat32, perturb_from=2)
    q5, _ = householder_q(mat32, perturb_from=5)
    bias = np.ones(4, np.float32)
    runs = {
        "A": {"l0.q": q0, "l1.q": q0, "bias": bias},
        "B": {"l0.q": q0, "l1.q": q0, "bias": bias},
        "C": {"l0.q": q2, "l1.q": q0, "bias": bias},
        "D": {"l0.q": q0, "l1.q": q5, "bias": bias},
    }
    df = first_divergent_columns(runs, include="*.q")
    assert list(df.columns) == ["pair", "a", "b", "name", "first_col", "n_cols", "identical"]
    assert len(df) == 6 * 2  # 6 run pairs x 2 tensors; the 1-D bias is not selected
    got = {
        (p, n): None if pd.isna(f) else int(f)
        for p, n, f in zip(df["pair"], df["name"], df["first_col"], strict=True)
    }
    expected = {
        ("A/B", "l0.q"): None, ("A/B", "l1.q"): None,
        ("A/C", "l0.q"): 2, ("A/C", "l1.q"): None,
        ("A/D", "l0.q"): None, ("A/D", "l1.q"): 5,
        ("B/C", "l0.q"): 2, ("B/C", "l1.q"): None,
        ("B/D", "l0.q"): None, ("B/D", "l1.q"): 5,
        ("C/D", "l0.q"): 2, ("C/D", "l1.q"): 5,
    }  # fmt: skip
    assert got == expected
    summary = first_column_summary(df)
    assert summary == {
        "n_pairs": 12,
        "n_identical": 6,
        "first_col_min": 2,
        "first_col_median": 3.5,
        "first_col_max": 5,
    }
    assert df.attrs["summary"] == summary
    flips = sign_flip_table(runs, include="*.q")
    assert len(flips) == 12
    assert flips["n_flipped"].sum() == 0
    assert flips.set_index(["pair", "name"]).loc[("A/C", "l0.q"), "n_changed"] == 8  # columns 2..9


def test_tables_need_two_runs():
    with pytest.raises(dmlib.DmlibError, match="at least two runs"):
        first_divergent_columns({"A": {"x": np.zeros((2, 2))}})
