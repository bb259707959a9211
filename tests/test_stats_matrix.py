"""dmlib.matrix and its verdict on six planted runs (five same-seed, one control)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pandas as pd
import pytest
from blake3 import blake3

import dmlib
from dmlib.stats.matrix import matrix, verdict
from dmlib.tensor import ArrayTensorSet

RNG = np.random.default_rng(3)
BASE = {
    "embed.weight": RNG.uniform(1, 2, (32, 8)).astype(np.float32),
    "factors.0.u": RNG.uniform(1, 2, (16, 4)).astype(np.float32),
    "factors.0.v": RNG.uniform(1, 2, (16, 4)).astype(np.float32),
    "norm.beta": np.zeros(8, np.float32),
    "step": np.array([0], np.int64),
}
# run -> {tensor: {flat index: +ULP}}; d is bit-identical to a
PLANTS = {
    "a": {},
    "b": {"factors.0.u": {3: 2, 10: 1}},
    "c": {"factors.0.v": {0: 5}},
    "d": {},
    "e": {"factors.0.u": {3: 1}, "factors.0.v": {63: 4}},
}


def run(plants: dict[str, dict[int, int]]) -> dict[str, np.ndarray]:
    out = {k: v.copy() for k, v in BASE.items()}
    for name, where in plants.items():
        bits = out[name].view(np.uint32).reshape(-1)
        for i, k in where.items():
            bits[i] += k
    return out


def control() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(8)
    return {
        k: (
            rng.uniform(1, 2, v.shape).astype(v.dtype)
            if v.dtype == np.float32 and k != "norm.beta"
            else v.copy()
        )
        for k, v in BASE.items()
    }


def runs() -> dict[str, dict[str, np.ndarray]]:
    r = {label: run(p) for label, p in PLANTS.items()}
    r["g"] = control()
    return r


def rel_fro(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a64 - b64) / np.linalg.norm(a64))


def test_six_runs_fifteen_pairs():
    arrays = runs()
    df = matrix({k: ArrayTensorSet(v) for k, v in arrays.items()}, control="g")
    assert len(df) == 15 * len(BASE)
    assert list(df.columns[:3]) == ["a", "b", "name"]
    pairs = list(dict.fromkeys(zip(df["a"], df["b"], strict=True)))
    assert pairs == list(itertools.combinations("abcdeg", 2))
    v = df.attrs["verdict"]
    # independent oracle: numpy's norms on the planted arrays
    same = [(x, y) for x, y in itertools.combinations("abcde", 2)]
    worst_same = max(
        rel_fro(arrays[x][n], arrays[y][n])
        for x, y in same
        for n in ("factors.0.u", "factors.0.v", "embed.weight")
    )
    assert v["same_worst_rel_fro"] == pytest.approx(worst_same, rel=1e-12)
    # planted ULPs: b/e differ by 1 and 4 at u[3], v[63] vs c's 5 at v[0]; worst pair b/c: max ULP 5
    assert v["same_max_ulp"] == 5
    ctrl = min(
        max(
            rel_fro(arrays[x][n], arrays[y][n])
            for n in ("factors.0.u", "factors.0.v", "embed.weight")
        )
        for x, y in [(x, "g") for x in "abcde"]
    )
    assert v["control_rel_fro"] == pytest.approx(ctrl, rel=1e-12)
    assert v["separation_orders"] == pytest.approx(math.log10(ctrl / worst_same), rel=1e-12)
    assert v["identical_pairs"] == ["a/d"]
    assert sorted(v["never_differ"]) == ["embed.weight", "norm.beta", "step"]
    assert v["always_identical"] is False
    by_pair = {(p["a"], p["b"]): p for p in v["pairs"]}
    assert by_pair[("b", "e")]["n_diff"] == 3  # u[10] (1 vs 0), u[3] (2 vs 1), v[63]
    assert by_pair[("a", "g")]["control"] is True and by_pair[("a", "b")]["control"] is False
    # worst per-tensor median ULP, by hand from the plants: a/b u:[2, 1] -> 1.5;
    # b/e u:[1, 1] -> 1, v:[4] -> 4; c/e v:[5, 4] -> 4.5; a/d nothing differs
    assert by_pair[("a", "b")]["worst_median_ulp"] == 1.5
    assert by_pair[("b", "e")]["worst_median_ulp"] == 4.0
    assert by_pair[("c", "e")]["worst_median_ulp"] == 4.5
    assert by_pair[("a", "d")]["worst_median_ulp"] is None
    assert v["same_worst_median_ulp"] == 5.0  # c's single 5-ULP plant, against a, b or d
    # data hashes: each run's tensors are hashed once and shared by its pairs
    for r in df.itertuples():
        assert r.data_hash_a == "blake3-64MiB:" + blake3(arrays[r.a][r.name].tobytes()).hexdigest()
        assert r.data_hash_b == "blake3-64MiB:" + blake3(arrays[r.b][r.name].tobytes()).hexdigest()
    text = str(v)  # the verdict as the command line prints it
    assert "a/d" in text and "orders of magnitude" in text


def test_include_and_no_control(tmp_path):
    arrays = runs()
    paths = {}
    for label in "abd":
        paths[label] = tmp_path / f"{label}.safetensors"
        dmlib.write_safetensors(paths[label], arrays[label])
    df = matrix(paths, include="re:^factors\\.")
    assert set(df["name"]) == {"factors.0.u", "factors.0.v"}
    v = verdict(df)
    assert v["control"] is None and v["separation_orders"] is None
    assert v["identical_pairs"] == ["a/d"]
    assert v["never_differ"] == ["factors.0.v"]
    assert v["same_max_ulp"] == 2


def test_bad_runs():
    with pytest.raises(dmlib.DmlibError, match="at least two"):
        matrix({"a": ArrayTensorSet({})})
    with pytest.raises(dmlib.DmlibError, match="control 'z'"):
        matrix({"a": ArrayTensorSet({}), "b": ArrayTensorSet({})}, control="z")


def _tiny_model_state(seed: int) -> dict[str, np.ndarray]:
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Conv1d(3, 5, 3),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool1d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(5, 2),
    )
    return {f"model.{k}": v.detach().numpy().copy() for k, v in net.state_dict().items()}


def test_matrix_costs_distinct_contents(tmp_path, monkeypatch):
    """Seven runs, five bit-identical: full statistics once per distinct pair of contents."""
    import dmlib.stats.compare as cmp_mod

    base = _tiny_model_state(0)
    moved = {k: v.copy() for k, v in base.items()}
    moved["model.4.weight"].view(np.uint32).reshape(-1)[3] += 2  # planted: 2 ULP
    ctrl = _tiny_model_state(1)
    paths = {}
    for label, state in {**{f"r{i}": base for i in range(5)}, "moved": moved, "ctrl": ctrl}.items():
        paths[label] = tmp_path / f"{label}.safetensors"
        dmlib.write_safetensors(paths[label], state)
    calls = []
    real = cmp_mod.compare_pair
    monkeypatch.setattr(
        cmp_mod,
        "compare_pair",
        lambda ta, tb, *a, **k: calls.append(ta.name) or real(ta, tb, *a, **k),
    )
    df = matrix(paths, control="ctrl")
    monkeypatch.undo()
    # distinct (name, content a, content b) with different contents, counted by hand:
    # model.4.weight (base, moved) for r_i/moved; every tensor (base, ctrl) for r_i/ctrl and
    # moved/ctrl, whose other tensors hold base's bytes; model.4.weight (moved, ctrl)
    n = len(base)
    assert sorted(calls) == sorted(["model.4.weight", *base, "model.4.weight"])
    assert len(df) == 21 * n
    # every row equals a plain pairwise dmlib.compare of the two files (read in full)
    for (la, lb), g in df.groupby(["a", "b"], sort=False):
        ref = dmlib.compare(paths[la], paths[lb]).set_index("name")
        got = g.drop(columns=["a", "b"]).set_index("name")
        pd.testing.assert_frame_equal(got, ref[got.columns], check_dtype=True)
    v = df.attrs["verdict"]
    assert len(v["identical_pairs"]) == 10  # C(5, 2) among r0..r4
    assert v["same_max_ulp"] == 2


def test_contents_grouped_by_bytes_hashes_only_what_it_must(monkeypatch):
    """Runs sorted into contents: byte comparisons against a few references, hashes after.

    Oracle: numpy byte equality of every pair of runs, per tensor; hash counts by hand.
    """
    import dmlib.kernels.stream as K

    rng = np.random.default_rng(21)
    base = {
        "w": rng.standard_normal(50_000).astype(np.float32),
        "b": rng.standard_normal(64).astype(np.float32),
    }

    def with_w(w: np.ndarray) -> dict[str, np.ndarray]:
        return {"w": w, "b": base["b"].copy()}

    late = base["w"].copy()
    late.view(np.uint32)[-1] += 1  # differs in its last element only
    early = base["w"].copy()
    early.view(np.uint32)[0] += 1
    runs = {
        "r0": with_w(base["w"].copy()),
        "r1": with_w(base["w"].copy()),
        "late": with_w(late),
        "late2": with_w(late.copy()),
        "early": with_w(early),
        "other": with_w(rng.standard_normal(50_000).astype(np.float32)),
        "other2": with_w(rng.standard_normal(50_000).astype(np.float32)),
        "early2": with_w(early.copy()),
    }
    hashed: list[int] = []
    real = K.hash_views
    monkeypatch.setattr(
        K, "hash_views", lambda raws, *a, **k: hashed.append(1) or real(raws, *a, **k)
    )
    sets = {k: ArrayTensorSet(v) for k, v in runs.items()}
    df = matrix(sets, hash="none", chunk_bytes=8192)
    # w: references r0, late, early (by bytes) take r1, late2, early2; other and other2
    # are left to hash; b: one content, by bytes
    assert len(hashed) == 2
    assert df["data_hash_a"].isna().all()
    for (la, lb), g in df.groupby(["a", "b"], sort=False):
        for r in g.to_dict("records"):
            x, y = runs[la][r["name"]], runs[lb][r["name"]]
            assert r["n_diff"] == int(np.count_nonzero(x.view(np.uint32) != y.view(np.uint32)))
    want = {
        f"{la}/{lb}"
        for la, lb in itertools.combinations(runs, 2)
        if all(runs[la][n].tobytes() == runs[lb][n].tobytes() for n in base)
    }
    assert (
        set(df.attrs["verdict"]["identical_pairs"])
        == want
        == {
            "r0/r1",
            "late/late2",
            "early/early2",
        }
    )
    # with hashes reported: one per distinct content, each the BLAKE3 of the bytes: the
    # two hashed for grouping, the three references of w, the one content of b
    hashed.clear()
    df = matrix(sets, chunk_bytes=8192)
    assert len(hashed) == 2 + 3 + 1
    for r in df.to_dict("records"):
        assert (
            r["data_hash_a"]
            == "blake3-64MiB:" + blake3(runs[r["a"]][r["name"]].tobytes()).hexdigest()
        )
        assert (
            r["data_hash_b"]
            == "blake3-64MiB:" + blake3(runs[r["b"]][r["name"]].tobytes()).hexdigest()
        )
    # mostly identical runs and a control: bytes compared, nothing hashed
    hashed.clear()
    few = {f"s{i}": ArrayTensorSet(runs["r0"]) for i in range(5)}
    few["ctrl"] = ArrayTensorSet(runs["other"])
    df = matrix(few, control="ctrl", hash="none")
    assert hashed == [] and len(df.attrs["verdict"]["identical_pairs"]) == 10
