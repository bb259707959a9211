"""Step ladders with planted growth, step-0 artifacts and missing checkpoints."""

from __future__ import annotations

import re

import numpy as np
import pytest

import dmlib
from dmlib.forensics.ladder import growth_rates
from dmlib.io.burnpack import write_burnpack
from dmlib.tensor import ArrayTensorSet

STEPS = [0, 5, 20, 50]
# planted: rel_fro(step) = c * 10**(g * step)
PLANTED = {"embed": (1e-7, 0.05), "norm.beta": (1e-6, 0.08), "proj.weight": (1e-9, 0.02)}


def _base(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "embed": rng.standard_normal((40, 8)),
        "norm.beta": rng.standard_normal(16) * 0.01,
        "proj.weight": rng.standard_normal((8, 8)),
    }


def _perturbed(
    base: dict[str, np.ndarray], step: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    out = {}
    for name, x in base.items():
        c, g = PLANTED[name]
        d = rng.standard_normal(x.shape)
        d *= c * 10 ** (g * step) * np.linalg.norm(x) / np.linalg.norm(d)
        out[name] = x + d
    return out


@pytest.fixture(scope="module")
def ladder() -> dict[str, dict[int, ArrayTensorSet]]:
    rng = np.random.default_rng(5)
    base = _base(rng)
    a = {s: ArrayTensorSet(base, scalars={"step": s}) for s in STEPS}
    b = {s: ArrayTensorSet(_perturbed(base, s, rng), scalars={"step": s}) for s in STEPS}
    return {"A": a, "B": b}


def test_ladder_long_form_and_planted_values(ladder):
    df = dmlib.step_ladder(ladder)
    assert list(df.columns) == [
        "step", "pair", "a", "b", "name", "kind", "numel", "norm", "n_diff", "max_abs", "rel_fro", "rank",
    ]  # fmt: skip
    assert sorted(df["step"].unique()) == STEPS
    assert set(df["pair"]) == {"A/B"}
    for (step, name), rel in df.set_index(["step", "name"])["rel_fro"].items():
        c, g = PLANTED[name]
        assert rel == pytest.approx(c * 10 ** (g * step), rel=1e-6)
    row = df[(df["step"] == 20) & (df["name"] == "embed")].iloc[0]
    base = ladder["A"][20]["embed"].load()
    assert row["norm"] == pytest.approx(np.linalg.norm(base), rel=1e-12)
    assert row["numel"] == 320 and row["n_diff"] == 320
    # fastest movers at step 20: norm.beta (1e-6 * 10^1.6) > embed (1e-7 * 10^1) > proj
    at20 = df[df["step"] == 20].set_index("name")["rank"]
    assert at20.to_dict() == {"norm.beta": 1, "embed": 2, "proj.weight": 3}
    assert df.attrs["excluded"] == []


def test_growth_rates_recover_planted_slopes(ladder):
    df = dmlib.step_ladder(ladder)
    gr = growth_rates(df).set_index("name")
    for name, (c, g) in PLANTED.items():
        assert gr.loc[name, "slope"] == pytest.approx(g, abs=1e-7)
        assert gr.loc[name, "intercept"] == pytest.approx(np.log10(c), abs=1e-6)
        assert gr.loc[name, "n_steps"] == 4
    # a group of members growing at different rates; with one member it is that member
    by_group = growth_rates(df, by={"proj.weight": "proj"}).set_index("group")
    assert list(by_group.index) == ["proj"]
    assert by_group.loc["proj", "slope"] == pytest.approx(0.02, abs=1e-7)
    by_rx = growth_rates(df, by=re.compile(r"^(embed|proj)")).set_index("group")
    assert sorted(by_rx.index) == ["embed", "proj"]
    with pytest.raises(dmlib.DmlibError, match="not a column"):
        growth_rates(df, by="layer")


def test_group_growth_pools_members_of_equal_rate():
    rng = np.random.default_rng(9)
    g = 0.03
    base = {"x": rng.standard_normal(50), "y": rng.standard_normal(30) * 5}
    lad: dict[str, dict[int, ArrayTensorSet]] = {"A": {}, "B": {}}
    for s in STEPS:
        pert = {}
        for n, x in base.items():
            d = rng.standard_normal(x.shape)
            pert[n] = x + d * 1e-8 * 10 ** (g * s) * np.linalg.norm(x) / np.linalg.norm(d)
        lad["A"][s], lad["B"][s] = ArrayTensorSet(base), ArrayTensorSet(pert)
    df = dmlib.step_ladder(lad)
    gr = growth_rates(df, by=lambda n: "all").set_index("group")
    assert gr.loc["all", "slope"] == pytest.approx(g, abs=1e-7)


def test_step0_artifact_is_flagged_and_excluded(ladder):
    lad = {"A": dict(ladder["A"]), "B": dict(ladder["B"])}
    arrays = {n: lad["B"][50][n].load() for n in lad["B"][50]}
    lad["B"][50] = ArrayTensorSet(arrays, scalars={"step": 0})  # claimed 50, recorded 0
    checks = dmlib.check_steps(lad).set_index(["run", "step"])
    assert checks.loc[("B", 50), "status"] == "artifact"
    assert checks.loc[("B", 50), "recorded_step"] == 0
    assert checks.loc[("B", 50), "detail"] == (
        "artifact: recorded step 0, claimed 50 — run died before its final save?"
    )
    assert bool(checks.loc[("B", 50), "flagged"])
    assert (checks.drop(index=("B", 50))["status"] == "ok").all()
    df = dmlib.step_ladder(lad)
    assert 50 not in set(df["step"])  # no claim for a step never reached
    assert [(e["run"], e["step"], e["status"]) for e in df.attrs["excluded"]] == [
        ("B", 50, "artifact")
    ]
    # growth is still measured on the clean steps
    assert growth_rates(df).set_index("name").loc["embed", "slope"] == pytest.approx(0.05, abs=1e-7)
    kept = dmlib.step_ladder(lad, keep_flagged=True)
    assert 50 in set(kept["step"])


def test_missing_and_unreadable_checkpoints_are_rows(tmp_path, ladder):
    bad = tmp_path / "garbage.bpk"
    bad.write_bytes(b"this is not a checkpoint at all")
    lad = {
        "A": {0: ladder["A"][0], 5: ladder["A"][5], 20: ladder["A"][20]},
        "B": {0: ladder["B"][0], 5: tmp_path / "nope.bpk", 20: bad},
    }
    checks = dmlib.check_steps(lad).set_index(["run", "step"])
    assert checks.loc[("B", 5), "status"] == "missing"
    assert "nope.bpk" in checks.loc[("B", 5), "detail"]
    assert checks.loc[("B", 20), "status"] == "unreadable"
    assert "garbage.bpk" in checks.loc[("B", 20), "detail"]
    df = dmlib.step_ladder(lad)
    assert sorted(df["step"].unique()) == [0]
    assert {(e["run"], e["step"]) for e in df.attrs["excluded"]} == {("B", 5), ("B", 20)}


def test_step_keys_from_files(tmp_path):
    x = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    p_scalar = tmp_path / "s.bpk"
    write_burnpack(p_scalar, x, scalars={"step": 20}, metadata={"iteration": "19"})
    p_name = tmp_path / "ckpt-step50.bpk"
    write_burnpack(p_name, x)
    lad = {"r": {20: p_scalar, 50: p_name}}
    assert list(dmlib.check_steps(lad)["status"]) == ["ok", "unverified"]
    by_meta = dmlib.check_steps(lad, step_key="metadata:iteration")
    assert list(by_meta["status"]) == ["artifact", "unverified"]
    assert by_meta["detail"][0] == "artifact: recorded step 19, claimed 20"
    by_path = dmlib.check_steps(lad, step_key=r"path:step(\d+)")
    assert list(by_path["status"]) == ["unverified", "ok"]
    with pytest.raises(dmlib.DmlibError, match="invalid step key"):
        dmlib.check_steps(lad, step_key="header:step")


def test_factor_groups_in_a_ladder():
    rng = np.random.default_rng(2)
    u, _ = np.linalg.qr(rng.standard_normal((10, 3)))
    v, _ = np.linalg.qr(rng.standard_normal((6, 3)))
    s = np.array([3.0, 2.0, 1.0])
    a = ArrayTensorSet({"l.u": u, "l.s": s, "l.v": v, "bias": np.ones(3)})
    b = ArrayTensorSet({"l.u": -u, "l.s": s, "l.v": -v, "bias": np.ones(3)})
    group = dmlib.FactorGroup.svd("{prefix}.u", "{prefix}.s", "{prefix}.v")
    df = dmlib.step_ladder({"A": {0: a}, "B": {0: b}}, groups=group)
    rows = df.set_index("name")
    assert set(rows.index) == {"l", "bias"}  # factors replaced by the layer
    assert rows.loc["l", "kind"] == "effective" and rows.loc["l", "rel_fro"] == 0.0


def test_bad_ladders():
    with pytest.raises(dmlib.DmlibError, match="two runs or more"):
        dmlib.step_ladder({"A": {0: ArrayTensorSet({"x": np.ones(2)})}})
    lad = {"A": {0: ArrayTensorSet({"x": np.ones(2)})}, "B": {0: ArrayTensorSet({"x": np.ones(2)})}}
    with pytest.raises(dmlib.DmlibError, match="reference run 'C' is not in the ladder"):
        dmlib.step_ladder(lad, reference="C")


def test_ladder_compares_each_distinct_pair_of_contents_once(tmp_path, monkeypatch):
    """Three runs at two steps, two runs bit-identical: rows as plain per-pair compares."""
    import dmlib.stats.compare as cmp_mod

    rng = np.random.default_rng(4)
    lad: dict = {"base": {}, "copy": {}, "moved": {}}
    for step in (10, 25):
        w = {"model.enc.w": rng.standard_normal((6, 5)).astype(np.float32),
             "model.head.b": rng.standard_normal(3).astype(np.float32)}  # fmt: skip
        moved = {k: v.copy() for k, v in w.items()}
        moved["model.enc.w"].view(np.uint32)[2, 3] += 5  # planted: 5 ULP
        for run, tensors in (("base", w), ("copy", w), ("moved", moved)):
            p = tmp_path / f"{run}_{step}.safetensors"
            dmlib.write_safetensors(p, tensors, metadata={"step": str(step)})
            lad[run][step] = p
    calls = []
    real = cmp_mod.compare_pair
    monkeypatch.setattr(
        cmp_mod,
        "compare_pair",
        lambda ta, tb, *a, **k: calls.append(ta.name) or real(ta, tb, *a, **k),
    )
    df = dmlib.step_ladder(lad)
    monkeypatch.undo()
    # per step, only model.enc.w differs, and only as (base content, moved content): once
    assert sorted(calls) == ["model.enc.w", "model.enc.w"]
    assert len(df) == 2 * 3 * 2  # steps x pairs x tensors
    for (step, ra, rb), g in df.groupby(["step", "a", "b"]):
        ref = dmlib.compare(lad[ra][step], lad[rb][step]).set_index("name")
        for r in g.itertuples():
            assert (r.n_diff, r.max_abs, r.numel) == (
                ref.at[r.name, "n_diff"],
                float(ref.at[r.name, "max_abs"]),
                ref.at[r.name, "numel"],
            )
            assert r.rel_fro == float(ref.at[r.name, "rel_fro"])
    moved = df[(df["pair"] == "base/moved") & (df["name"] == "model.enc.w")]
    assert list(moved["n_diff"]) == [1, 1]
