"""Mapped runs in a matrix, a step ladder and a study: a converted tiny GPT-2 joins them.

The converted checkpoints are made by the hand-written numpy code of test_mapping.py
(no dmlib transform involved), and the expected statistics are computed with numpy.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

import dmlib
from dmlib.errors import DmlibError
from dmlib.mapping.spec import loads
from dmlib.mapping.view import mapped_set, source_index
from dmlib.tensor import ArrayTensorSet
from tests.test_mapping import GPT2_MAP, D, gpt2_converted, gpt2_state

torch = pytest.importorskip("torch")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

K = "blocks.1.attn.k.weight"
R, C = 3, 5  # the planted element of K; K = c_attn.weight[:, D:2D].T


def _save(path: Path, sd: dict[str, np.ndarray]) -> str:
    safetensors_numpy.save_file({k: np.ascontiguousarray(v) for k, v in sd.items()}, path)
    return os.fspath(path)


def _control_state() -> dict[str, np.ndarray]:
    """Another seed: every value drawn again (the shapes of gpt2_state)."""
    rng = np.random.default_rng(7)
    return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in gpt2_state().items()}


def _bumped(conv: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(conv)
    k = conv[K].copy()
    k[R, C] = np.nextafter(k[R, C], np.float32(np.inf))
    out[K] = k
    return out


def _rel(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """The worst ||a - b|| / ||a|| over tensors, in float64."""
    return max(
        float(np.linalg.norm((a[n].astype(np.float64) - b[n]).ravel()))
        / float(np.linalg.norm(a[n].astype(np.float64).ravel()))
        for n in a
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, object]:
    d = tmp_path_factory.mktemp("runs")
    sd = gpt2_state()
    conv = gpt2_converted(sd)
    twin = _bumped(conv)
    ctrl = gpt2_converted(_control_state())
    (d / "map.toml").write_text(GPT2_MAP)
    return {
        "dir": d,
        "conv": conv,
        "twin_state": twin,
        "ctrl_state": ctrl,
        "hf": _save(d / "hf.safetensors", sd),
        "twin": _save(d / "twin.safetensors", twin),
        "ctrl": _save(d / "ctrl.safetensors", ctrl),
        "map": os.fspath(d / "map.toml"),
    }


def test_matrix_with_a_converted_run(runs) -> None:
    df = dmlib.matrix(
        {"hf": runs["hf"], "twin": runs["twin"], "ctrl": runs["ctrl"]},
        control="ctrl",
        mapping={"hf": runs["map"]},
    )
    v = df.attrs["verdict"]
    conv, twin, ctrl = runs["conv"], runs["twin_state"], runs["ctrl_state"]
    # oracle: the one planted ULP, and numpy's norms of the hand-converted tensors
    same = float(abs(np.float64(twin[K][R, C]) - conv[K][R, C])) / float(
        np.linalg.norm(conv[K].astype(np.float64))
    )
    assert v["same_max_ulp"] == 1
    assert v["same_worst_rel_fro"] == pytest.approx(same, rel=1e-6)
    ctrl_rel = min(_rel(conv, ctrl), _rel(twin, ctrl))
    assert v["control_rel_fro"] == pytest.approx(ctrl_rel, rel=1e-6)
    assert v["separation_orders"] == pytest.approx(math.log10(ctrl_rel / same), rel=1e-6)
    assert v["identical_pairs"] == [] and not v["always_identical"]
    # every target compared in every pair; nothing left out by this mapping
    assert set(df[df.a == "hf"]["name"]) == set(conv)
    assert df.attrs["mapped"]["hf"]["reference"] == "twin"
    assert df.attrs["mapped"]["hf"]["ignored_a"] == []
    # the first difference in the reference's and in the source's coordinates
    loc = df.attrs["pairs"]["hf/twin"]["located"][K]
    assert loc["target"] == f"{K}[{R}, {C}]"
    assert loc["source_a"] == f"transformer.h.1.attn.c_attn.weight[{C}, {D + R}]"
    assert "located" not in df.attrs["pairs"]["twin/ctrl"] or not any(
        "source_a" in x for x in df.attrs["pairs"]["twin/ctrl"]["located"].values()
    )


def test_matrix_one_mapping_for_the_runs_lacking_the_names(runs) -> None:
    df = dmlib.matrix({"twin": runs["twin"], "hf": runs["hf"]}, mapping=runs["map"])
    assert list(df.attrs["mapped"]) == ["hf"]
    assert df.attrs["verdict"]["same_max_ulp"] == 1


def test_left_out_tensors_are_listed_not_dropped(runs) -> None:
    text = GPT2_MAP.replace(
        '[[rule]]\nsource = "transformer.wpe.weight"\ntarget = "pos.weight"\n', ""
    )
    with pytest.raises(DmlibError, match=r"run 'hf'.*of A out: 'transformer\.wpe\.weight'"):
        dmlib.matrix({"hf": runs["hf"], "twin": runs["twin"]}, mapping={"hf": loads(text)})
    text = 'ignore_a = ["transformer.wpe.weight"]\nignore_b = ["pos.weight"]\n' + text
    df = dmlib.matrix({"hf": runs["hf"], "twin": runs["twin"]}, mapping={"hf": loads(text)})
    pair = df.attrs["pairs"]["hf/twin"]
    assert pair["only_in_a"] == ["transformer.wpe.weight"]
    assert pair["only_in_b"] == ["pos.weight"]
    assert df.attrs["mapped"]["hf"]["ignored_b"] == ["pos.weight"]


def test_matrix_mapping_refusals(runs) -> None:
    two = {"hf": runs["hf"], "twin": runs["twin"]}
    with pytest.raises(DmlibError, match="'nope', which is not one of the runs"):
        dmlib.matrix(two, mapping={"nope": runs["map"]})
    with pytest.raises(DmlibError, match="one run must keep its names"):
        dmlib.matrix(two, mapping={"hf": runs["map"], "twin": runs["map"]})
    with pytest.raises(DmlibError, match="engine='local'"):
        dmlib.matrix(two, mapping={"hf": runs["map"]}, engine="dask")


def test_view_is_lazy_and_traces_back() -> None:
    w = np.arange(24, dtype=np.float32).reshape(4, 6)  # fused [in, 3 * out] (Conv1D)
    src = ArrayTensorSet({"c_attn": w})
    m = loads(
        '[[rule]]\nsource = "c_attn"\ntarget = ["q", "k", "v"]\n'
        'transforms = [{ op = "transpose" }, { op = "split", axis = 0, parts = 3 }]\n'
    )
    view = mapped_set(src, m, ["q", "k", "v"])
    assert [view[n].shape for n in "qkv"] == [(2, 4)] * 3
    # by hand: k = w[:, 2:4].T
    np.testing.assert_array_equal(view["k"].load(), np.array(w[:, 2:4].T))
    assert source_index(view, "k", (1, 2)) == ("c_attn", (2, 3))  # k[1, 2] = w[2, 2 + 1]
    assert view.layout["mapping"]["bindings"][0]["transform"] == (
        "transpose() | split(axis=0, parts=3)"
    )


def test_concat_shape_checked_before_reading() -> None:
    src = ArrayTensorSet({"r0": np.zeros((2, 3), np.float32), "r1": np.zeros((3, 3), np.float32)})
    ok = loads(
        '[[rule]]\nsource = "r{r}"\ntarget = "w"\ntransforms = [{ op = "concat", axis = 0 }]'
    )
    assert mapped_set(src, ok, ["w"])["w"].shape == (5, 3)
    bad = loads(
        '[[rule]]\nsource = "r{r}"\ntarget = "w"\ntransforms = [{ op = "concat", axis = 1 }]'
    )
    with pytest.raises(DmlibError, match=r"concat: shapes \[2, 3\], \[3, 3\] do not join"):
        mapped_set(src, bad, ["w"])
    bad2 = loads(
        '[[rule]]\nsource = "r{r}"\ntarget = "w"\ntransforms = [{ op = "concat", axis = 2 }]'
    )
    with pytest.raises(DmlibError, match="do not join along axis 2"):
        mapped_set(src, bad2, ["w"])


def test_ladder_with_a_converted_run(runs, tmp_path: Path) -> None:
    conv = runs["conv"]
    sd = gpt2_state()
    later = {k: v * np.float32(1.5) for k, v in sd.items()}  # step 20 of the converted run
    conv20 = gpt2_converted(later)
    conv20[K] = conv20[K].copy()
    conv20[K][0, 0] += np.float32(1.0)
    ladder = {
        "hf": {10: runs["hf"], 20: _save(tmp_path / "hf20.safetensors", later)},
        "conv": {10: _save(tmp_path / "c10.safetensors", conv),
                 20: _save(tmp_path / "c20.safetensors", conv20)},
    }  # fmt: skip
    df = dmlib.step_ladder(ladder, reference="conv", mapping={"hf": runs["map"]})
    assert set(df["name"]) == set(conv)
    at10 = df[df.step == 10]
    assert (at10["n_diff"] == 0).all()
    row = df[(df.step == 20) & (df.name == K)].iloc[0]
    hf_view = gpt2_converted(later)[K].astype(np.float64)
    expect = 1.0 / float(np.linalg.norm(conv20[K].astype(np.float64)))
    assert row["n_diff"] == 1 and row["pair"] == "conv/hf"
    assert row["rel_fro"] == pytest.approx(expect, rel=1e-5)
    assert row["max_abs"] == pytest.approx(abs(float(conv20[K][0, 0]) - hf_view[0, 0]))
    assert list(df.attrs["mapped"]) == ["hf"]


def test_tie_needed_for_one_source_onto_two_targets() -> None:
    src = ArrayTensorSet({"wte": np.ones((3, 2), np.float32)})
    untied = loads('[[rule]]\nsource = "wte"\ntarget = ["embed", "lm_head"]\n')
    with pytest.raises(DmlibError, match=r"1 tensor\(s\) for 2 targets.*needs a tie transform"):
        mapped_set(src, untied, ["embed", "lm_head"])
    with pytest.raises(DmlibError, match="needs a tie transform"):
        dmlib.compare(src, {"embed": np.ones((3, 2)), "lm_head": np.ones((3, 2))}, mapping=untied)
    tied = loads(
        '[[rule]]\nsource = "wte"\ntarget = ["embed", "lm_head"]\n'
        'transforms = [{ op = "tie", copies = 2 }]\n'
    )
    view = mapped_set(src, tied, ["embed", "lm_head"])
    assert view["lm_head"].shape == (3, 2)
    # two rules on one source: the second must say tied = true
    two = (
        '[[rule]]\nsource = "wte"\ntarget = "embed"\n[[rule]]\nsource = "wte"\ntarget = "lm_head"\n'
    )
    with pytest.raises(DmlibError, match=r"source 'wte' feeds 2 rules .* lack tied = true"):
        mapped_set(src, loads(two), ["embed", "lm_head"])
    assert len(mapped_set(src, loads(two + "tied = true\n"), ["embed", "lm_head"])) == 2
    # three rules, only one tied: the third reuse is unsaid
    three = two + 'tied = true\n[[rule]]\nsource = "wte"\ntarget = "extra"\n'
    with pytest.raises(DmlibError, match="feeds 3 rules .* 2 of them lack tied"):
        mapped_set(src, loads(three), ["embed", "lm_head", "extra"])


def test_one_source_twice_in_a_rule_needs_tied() -> None:
    src = ArrayTensorSet({"a": np.ones((2, 2), np.float32)})
    text = (
        '[[rule]]\nsource = ["a", "a"]\ntarget = "w"\ntransforms = [{ op = "concat", axis = 0 }]\n'
    )
    with pytest.raises(DmlibError, match="source 'a' is taken 2 times without tied"):
        mapped_set(src, loads(text), ["w"])


def test_two_sources_onto_one_target_both_ways() -> None:
    src = ArrayTensorSet({"a": np.ones((2, 2), np.float32), "b": np.ones((2, 2), np.float32)})
    # two rules onto one target
    text = '[[rule]]\nsource = "a"\ntarget = "w"\n[[rule]]\nsource = "b"\ntarget = "w"\n'
    with pytest.raises(DmlibError, match=r"two sources onto one target: 'a', 'b' all map to 'w'"):
        mapped_set(src, loads(text), ["w"])
    # one rule, two sources, one target and nothing saying how they join
    text = '[[rule]]\nsource = ["a", "b"]\ntarget = "w"\n'
    with pytest.raises(DmlibError, match="2 sources onto fewer targets need a concat"):
        mapped_set(src, loads(text), ["w"])


def _study_dir(runs, tmp_path: Path) -> Path:
    d = tmp_path / "study"
    (d / "runs").mkdir(parents=True)
    (d / "maps").mkdir()
    for k in ("hf", "twin", "ctrl"):
        (d / "runs" / f"{k}.safetensors").write_bytes(Path(runs[k]).read_bytes())
    (d / "maps" / "gpt2.toml").write_text(GPT2_MAP)
    return d


def test_study_with_a_mapped_run(runs, tmp_path: Path) -> None:
    from dmlib.report import load_study
    from dmlib.report.studyfile import resolved_toml

    d = _study_dir(runs, tmp_path)
    (d / "study.toml").write_text(
        'control = "ctrl"\nreference = "twin"\n[runs]\n'
        'hf = { path = "runs/hf.safetensors", mapping = "maps/gpt2.toml" }\n'
        'twin = "runs/twin.safetensors"\nctrl = "runs/ctrl.safetensors"\n'
    )
    study = load_study(d)
    assert study.mappings == {"hf": d / "maps" / "gpt2.toml"}
    assert d / "maps" / "gpt2.toml" in study.input_files()
    files, _ = study.at_last_step()
    df = dmlib.matrix(study.sources(files), control="ctrl")
    v = df.attrs["verdict"]
    assert v["same_max_ulp"] == 1 and set(df[df.a == "hf"]["name"]) == set(runs["conv"])
    # the resolved study file keeps the mapping, and loads again to the same study
    out = tmp_path / "out"
    out.mkdir()
    (out / "study.toml").write_text(resolved_toml(study, out))
    again = load_study(out)
    assert again.mappings == study.mappings


def test_study_mapping_path_must_stay_inside(runs, tmp_path: Path) -> None:
    from dmlib.report import load_study

    d = _study_dir(runs, tmp_path)
    outside = tmp_path / "outside.toml"
    outside.write_text(GPT2_MAP)
    (d / "maps" / "link.toml").symlink_to(outside)
    for text, msg in [
        ("../outside.toml", "leads outside the folder"),
        ("maps/link.toml", "leads outside the folder"),
        (os.fspath(outside), "absolute path"),
        ("maps/none.toml", "not found"),
    ]:
        (d / "study.toml").write_text(
            f'[runs]\nhf = {{ path = "runs/hf.safetensors", mapping = "{text}" }}\n'
            'twin = "runs/twin.safetensors"\n'
        )
        with pytest.raises(DmlibError, match=msg) as e:
            load_study(d)
        assert "study.toml" in str(e.value)
    (d / "maps" / "bad.toml").write_text('[[rule]]\nsource = "a"\n')
    (d / "study.toml").write_text(
        '[runs]\nhf = { path = "runs/hf.safetensors", mapping = "maps/bad.toml" }\n'
    )
    with pytest.raises(DmlibError, match="bad.toml.*needs 'source' and 'target'"):
        load_study(d)
    (d / "study.toml").write_text('[runs]\nhf = { path = "runs/hf.safetensors", map = "x" }\n')
    with pytest.raises(DmlibError, match="keys path and mapping, not 'map'"):
        load_study(d)


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from dmlib.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_matrix_and_ladder_with_map(runs, capsys) -> None:
    rc, out, err = _cli(
        ["matrix", f"hf={runs['hf']}", f"twin={runs['twin']}", f"ctrl={runs['ctrl']}",
         "--control", "ctrl", "--map", f"hf={runs['map']}"], capsys,
    )  # fmt: skip
    assert rc == 1, err
    assert "note: run hf seen through" in out and "onto the names of twin" in out
    # the planted element, in the reference's and in the source's coordinates (by hand:
    # K = c_attn.weight[:, D:2D].T)
    source = f"transformer.h.1.attn.c_attn.weight[{C}, {D + R}]"
    assert f"located: hf/twin: {K} first differs at {K}[{R}, {C}] <- a {source}" in out
    rc, out, err = _cli(
        ["matrix", f"hf={runs['hf']}", f"twin={runs['twin']}", "--map", "hf"], capsys
    )
    assert rc == 2 and "--map expects RUN=MAP.toml, got 'hf'" in err
    rc, out, err = _cli(
        ["matrix", f"hf={runs['hf']}", f"twin={runs['twin']}", "--map", f"x={runs['map']}"],
        capsys,
    )
    assert rc == 2 and "'x', which is not one of the runs" in err
    rc, out, err = _cli(
        ["ladder", f"hf:10={runs['hf']}", f"twin:10={runs['twin']}", "--reference", "twin",
         "--map", f"hf={runs['map']}"], capsys,
    )  # fmt: skip
    assert rc == 1, err
    assert "note: run hf seen through" in out
    assert f"located: step 10 twin/hf: {K} first differs at {K}[{R}, {C}] <- b {source}" in out
    rc, out, err = _cli(
        ["ladder", f"hf:10={runs['hf']}", f"twin:10={runs['twin']}", "--reference", "twin",
         "--map", f"hf={runs['map']}", "--json"], capsys,
    )  # fmt: skip
    located = json.loads(out)["located"]
    assert [(x["step"], x["name"], x["source_b"]) for x in located] == [(10, K, source)]


def test_study_ladder_with_a_mapped_run(runs, tmp_path: Path) -> None:
    from dmlib.report import load_study

    d = tmp_path / "st"
    for run in ("hf", "conv"):
        (d / run).mkdir(parents=True)
    sd = gpt2_state()
    later = {k: v * np.float32(2) for k, v in sd.items()}
    _save(d / "hf" / "step10.safetensors", sd)
    _save(d / "hf" / "step20.safetensors", later)
    _save(d / "conv" / "step10.safetensors", runs["conv"])
    _save(d / "conv" / "step20.safetensors", _bumped(gpt2_converted(later)))
    (d / "gpt2.toml").write_text(GPT2_MAP)
    (d / "study.toml").write_text(
        '[runs]\nhf = { path = "hf/", mapping = "gpt2.toml" }\nconv = "conv/"\n'
    )
    study = load_study(d)
    assert study.reference == "hf"  # the study's default; the mapping still maps onto conv
    df = dmlib.step_ladder(study.ladder_sources(study.ladders()))
    assert set(df["name"]) == set(runs["conv"])
    diff = df[df.n_diff > 0]
    assert list(zip(diff["step"], diff["name"])) == [(20, K)]


def test_sources_of_different_dtypes_are_refused_by_the_view_and_the_comparison(
    tmp_path: Path,
) -> None:
    src = ArrayTensorSet({"r0": np.zeros((2, 3), np.float32), "r1": np.zeros((3, 3), np.float16)})
    text = '[[rule]]\nsource = "r{r}"\ntarget = "w"\ntransforms = [{ op = "concat", axis = 0 }]'
    why = r"the sources hold different dtypes \(float16, float32\)"
    with pytest.raises(DmlibError, match=why):
        mapped_set(src, loads(text), ["w"])
    (tmp_path / "map.toml").write_text(text)
    target = ArrayTensorSet({"w": np.zeros((5, 3), np.float32)})
    with pytest.raises(DmlibError, match=why):
        dmlib.compare(src, target, mapping=str(tmp_path / "map.toml"))
