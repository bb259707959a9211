"""Mapped comparisons: real transformers models re-laid-out by hand-written numpy code.

The conversions here share no code with dmlib.mapping: every reshape is written out with
numpy slicing or explicit index loops, so a transform bug in dmlib cannot hide behind the
same bug in the expected values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dmlib
from dmlib.errors import DmlibError
from dmlib.mapping.spec import loads
from dmlib.mapping.transforms import rotary
from dmlib.stats.compare import summarize

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from _support.mapmodels import (  # noqa: E402
    FIXTURES,
    GPT2_MAP,
    HEADS,
    KV_HEADS,
    LAYERS,
    LLAMA_MAP,
    D,
    _map,
    gpt2_converted,
    gpt2_state,
    hf_to_meta_by_loops,
    llama_hf,
    llama_meta,
)


@pytest.fixture(scope="module")
def gpt2() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    sd = gpt2_state()
    return sd, gpt2_converted(sd)


def test_gpt2_relaid_out_is_identical(gpt2) -> None:
    sd, conv = gpt2
    df = dmlib.compare(sd, conv, mapping=_map(GPT2_MAP))
    s = summarize(df)
    assert s["identical"] and s["n_not_compared"] == 0
    assert sorted(df["name"]) == sorted(conv)  # every target compared, once
    used = {n for b in df.attrs["bindings"] for n in b["sources"]}
    assert used == set(sd)  # every source used
    q = df.set_index("name").loc["blocks.1.attn.q.weight"]
    assert q["source"] == "transformer.h.1.attn.c_attn.weight"
    assert q["transform"] == "transpose() | split(axis=0, parts=3)"


def test_one_ulp_found_at_its_source_and_target_coordinates(gpt2) -> None:
    sd, conv = gpt2
    conv = dict(conv)
    k = conv["blocks.1.attn.k.weight"].copy()
    r, c = 3, 5
    k[r, c] = np.nextafter(k[r, c], np.float32(np.inf))
    conv["blocks.1.attn.k.weight"] = k
    df = dmlib.compare(sd, conv, mapping=_map(GPT2_MAP))
    bad = df[df.n_diff > 0]
    assert list(bad["name"]) == ["blocks.1.attn.k.weight"]
    row = bad.iloc[0]
    assert row["n_diff"] == 1 and row["max_ulp"] == 1
    # k = c_attn.weight[:, D:2D].T, so k[r, c] is c_attn.weight[c, D + r]
    assert row["first_diff_target"] == f"blocks.1.attn.k.weight[{r}, {c}]"
    assert row["first_diff_source"] == f"transformer.h.1.attn.c_attn.weight[{c}, {D + r}]"
    (found,) = df.attrs["located"]["blocks.1.attn.k.weight"]
    assert found["source_index"] == [c, D + r] and found["target_index"] == [r, c]
    assert found["a"] == float(sd["transformer.h.1.attn.c_attn.weight"][c, D + r])
    assert found["b"] == float(k[r, c])
    assert not summarize(df)["identical"]


def test_a_tensor_left_out_is_refused_by_name(gpt2) -> None:
    sd, conv = gpt2
    text = GPT2_MAP.replace(
        '[[rule]]\nsource = "transformer.wpe.weight"\ntarget = "pos.weight"\n', ""
    )
    with pytest.raises(DmlibError, match=r"of A out: 'transformer\.wpe\.weight'"):
        dmlib.compare(sd, conv, mapping=_map(text))
    # declared as not mapped: compared all the rest, and listed (never silently dropped)
    text2 = 'ignore_a = ["transformer.wpe.*"]\nignore_b = ["pos.weight"]\n' + text
    df = dmlib.compare(sd, conv, mapping=_map(text2))
    s = summarize(df)
    assert s["only_in_a"] == ["transformer.wpe.weight"] and s["only_in_b"] == ["pos.weight"]
    assert not s["identical"]


def test_two_sources_onto_one_target_are_refused_by_name(gpt2) -> None:
    sd, conv = gpt2
    text = (
        GPT2_MAP + '\n[[rule]]\nsource = "transformer.wpe.weight"\ntarget = "final_norm.weight"\n'
    )
    text = text.replace(
        'source = "transformer.wpe.weight"\ntarget = "pos.weight"',
        'source = "transformer.wpe.weight"\ntarget = "pos.weight"\ntied = true',
    )
    with pytest.raises(DmlibError, match=r"two sources onto one target.*'final_norm\.weight'") as e:
        dmlib.compare(sd, conv, mapping=_map(text))
    assert "transformer.ln_f.weight" in str(e.value) and "transformer.wpe.weight" in str(e.value)
    # a source reused by a second rule without tied = true is refused too
    text = GPT2_MAP + '\n[[rule]]\nsource = "transformer.wpe.weight"\ntarget = "lm_head.weight"\n'
    with pytest.raises(DmlibError, match="two sources onto one target"):
        dmlib.compare(sd, conv, mapping=_map(text))


def test_shape_change_not_compared_is_reported(gpt2) -> None:
    sd, conv = gpt2
    text = GPT2_MAP.replace(
        'mlp.c_proj.weight"]\ntransforms = [{ op = "transpose" }]',
        'mlp.c_proj.weight"]',
    )
    df = dmlib.compare(sd, conv, mapping=_map(text))
    s = summarize(df)
    # c_fc / mlp.c_proj change shape without the transpose: not compared, never "identical"
    assert set(s["mismatched"]) == {
        f"blocks.{i}.mlp.{p}.weight" for i in range(2) for p in ("c_fc", "c_proj")
    }
    assert not s["identical"]
    # attn.c_proj is square: it is compared, and (untransposed) it differs
    assert set(df[df.n_diff > 0]["name"]) == {f"blocks.{i}.attn.c_proj.weight" for i in range(2)}


# -- Llama: the rotary permutation between Meta's and Hugging Face's layouts ---------------


def test_rotary_matches_the_loop_definition_and_round_trips() -> None:
    rng = np.random.default_rng(0)
    for heads, rows, cols in ((4, 16, 16), (2, 8, 16), (1, 6, 3), (3, 12, 1)):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        meta = hf_to_meta_by_loops(w, heads)
        assert np.array_equal(rotary(w, heads, "meta"), meta)
        assert np.array_equal(rotary(meta, heads, "hf"), w)
        assert np.array_equal(rotary(rotary(w, heads, "hf"), heads, "meta"), w)
    with pytest.raises(DmlibError, match="even"):
        rotary(np.zeros((6, 2)), 2, "hf")


def test_meta_llama_against_hf_llama() -> None:
    hf = llama_hf()
    meta = llama_meta(hf)
    df = dmlib.compare(meta, hf, mapping=_map(LLAMA_MAP))
    assert summarize(df)["identical"] and len(df) == len(hf)
    # the wrong head count is a real difference, not "identical"
    wrong = _map(LLAMA_MAP.replace(f"heads = {KV_HEADS}", f"heads = {HEADS}"))
    bad = dmlib.compare(meta, hf, mapping=wrong)
    assert set(bad[bad.n_diff > 0]["name"]) == {
        f"model.layers.{i}.self_attn.k_proj.weight" for i in range(LAYERS)
    }
    # one planted ULP in a query row: traced through the rotary permutation
    hf2 = dict(hf)
    q = hf["model.layers.0.self_attn.q_proj.weight"].copy()
    r, c = 5, 2  # head 1 (d = 4), HF row 5 = r*d/2 + m with r=0... of head 1: r = 0, m = 1
    q[r, c] = np.nextafter(q[r, c], np.float32(-np.inf))
    hf2["model.layers.0.self_attn.q_proj.weight"] = q
    row = (
        dmlib.compare(meta, hf2, mapping=_map(LLAMA_MAP))
        .set_index("name")
        .loc["model.layers.0.self_attn.q_proj.weight"]
    )
    d = D // HEADS
    h, within = divmod(r, d)
    half, m = divmod(within, d // 2)
    assert row["n_diff"] == 1 and row["max_ulp"] == 1
    assert row["first_diff_source"] == f"layers.0.attention.wq.weight[{h * d + 2 * m + half}, {c}]"


# -- tensor-parallel shards, a dtype cast, the Flax fixtures --------------------------------


def test_tensor_parallel_rank_files_concatenated(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(3)
    full = {
        "fc1.weight": rng.standard_normal((8, 6)).astype(np.float32),  # column-parallel
        "fc2.weight": rng.standard_normal((6, 8)).astype(np.float32),  # row-parallel
        "norm.weight": rng.standard_normal(6).astype(np.float32),  # replicated
    }
    ranks = tmp_path / "tp"
    ranks.mkdir()
    for r in range(2):
        save_file(
            {
                "fc1.weight": np.ascontiguousarray(full["fc1.weight"][4 * r : 4 * r + 4]),
                "fc2.weight": np.ascontiguousarray(full["fc2.weight"][:, 4 * r : 4 * r + 4]),
                "norm.weight": full["norm.weight"].copy(),
            },
            str(ranks / f"rank{r}.safetensors"),
        )
    save_file(full, str(tmp_path / "merged.safetensors"))
    text = """
[[rule]]
source = "rank{r}.safetensors:fc1.weight"
target = "fc1.weight"
transforms = [{ op = "concat", axis = 0 }]
[[rule]]
source = "rank{r}.safetensors:fc2.weight"
target = "fc2.weight"
transforms = [{ op = "concat", axis = 1 }]
[[rule]]
source = "rank0.safetensors:norm.weight"
target = "norm.weight"
"""
    mp = _map('ignore_a = ["rank1.safetensors:norm.weight"]\n' + text)
    files = [str(ranks / "rank0.safetensors"), str(ranks / "rank1.safetensors")]
    for side in (str(ranks), files):
        df = dmlib.compare(side, str(tmp_path / "merged.safetensors"), mapping=mp)
        assert list(df[df.n_diff > 0]["name"]) == []
        assert df.attrs["only_in_a"] == ["rank1.safetensors:norm.weight"]
        assert set(df["name"]) == set(full)
    # a planted change in rank 1's shard: found at its place in that rank file
    shard = full["fc2.weight"][:, 4:8].copy()
    shard[2, 1] = np.nextafter(shard[2, 1], np.float32(np.inf))
    save_file({"fc1.weight": full["fc1.weight"][4:8].copy(), "fc2.weight": shard,
               "norm.weight": full["norm.weight"].copy()}, str(ranks / "rank1.safetensors"))  # fmt: skip
    row = dmlib.compare(str(ranks), str(tmp_path / "merged.safetensors"), mapping=mp)
    row = row.set_index("name").loc["fc2.weight"]
    assert row["first_diff_source"] == "rank1.safetensors:fc2.weight[2, 1]"
    assert row["first_diff_target"] == "fc2.weight[2, 5]"
    # a missing rank is refused
    (ranks / "rank1.safetensors").rename(ranks / "rank2.safetensors")
    with pytest.raises(DmlibError, match="one is missing"):
        dmlib.compare(str(ranks), str(tmp_path / "merged.safetensors"), mapping=_map(text))


def test_cast_is_compared_under_the_cross_dtype_rule() -> None:
    import ml_dtypes

    rng = np.random.default_rng(4)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    b16 = w.T.astype(ml_dtypes.bfloat16)  # round to nearest even, the cross-dtype rule
    no_cast = {"rule": [{"source": "w", "target": "w_t", "transforms": [{"op": "transpose"}]}]}
    s = summarize(dmlib.compare({"w": w}, {"w_t": b16}, mapping=no_cast))
    assert s["mismatched"] == ["w_t"] and not s["identical"]
    cast = {"rule": [{"source": "w", "target": "w_t", "transforms": [
        {"op": "transpose"}, {"op": "cast", "dtype": "bfloat16"}]}]}  # fmt: skip
    df = dmlib.compare({"w": w}, {"w_t": b16}, mapping=cast)
    s = summarize(df)
    assert s["identical"] and s["rounded"] == ["w_t"]
    assert df.attrs["rounded"][0]["to"] == "bfloat16"
    b16b = b16.copy()
    b16b[1, 2] = np.nextafter(b16b[1, 2], ml_dtypes.bfloat16(10))
    row = dmlib.compare({"w": w}, {"w_t": b16b}, mapping=cast).iloc[0]
    assert row["max_ulp"] == 1 and row["first_diff_source"] == "w[2, 1]"


@pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"JAX fixtures not found at {FIXTURES}")
def test_flax_mlp_against_its_torch_port(tmp_path: Path) -> None:
    npz = FIXTURES / "A_step_10.npz"
    flax = dict(np.load(npz))
    layers = [torch.nn.Linear(*flax[f"model.l{i}.kernel"].shape) for i in (1, 2, 3)]
    with torch.no_grad():  # the port: Flax kernel [in, out] -> torch weight [out, in]
        for i, lin in enumerate(layers, 1):
            lin.weight.copy_(torch.from_numpy(flax[f"model.l{i}.kernel"]).T)
            lin.bias.copy_(torch.from_numpy(flax[f"model.l{i}.bias"]))
    net = torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1], torch.nn.ReLU(), layers[2])
    torch.save(net.state_dict(), tmp_path / "port.pt")
    text = """
ignore_a = ["optimizer.*"]
[[rule]]
source = "model.l{i}.kernel"
target = "{j}.weight"
transforms = [{ op = "transpose" }]
[[rule]]
source = "model.l{i}.bias"
target = "{j}.bias"
"""
    # torch numbers the Sequential 0, 2, 4: the layer number is not a capture of both names
    rules = {"ignore_a": ["optimizer.*"], "rule": []}
    for i, j in ((1, 0), (2, 2), (3, 4)):
        rules["rule"] += [
            {
                "source": f"model.l{i}.kernel",
                "target": f"{j}.weight",
                "transforms": [{"op": "transpose"}],
            },
            {"source": f"model.l{i}.bias", "target": f"{j}.bias"},
        ]
    assert "{j}" in text  # (the pattern form cannot say 1->0, 2->2, 3->4: explicit rules)
    df = dmlib.compare(str(npz), str(tmp_path / "port.pt"), mapping=rules)
    s = summarize(df)
    assert s["n_tensors"] == 6 and s["n_diff"] == 0
    assert len(s["only_in_a"]) == 14 and not s["identical"]  # the optimizer state: not compared


def test_written_mapping_escapes_hostile_names() -> None:
    from dmlib.mapping.spec import Mapping, Rule, to_toml

    name = 'w"\x1b[31m\nx\\y'
    m = Mapping((Rule((name,), ("t",)),), comments={1: f"about {name}"})
    text = to_toml(m, header=f"from {name}")
    assert "\x1b" not in text and "\r" not in text
    (rule,) = loads(text).rules
    assert rule.sources == (name,) and rule.targets == ("t",)


def test_scalars_follow_the_unmapped_rule() -> None:
    """A mapped comparison judges plain values as an unmapped one does: another value on both
    sides is DIFFERENT, a value only one side holds is not compared (never identical)."""
    from dmlib.tensor import ArrayTensorSet

    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    mapping = _map('[[rule]]\nsource = "w"\ntarget = "wt"\ntransforms = [{ op = "transpose" }]\n')

    def side(name, arr, **scalars):
        return ArrayTensorSet({name: arr}, scalars=scalars)

    same = dmlib.compare(side("w", w, lr=0.1), side("wt", w.T.copy(), lr=0.1), mapping=mapping)
    assert summarize(same)["identical"] is True
    other = dmlib.compare(side("w", w, lr=0.1), side("wt", w.T.copy(), lr=0.2), mapping=mapping)
    assert other.attrs["scalars_diff"] == {"lr": [0.1, 0.2]}
    assert summarize(other)["identical"] is False
    one = dmlib.compare(side("w", w, lr=0.1), side("wt", w.T.copy()), mapping=mapping)
    assert one.attrs["scalars_only_in_a"] == ["lr"] and one.attrs["scalars_diff"] == {}
    assert summarize(one)["identical"] is False
