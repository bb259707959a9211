"""The qr_init generator: its reductions, its autotuner, its Householder QR, and its dataset."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

import dmlib
from dmlib.lab import qr_init
from dmlib.lab.qr_init import (
    CANDIDATES,
    USUAL_WINNER,
    Autotuner,
    blocked_sum,
    householder_qr,
    key_columns,
    reduce_sum,
    shape_key,
)

BLOCKS = (1, 4, 8, 16, 32, 64)


def _matrix(m: int, n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, n), np.float32)


def _fixed(kernel: str, m: int, n: int, bucket: int = qr_init.BUCKET) -> Autotuner:
    """A tuner that runs ``kernel`` for every key an ``m x n`` QR uses (nothing is raced)."""
    return Autotuner(
        win_prob=1.0, bucket=bucket, cache=dict.fromkeys(key_columns(m, n, bucket), kernel)
    )


def _no_entropy(n: int) -> bytes:
    raise AssertionError("a race was run where the cache should have answered")


# ----------------------------------------------------------------------------- reductions


def test_summation_order_is_visible_in_float32() -> None:
    # hand computation: in float32 1e8 + 1 rounds to 1e8 (ulp(1e8) = 8)
    x = np.array([1e8, 1, -1e8, 1], np.float32)[:, None]
    # one sequential block: ((1e8 + 1) - 1e8) + 1 = 0 + 1 = 1
    assert (
        blocked_sum(x, 4)[0]
        == reduce_sum(x, "sequential")[0]
        == reduce_sum(x, "pairwise/4")[0]
        == 1
    )
    # pairs: (1e8 + 1) + (-1e8 + 1) = 1e8 + (-1e8) = 0
    assert blocked_sum(x, 2)[0] == blocked_sum(x, 1)[0] == reduce_sum(x, "tree")[0] == 0


@pytest.mark.parametrize("kernel", CANDIDATES)
def test_every_candidate_is_a_correct_sum(kernel: str) -> None:
    x = _matrix(203, 5, seed=len(kernel))  # 203 is no multiple of any block: zero rows are added
    got = reduce_sum(x, kernel)
    assert got.dtype == np.float32 and got.shape == (5,)
    np.testing.assert_allclose(got, x.astype(np.float64).sum(axis=0), rtol=0, atol=1e-4)


@pytest.mark.parametrize("block", BLOCKS)
def test_blocked_sum_matches_float64_sum(block: int) -> None:
    x = _matrix(203, 5, seed=block)
    np.testing.assert_allclose(
        blocked_sum(x, block), x.astype(np.float64).sum(axis=0), rtol=0, atol=1e-4
    )


def test_sequential_kernel_is_a_left_to_right_loop() -> None:
    x = _matrix(30, 1, seed=3)[:, 0]
    seq = np.float32(0)
    for v in x:
        seq = np.float32(seq + v)
    assert reduce_sum(x[:, None], "sequential")[0] == seq == blocked_sum(x[:, None], 32)[0]


def test_candidates_round_differently_at_every_qr_length() -> None:
    # the race is only a source of nondeterminism if the kernels really add in other orders
    for length in range(37, 101):
        x = _matrix(length, 200, seed=length)
        sums = {k: reduce_sum(x, k).view(np.uint32) for k in CANDIDATES}
        for a, b in itertools.combinations(CANDIDATES, 2):
            assert (sums[a] != sums[b]).any(), f"{a} and {b} agree at length {length}"


def test_unknown_kernel_or_op_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown reduction kernel"):
        reduce_sum(_matrix(4, 1), "pairwise/3")
    with pytest.raises(ValueError, match="unknown reduction"):
        shape_key("matmul", 10)


# ----------------------------------------------------------------------------- autotuner


def test_shape_key_buckets_lengths() -> None:
    assert shape_key("norm", 100) == shape_key("norm", 97) == "norm:112"
    assert shape_key("norm", 96) == shape_key("norm", 81) == "norm:96"
    assert shape_key("dot", 80) == "dot:80" and shape_key("dot", 37) == "dot:48"
    assert shape_key("dot", 63, bucket=1) == "dot:63"
    # a 100 x 64 QR touches lengths 100..37: buckets 112, 96, 80, 64, 48, two ops each
    cols = key_columns(100, 64)
    assert list(cols) == [f"{op}:{b}" for b in (112, 96, 80, 64, 48) for op in ("norm", "dot")]
    assert cols["norm:112"] == [0, 1, 2, 3] and cols["dot:96"] == list(range(4, 20))
    assert cols["norm:48"] == list(range(52, 64))


def test_tuner_is_lazy_cached_and_unseeded() -> None:
    draws: list[int] = []

    def entropy(n: int) -> bytes:  # a counting stand-in for os.urandom
        draws.append(n)
        return (len(draws) * 0x0101010101).to_bytes(n, "little")

    t = Autotuner(win_prob=0.0, entropy=entropy, cache={"dot:80": "tree"})
    assert t.cache == {}
    k = t.kernel("norm", 100)
    # win_prob 0: the race is lost; the second draw, 0x0202020202 = 2 (mod 4), picks the
    # third of the four others
    assert draws == [8, 8] and CANDIDATES[1:][2] == k == "pairwise/4"
    assert t.kernel("norm", 97) == k and len(draws) == 2  # same key: cached, no new race
    assert t.kernel("dot", 75) == "tree" and len(draws) == 2  # preset: replayed, not raced
    assert t.cache == {"norm:112": k, "dot:80": "tree"} and t.raced == ["norm:112"]
    assert t.summary() == f"norm:112={k} dot:80=tree"
    always = Autotuner(win_prob=1.0)
    assert {always.kernel(op, n) for op in ("norm", "dot") for n in range(37, 101)} == {
        USUAL_WINNER
    }


def test_tuner_win_probability_is_honoured() -> None:
    t = Autotuner(win_prob=0.9, bucket=1)
    picks = [t.kernel("norm", n) for n in range(1, 4001)]
    usual = picks.count(USUAL_WINNER) / len(picks)
    # binomial(4000, 0.9): sd = 0.0047; 0.88..0.92 is more than 4 sd either side
    assert 0.88 < usual < 0.92
    assert set(picks) == set(CANDIDATES)


def test_tuner_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="win_prob"):
        Autotuner(win_prob=1.5)
    with pytest.raises(ValueError, match="not one of"):
        Autotuner(cache={"norm:112": "fastest"})


# ----------------------------------------------------------------------------- QR


@pytest.mark.parametrize("kernel", CANDIDATES)
@pytest.mark.parametrize("shape", [(100, 64), (37, 13), (64, 64)])
def test_qr_against_numpy(kernel: str, shape: tuple[int, int]) -> None:
    a = _matrix(*shape, seed=shape[0])
    q, r = householder_qr(a, tuner=_fixed(kernel, *shape))
    qn, rn = np.linalg.qr(a.astype(np.float64))
    assert q.dtype == np.float32 and q.shape == shape and r.shape == (shape[1], shape[1])
    assert np.array_equal(r, np.triu(r)), "R is not upper triangular"
    np.testing.assert_allclose(q.T.astype(np.float64) @ q, np.eye(shape[1]), atol=2e-6)
    np.testing.assert_allclose(q.astype(np.float64) @ r, a, atol=2e-5)
    # unique up to the sign of each column (and the matching row of R)
    sign = np.sign(np.diag(r)) * np.sign(np.diag(rn))
    np.testing.assert_allclose(q, qn * sign, atol=2e-5)
    np.testing.assert_allclose(r, rn * sign[:, None], atol=5e-5)


def test_qr_zero_column_is_skipped_and_wide_matrix_rejected() -> None:
    a = _matrix(20, 4)
    a[:, 1] = 0
    q, r = householder_qr(a, tuner=_fixed("pairwise/4", 20, 4))
    assert np.isfinite(q).all()
    np.testing.assert_allclose(q.astype(np.float64) @ r, a, atol=1e-5)
    with pytest.raises(ValueError, match="m >= n"):
        householder_qr(_matrix(3, 5), tuner=Autotuner(win_prob=1.0))


def test_same_cache_is_bit_identical() -> None:
    a = _matrix(100, 64, seed=11)
    raced = Autotuner(win_prob=0.5)  # races every key from os.urandom
    q1, _ = householder_qr(a, tuner=raced)
    assert list(raced.cache) == list(key_columns(100, 64)) == raced.raced
    # another tuner holding the recorded cache: no race is run, the bits are the same
    q2, _ = householder_qr(a.copy(), tuner=Autotuner(cache=raced.cache, entropy=_no_entropy))
    assert dmlib.first_divergent_column(q1, q2) is None
    assert np.array_equal(q1.view(np.uint32), q2.view(np.uint32))


def _entry(key: str, cols: list[int]) -> int:
    # a norm key changes the reflector of its first column; a dot key changes only the
    # trailing update and the later columns (v^T e_j is exact in any order), so one later
    return cols[0] + (key.startswith("dot") and 1)


def test_first_divergent_column_is_the_first_key_tuned_differently() -> None:
    a = _matrix(100, 64, seed=5)
    q0, _ = householder_qr(a, tuner=Autotuner(win_prob=1.0))
    for key, cols in key_columns(100, 64).items():
        firsts = []
        for other in CANDIDATES[1:]:
            q, _ = householder_qr(a, tuner=Autotuner(win_prob=1.0, cache={key: other}))
            first = dmlib.first_divergent_column(q0, q)
            assert first is not None, f"{key}={other}: no difference at all"
            # every column before the key's first use is untouched, whatever the kernel
            assert first >= _entry(key, cols), f"{key}={other}: divergence at {first}"
            # a scatter of ULPs, no flipped reflector
            assert np.abs(q0 - q).max() < 2e-6 and ((q0 > 0) == (q > 0)).mean() > 0.999
            firsts.append(first)
        # ... and the difference does enter at that column (some kernel pairs may round one
        # particular sum alike, which pushes the entry further in: hence min)
        assert min(firsts) == _entry(key, cols), (key, firsts)


@pytest.mark.parametrize("op", ["norm", "dot"])
@pytest.mark.parametrize("k", [0, 1, 17, 37, 58])
def test_per_length_keys_put_the_entry_at_any_column(op: str, k: int) -> None:
    # bucket 1: one key per length, used by column k = 100 - length alone; so the kernel
    # either rounds that column's sums differently, and the entry is exactly the key's, or
    # it happens to round them alike, and nothing differs at all
    a = _matrix(100, 64, seed=k)
    q0, _ = householder_qr(a, tuner=Autotuner(win_prob=1.0, bucket=1))
    firsts = []
    for other in CANDIDATES[1:]:
        tuner = Autotuner(win_prob=1.0, bucket=1, cache={f"{op}:{100 - k}": other})
        firsts.append(dmlib.first_divergent_column(q0, householder_qr(a, tuner=tuner)[0]))
    entry = _entry(op, [k])
    assert set(firsts) <= {entry, None} and entry in firsts, firsts


# ----------------------------------------------------------------------------- the dataset

USUAL = {"win_prob": 1.0}
# p1, p2: the same (all-usual) cache; p3: differs only at norm:80, first used at column 20;
# ckpt races its own keys from os.urandom
TUNING = {
    "p1": USUAL,
    "p2": USUAL,
    "p3": {"win_prob": 1.0, "cache": {"norm:80": "tree"}},
    "seed8": USUAL,
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    out = tmp_path_factory.mktemp("lab")
    section = qr_init.generate(out, small=True, tuning=TUNING)
    return out, section, json.loads((out / "qr_init" / "index.json").read_text())


def test_manifest_section_and_strategies(dataset: tuple) -> None:
    out, section, index = dataset
    assert section["name"] == "qr_init" and "os.urandom" in section["description"]
    for rel in section["files"]:
        assert (out / rel).is_file(), rel
    assert {"qr_init/index.json", "qr_init/README.md", "qr_init/checkpoint_records.bpk"} <= set(
        section["files"]
    )
    assert index["runs"]["seed8"] == index["control_file"] == "seed8_control.bpk"
    assert index["seed"] == 7 and index["records_file"] == "checkpoint_records.bpk"
    assert len(set(index["pids"].values())) == 5  # every process ran separately
    st = index["strategies"]
    keys = list(key_columns(100, 64))
    for lab in ("p1", "p2", "p3", "seed8", "ckpt"):
        assert list(st[lab]["cache"]) == keys, lab  # every key, in first-use order
    assert st["p1"]["cache"] == st["p2"]["cache"] == dict.fromkeys(keys, USUAL_WINNER)
    assert st["p3"]["not_usual"] == {"norm:80": "tree"}
    assert st["p1"]["source"] == "env DMLIB_QR_AUTOTUNE" and st["ckpt"]["source"] == "os.urandom"
    assert set(st["ckpt"]["cache"].values()) <= set(CANDIDATES)


def _open(out, index, label):
    return dmlib.open_tensors(out / "qr_init" / index["runs"][label])


def test_direct_draws_identical_factors_differ_from_the_key_on(dataset: tuple) -> None:
    out, _, index = dataset
    p1, p2, p3 = (_open(out, index, lab) for lab in ("p1", "p2", "p3"))
    factors = [n for n in p1 if n.endswith((".proj.u", ".proj.v"))]
    assert len(factors) == 4 and len(p1) == 1 + 5 * 2 + 2
    firsts = {}
    for n in p1:
        assert p1[n].dtype == np.float32
        if n in factors:
            assert p1[n].data_hash() == p2[n].data_hash(), f"{n}: same cache, different bits"
            firsts[n] = dmlib.first_divergent_column(p1[n].load(), p3[n].load())
            np.testing.assert_allclose(p1[n].load(), p3[n].load(), atol=2e-6)
        else:
            assert p1[n].data_hash() == p2[n].data_hash() == p3[n].data_hash(), n
    # norm:80 is first used at column 20: nothing before it can differ, and it does enter there
    assert all(f is not None and f >= 20 for f in firsts.values()), firsts
    assert min(firsts.values()) == 20, firsts
    # the generator's own record (computed apart from the library) agrees
    assert index["pairs"]["p1/p3"]["first_divergent_column"] == firsts
    assert set(index["pairs"]["p1/p2"]["first_divergent_column"].values()) == {None}
    assert index["pairs"]["p1/p2"]["bit_identical"] and not index["pairs"]["p1/p3"]["bit_identical"]
    # the files still differ: param_ids are per process
    assert p1.file_hash() != p2.file_hash()
    assert p1["embed.weight"].param_id != p2["embed.weight"].param_id
    md = p3.metadata
    assert (
        md["qr_autotune_not_usual"] == "norm:80=tree"
        and p1.metadata["qr_autotune_not_usual"] == "none"
    )
    assert md["qr_autotune_cache"].split() == [
        f"{k}={v}" for k, v in index["strategies"]["p3"]["cache"].items()
    ]
    assert all(isinstance(v, str) for v in md.values())


def test_control_differs_everywhere(dataset: tuple) -> None:
    out, _, index = dataset
    p1, ctl = _open(out, index, "p1"), _open(out, index, "seed8")
    assert list(p1) == list(ctl)
    for n in p1:
        assert (p1[n].load() != ctl[n].load()).mean() > 0.99, n
    # the effective weight of a block moves by O(1), not O(1e-6)
    w = [
        (t["blocks.0.proj.u"].load() * t["blocks.0.proj.s"].load()) @ t["blocks.0.proj.v"].load().T
        for t in (p1, ctl)
    ]
    assert np.linalg.norm(w[0] - w[1]) / np.linalg.norm(w[0]) > 0.5


def test_readme_reports_the_entry_columns(dataset: tuple) -> None:
    out, _, index = dataset
    e = qr_init.entry_summary(index)
    # p1/p2 identical (4 tensors), p1/p3 and p2/p3 alike: the same 4 entries each
    firsts = sorted(index["pairs"]["p1/p3"]["first_divergent_column"].values())
    assert e["tensor_pairs"] == 12 and e["identical_tensor_pairs"] == 4
    assert (e["first_col_min"], e["first_col_max"]) == (firsts[0], firsts[-1])
    assert e["first_col_median"] == float(np.median(firsts * 2))
    assert (e["run_pairs"], e["identical_run_pairs"]) == (3, 1)
    text = (out / "qr_init" / "README.md").read_text()
    assert f"first divergent column min {firsts[0]}" in text and "`norm:80=tree`" in text


def test_records_file_has_dirty_padding_and_clean_tensors(dataset: tuple) -> None:
    out, _, _ = dataset
    path = out / "qr_init" / "checkpoint_records.bpk"
    ts = dmlib.open_tensors(path)
    assert len(ts.records) == 3
    model, optim, ema = ts.records
    assert all(r.scalars == {"step": 3} for r in ts.records)
    assert len(optim) == 2 * len(model)
    # the optimizer record maps each param_id to the module path of its parameter
    for name, t in model.items():
        assert optim.metadata[str(t.param_id)] == name
        assert f"{t.param_id}.moment_2" in optim
        assert ema[name].param_id == t.param_id
    for r in ts.records:
        for t in r.values():
            v = t.load()
            assert np.isfinite(v).all() and (np.abs(v) < 1e30).all(), t.name
    census = dmlib.padding_census(ts)
    between = census.gaps[census.gaps["kind"] == "between-tensors"]
    assert between["nonzero_bytes"].sum() > 0
    assert between["nan"].sum() > 0 and between["huge"].sum() > 0
    # Burn's own writer of the same record: same tensors, zero padding
    plain = dmlib.open_tensors(out / "qr_init" / "checkpoint_model.bpk")
    assert plain.data_hash() == model.data_hash()
    assert dmlib.padding_census(plain).gaps["nonzero_bytes"].sum() == 0
    assert plain.file_hash() != ts.file_hash()
