"""LoRA adapters compared by the weight they add, and merges checked against base + adapter.

Adapters are written by peft itself (tiny random-init Qwen2 from a config, LoraConfig r=8,
alpha=16 on q/k/v/o, ``init_lora_weights=False`` so that B is not zero). Oracles: numpy's
``scaling * B @ A`` on the factors read by safetensors, peft's own ``scaling`` per layer,
peft's ``merge_and_unload``; planted changes are made here with numpy.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.numpy import load_file, save_file  # noqa: E402

import dmlib  # noqa: E402
from dmlib.cli import main  # noqa: E402
from dmlib.errors import FormatError  # noqa: E402
from dmlib.forensics.lora import AdapterConfig, check_merge, compare_adapters  # noqa: E402

# peft 0.21 calls a transformers 5 method that warns of its own deprecation
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")

QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
WEIGHTS = "adapter_model.safetensors"


def _model(dtype: torch.dtype = torch.float32, seed: int = 0) -> object:
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(cfg).to(dtype)


def _adapter(out: Path, *, seed: int = 0, **lora: object) -> object:
    """A peft model over a fresh tiny Qwen2 with random A and B, saved to ``out``."""
    config = {"r": 8, "lora_alpha": 16, "target_modules": QKVO, "init_lora_weights": False}
    config.update(lora)
    pm = peft.get_peft_model(_model(seed=seed), peft.LoraConfig(**config))
    pm.save_pretrained(out)
    return pm


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _numpy_delta(folder: Path, module: str, scaling: float) -> np.ndarray:
    t = load_file(folder / WEIGHTS)
    a = t[f"base_model.model.{module}.lora_A.weight"].astype(np.float64)
    b = t[f"base_model.model.{module}.lora_B.weight"].astype(np.float64)
    return scaling * (b @ a)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "adapter"
    _adapter(out)
    return out


def test_identical_adapters_are_identical(adapter, tmp_path):
    df = compare_adapters(adapter, _copy(adapter, tmp_path / "copy"))
    assert len(df) == 8 and set(df["status"]) == {"identical"}
    v = df.attrs["verdict"]
    assert v and str(v).startswith("IDENTICAL")
    assert main(["compare", str(adapter), str(tmp_path / "copy")]) == 0


def test_rank_permuted_adapter_is_equal_within_rounding_never_different(adapter, tmp_path):
    perm = np.random.default_rng(1).permutation(8)
    t = load_file(adapter / WEIGHTS)
    for name in list(t):
        if name.endswith("lora_A.weight"):
            t[name] = np.ascontiguousarray(t[name][perm])  # A -> P A
        else:
            t[name] = np.ascontiguousarray(t[name][:, perm])  # B -> B P^T
    permuted = _copy(adapter, tmp_path / "permuted")
    save_file(t, permuted / WEIGHTS)
    # the oracle: numpy's products of the two sides differ, if at all, by float64 rounding
    module = "model.layers.0.self_attn.q_proj"
    da, db = _numpy_delta(adapter, module, 2.0), _numpy_delta(permuted, module, 2.0)
    # each float64 product of r = 8 terms is within r * eps * scaling * (|B| @ |A|) of the
    # exact one (the classic dot-product bound), whatever order this machine sums in
    w = load_file(adapter / WEIGHTS)
    a_abs = np.abs(w[f"base_model.model.{module}.lora_A.weight"].astype(np.float64))
    b_abs = np.abs(w[f"base_model.model.{module}.lora_B.weight"].astype(np.float64))
    bound = 2 * 8 * np.finfo(np.float64).eps * 2.0 * (b_abs @ a_abs)
    assert (np.abs(da - db) <= bound).all()
    df = compare_adapters(adapter, permuted)
    assert set(df["status"]) == {"equal"}  # factors differ bitwise, the weight added does not
    assert (df["factor_n_diff"] > 0).all() and (df["n_outside"] == 0).all()
    assert (df["max_ulp"] <= df["bound_ulp"]).all() and (df["bound_ulp"] < 1).all()
    assert df.attrs["verdict"] and str(df.attrs["verdict"]).startswith("EQUAL")
    assert main(["compare", str(adapter), str(permuted)]) == 0
    assert main(["compare", str(adapter), str(permuted), "--raw"]) == 1  # the factors differ


def test_one_element_of_b_changed_is_found_at_its_target(adapter, tmp_path):
    t = load_file(adapter / WEIGHTS)
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    t[name][3, 2] = np.nextafter(t[name][3, 2], np.float32(np.inf))  # +1 ULP
    planted = _copy(adapter, tmp_path / "planted")
    save_file(t, planted / WEIGHTS)
    df = compare_adapters(adapter, planted).set_index("target")
    assert df.loc["model.layers.1.self_attn.v_proj", "status"] == "different"
    assert (df.drop(index="model.layers.1.self_attn.v_proj")["status"] == "identical").all()
    oracle = _numpy_delta(adapter, "model.layers.1.self_attn.v_proj", 2.0) - _numpy_delta(
        planted, "model.layers.1.self_attn.v_proj", 2.0
    )
    row = df.loc["model.layers.1.self_attn.v_proj"]
    assert row["max_abs"] == pytest.approx(np.abs(oracle).max(), rel=1e-12)
    assert row["n_outside"] == np.count_nonzero(oracle)  # one row of the delta: A's row 2
    assert np.count_nonzero(oracle) == np.count_nonzero(load_file(adapter / WEIGHTS)[
        "base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"][2])  # fmt: skip
    v = df.attrs["verdict"] if hasattr(df, "attrs") else None
    assert v is not None and not v and v.different == ["model.layers.1.self_attn.v_proj"]
    assert main(["compare", str(adapter), str(planted)]) == 1


def test_alpha_changed_in_the_config_only_is_found(adapter, tmp_path):
    changed = _copy(adapter, tmp_path / "alpha")
    config = json.loads((changed / "adapter_config.json").read_text())
    config["lora_alpha"] = 32
    (changed / "adapter_config.json").write_text(json.dumps(config))
    df = compare_adapters(adapter, changed)
    assert set(df["status"]) == {"different"} and (df["factor_n_diff"] == 0).all()
    assert set(df["scaling_a"]) == {2.0} and set(df["scaling_b"]) == {4.0}
    module = "model.layers.0.self_attn.k_proj"
    oracle = np.abs(_numpy_delta(adapter, module, 2.0) - _numpy_delta(adapter, module, 4.0))
    row = df.set_index("target").loc[module]
    assert row["max_abs"] == pytest.approx(oracle.max(), rel=1e-12)
    assert row["rel_fro"] == pytest.approx(1.0, rel=1e-12)  # ||2D - 4D|| / ||2D||


def test_rslora_and_patterns_give_peft_s_own_scaling(tmp_path):
    pm = _adapter(tmp_path / "rs", use_rslora=True, rank_pattern={"q_proj": 4},
                  alpha_pattern={"layers.1.self_attn.v_proj": 40})  # fmt: skip
    config = AdapterConfig.from_dict(json.loads((tmp_path / "rs/adapter_config.json").read_text()))
    layers = {n.removeprefix("base_model.model."): m for n, m in pm.named_modules()
              if isinstance(getattr(m, "scaling", None), dict) and "default" in m.scaling}  # fmt: skip
    assert len(layers) == 8
    for module, layer in layers.items():
        assert config.scaling(module) == layer.scaling["default"]  # peft's own
        assert config.rank(module) == layer.r["default"]
    assert config.scaling("model.layers.0.self_attn.q_proj") == 16 / math.sqrt(4)
    assert config.scaling("model.layers.1.self_attn.v_proj") == 40 / math.sqrt(8)
    # the same factors without rslora add another weight: found
    plain = _copy(tmp_path / "rs", tmp_path / "plain")
    cfg = json.loads((plain / "adapter_config.json").read_text())
    cfg["use_rslora"] = False
    (plain / "adapter_config.json").write_text(json.dumps(cfg))
    df = compare_adapters(tmp_path / "rs", plain).set_index("target")
    assert set(df["status"]) == {"different"}
    module = "model.layers.0.self_attn.k_proj"
    oracle = np.abs(_numpy_delta(plain, module, 16 / math.sqrt(8)) - _numpy_delta(plain, module, 2))
    assert df.loc[module, "max_abs"] == pytest.approx(oracle.max(), rel=1e-12)


def test_dora_magnitude_vectors_are_compared(tmp_path):
    _adapter(tmp_path / "dora", use_dora=True, target_modules=["q_proj"])
    t = load_file(tmp_path / "dora" / WEIGHTS)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    assert name in t
    t[name][5] = np.nextafter(t[name][5], np.float32(0))
    planted = _copy(tmp_path / "dora", tmp_path / "planted")
    save_file(t, planted / WEIGHTS)
    df = compare_adapters(tmp_path / "dora", planted).set_index("target")
    assert df.loc["model.layers.0.self_attn.q_proj.lora_magnitude_vector", "status"] == "different"
    assert df.loc["model.layers.0.self_attn.q_proj", "status"] == "identical"
    assert not df.attrs["verdict"]


def test_adapter_weights_file_reads_the_config_beside_it(adapter, tmp_path):
    df = compare_adapters(adapter / WEIGHTS, adapter)
    assert df.attrs["verdict"]
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(adapter / WEIGHTS, lone / WEIGHTS)
    with pytest.raises(FormatError, match="no adapter_config.json with it"):
        compare_adapters(lone / WEIGHTS, adapter)


# -- merges ---------------------------------------------------------------------------------


def _merged(root: Path, dtype: torch.dtype) -> tuple[Path, Path, Path]:
    """base/, adapter/ and merged/ (peft's merge_and_unload) for one dtype."""
    base, ad, merged = root / "base", root / "adapter", root / "merged"
    model = _model(dtype)
    model.save_pretrained(base)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=QKVO, init_lora_weights=False)
    pm = peft.get_peft_model(model, config)
    pm.save_pretrained(ad)
    pm.merge_and_unload().save_pretrained(merged)
    return base, ad, merged


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def merge(request, tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp(f"merge_{request.param}")
    return _merged(root, getattr(torch, request.param))


def test_peft_merge_is_within_one_merge_s_rounding(merge):
    base, ad, merged = merge
    df = check_merge(merged, base, ad)
    assert len(df) == 8 and set(df["status"]) == {"within"}
    v = df.attrs["verdict"]
    assert v and v.n_untouched > 0 and not v.untouched_differ
    # the merge did change the targets: the check is not vacuous
    mt, bt = load_file(merged / "model.safetensors"), load_file(base / "model.safetensors")
    for w in df["weight"]:
        assert not np.array_equal(mt[w], bt[w])
    assert main(["compare", str(merged), str(base), "--adapter", str(ad)]) == 0


def test_scaling_applied_twice_on_one_target_is_named(merge, tmp_path):
    base, ad, merged = merge
    wrong = _copy(merged, tmp_path / "wrong")
    t = load_file(merged / "model.safetensors")
    w = "model.layers.1.self_attn.o_proj.weight"
    delta = _numpy_delta(ad, "model.layers.1.self_attn.o_proj", 2.0)
    base_w = load_file(base / "model.safetensors")[w]
    t[w] = (base_w.astype(np.float64) + 2 * delta).astype(base_w.dtype)  # scaling twice
    save_file(t, wrong / "model.safetensors", metadata={"format": "pt"})
    df = check_merge(wrong, base, ad).set_index("target")
    assert df.loc["model.layers.1.self_attn.o_proj", "status"] == "outside"
    assert (df.drop(index="model.layers.1.self_attn.o_proj")["status"] == "within").all()
    v = df.attrs["verdict"]
    assert not v and v.outside == ["model.layers.1.self_attn.o_proj"]
    assert main(["compare", str(wrong), str(base), "--adapter", str(ad)]) == 1


def test_untouched_tensor_changed_is_named(merge, tmp_path):
    base, ad, merged = merge
    wrong = _copy(merged, tmp_path / "norm")
    t = load_file(merged / "model.safetensors")
    n = "model.layers.0.input_layernorm.weight"
    t[n] = t[n].copy()
    t[n][0] = np.nextafter(t[n][0], np.inf).astype(t[n].dtype) if t[n].dtype == np.float32 else (
        -t[n][0])  # fmt: skip
    save_file(t, wrong / "model.safetensors", metadata={"format": "pt"})
    v = check_merge(wrong, base, ad).attrs["verdict"]
    assert not v and v.untouched_differ == [n] and not v.outside


def test_names_of_a_base_saved_without_its_model_prefix(merge, tmp_path):
    base, ad, merged = merge
    bare = tmp_path / "bare.safetensors"
    t = load_file(base / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in t.items()}, bare)
    m = tmp_path / "merged_bare.safetensors"
    mt = load_file(merged / "model.safetensors")
    save_file({k.removeprefix("model."): v for k, v in mt.items()}, m)
    df = check_merge(m, bare, ad)
    assert df.attrs["verdict"]
    assert "layers.0.self_attn.q_proj.weight" in set(df["weight"])


def test_compare_adapter_option_refuses_a_non_adapter(merge):
    base, _ad, merged = merge
    assert main(["compare", str(merged), str(base), "--adapter", str(base)]) == 2


def test_dmlib_exports():
    assert dmlib.compare_adapters is compare_adapters and dmlib.check_merge is check_merge


def test_a_few_ulp_off_in_one_element_of_one_target_is_outside(merge, tmp_path):
    """The bound is one merge's rounding, not a loose tolerance: a few ULP off is named
    (bfloat16: 4 ULP; float32: 24, as the float32 product's worst case for r = 8 terms,
    gamma(11) (|B| @ |A|), is itself several ULP of the merged element)."""
    base, ad, merged = merge
    t = load_file(merged / "model.safetensors")
    w = "model.layers.0.self_attn.k_proj.weight"
    m = t[w].copy()
    a_ = load_file(ad / WEIGHTS)
    pre = "base_model.model.model.layers.0.self_attn.k_proj."
    size = 2.0 * (np.abs(a_[pre + "lora_B.weight"].astype(np.float64))
                  @ np.abs(a_[pre + "lora_A.weight"].astype(np.float64)))  # fmt: skip
    i = np.unravel_index(np.argmax(np.abs(m.astype(np.float64)) / size), m.shape)
    for _ in range(4 if m.dtype != np.float32 else 24):  # steps of the dtype, away from 0
        m[i] = np.nextafter(m[i], np.copysign(np.inf, m[i]).astype(m.dtype))
    t[w] = m
    off = _copy(merged, tmp_path / "off")
    save_file(t, off / "model.safetensors", metadata={"format": "pt"})
    df = check_merge(off, base, ad).set_index("target")
    assert df.loc["model.layers.0.self_attn.k_proj", "n_outside"] == 1
    assert df.attrs["verdict"].outside == ["model.layers.0.self_attn.k_proj"]


@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers` to `True`")
def test_embedding_and_linear_deltas_are_peft_s_own(tmp_path):
    """The weight each target adds is peft's get_delta_weight (float32) to its rounding, an
    embedding's included ((B @ A).T); the merge of both kinds passes the check."""
    base, ad, merged = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    model = _model()
    model.save_pretrained(base)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "embed_tokens"],
                             init_lora_weights=False)  # fmt: skip
    pm = peft.get_peft_model(model, config)
    pm.save_pretrained(ad)
    layers = {n.removeprefix("base_model.model."): m for n, m in pm.named_modules()
              if hasattr(m, "get_delta_weight") and hasattr(m, "lora_A")}  # fmt: skip
    import contextlib

    from dmlib.forensics.lora import open_adapter

    with contextlib.ExitStack() as stack:
        adapter = open_adapter(ad, stack)
        assert set(adapter.targets) == set(layers) and len(layers) == 3
        assert adapter.targets["model.embed_tokens"].kind == "embedding"
        for module, layer in layers.items():
            theirs = layer.get_delta_weight("default").detach().double().numpy()
            ours = adapter.delta(module)[0]
            assert ours.shape == theirs.shape
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6 * np.abs(theirs).max())
    pm.merge_and_unload().save_pretrained(merged)
    df = check_merge(merged, base, ad)
    assert df.attrs["verdict"] and set(df["weight"]) >= {"model.embed_tokens.weight"}
