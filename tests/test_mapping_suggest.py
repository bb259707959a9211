"""``suggest``: the mapping found from the values alone recovers the hand-written one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dmlib
from dmlib.mapping import suggest, to_toml
from dmlib.mapping.resolve import resolve
from dmlib.mapping.spec import loads
from dmlib.mapping.transforms import describe_chain
from dmlib.stats.compare import summarize

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import _support.mapmodels as tm  # noqa: E402


def per_target(mapping, names_a, names_b) -> dict[str, tuple[tuple[str, ...], str]]:
    """target -> (the sources feeding it, the chain), however the rules are grouped."""
    out = {}
    for b in resolve(mapping, names_a, names_b).bindings:
        ops = b.rule.ops
        elementwise = not any(op.name in ("split", "concat", "tie") for op in ops)
        for k, t in enumerate(b.targets):
            srcs = (
                (b.sources[k],) if elementwise and len(b.sources) == len(b.targets) else b.sources
            )
            out[t] = (tuple(srcs), describe_chain(ops))
    return out


@pytest.fixture(scope="module")
def gpt2():
    sd = tm.gpt2_state()
    return sd, tm.gpt2_converted(sd)


def test_suggest_recovers_the_hand_written_gpt2_mapping(gpt2) -> None:
    sd, conv = gpt2
    s = suggest(sd, conv)
    assert s.unplaced_a == [] and s.unplaced_b == []
    hand = tm._map(tm.GPT2_MAP)
    assert per_target(s.mapping, list(sd), list(conv)) == per_target(hand, list(sd), list(conv))
    # written out and read back, it compares the two as identical
    again = loads(to_toml(s.mapping))
    assert summarize(dmlib.compare(sd, conv, mapping=again))["identical"]
    text = to_toml(s.mapping)
    assert 'source = "transformer.h.{i}.attn.c_attn.weight"' in text  # layers as a capture
    assert text.count("# confidence: exact") == len(s.mapping.rules)


def test_suggest_llama_meta_to_hf_finds_the_rotary_permutation() -> None:
    hf = tm.llama_hf()
    meta = tm.llama_meta(hf)
    s = suggest(meta, hf)
    assert s.unplaced_a == [] and s.unplaced_b == []
    got = per_target(s.mapping, list(meta), list(hf))
    assert got == per_target(tm._map(tm.LLAMA_MAP), list(meta), list(hf))


def megatron_qkv(hf: dict[str, np.ndarray], layer: int) -> np.ndarray:
    """Megatron-LM's fused linear_qkv: per query group, its query heads, then k, then v."""
    p = f"model.layers.{layer}.self_attn."
    q, k, v = (hf[p + f"{x}_proj.weight"] for x in "qkv")
    hd = tm.D // tm.HEADS
    per = tm.HEADS // tm.KV_HEADS
    rows = []
    for g in range(tm.KV_HEADS):
        rows.append(q[g * per * hd : (g + 1) * per * hd])
        rows.append(k[g * hd : (g + 1) * hd])
        rows.append(v[g * hd : (g + 1) * hd])
    return np.concatenate(rows, axis=0)


def test_suggest_splits_megatron_fused_qkv_per_group() -> None:
    hf = tm.llama_hf()
    keep = [n for n in hf if "self_attn" in n and "o_proj" not in n]
    target = {n: hf[n] for n in keep}
    source = {
        f"decoder.layers.{i}.self_attention.linear_qkv.weight": megatron_qkv(hf, i)
        for i in range(tm.LAYERS)
    }
    s = suggest(source, target)
    assert s.unplaced_a == [] and s.unplaced_b == []
    (rule,) = s.mapping.rules
    assert rule.sources == ("decoder.layers.{i}.self_attention.linear_qkv.weight",)
    assert [op.name for op in rule.ops] == ["reshape", "split", "reshape"]
    assert summarize(dmlib.compare(source, target, mapping=s.mapping))["identical"]
    # one ULP in k_proj row r, column c of layer 1: group r // hd, row 8 + r % hd of that group
    t2 = dict(target)
    k = t2["model.layers.1.self_attn.k_proj.weight"].copy()
    r, c = 6, 9
    k[r, c] = np.nextafter(k[r, c], np.float32(np.inf))
    t2["model.layers.1.self_attn.k_proj.weight"] = k
    row = (
        dmlib.compare(source, t2, mapping=s.mapping)
        .set_index("name")
        .loc["model.layers.1.self_attn.k_proj.weight"]
    )
    hd, per = tm.D // tm.HEADS, tm.HEADS // tm.KV_HEADS
    g, j = divmod(r, hd)
    src_row = g * (per + 2) * hd + per * hd + j
    assert (
        row["first_diff_source"]
        == f"decoder.layers.1.self_attention.linear_qkv.weight[{src_row}, {c}]"
    )


def test_suggest_concatenates_tensor_parallel_shards(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(7)
    full = {"fc1.weight": rng.standard_normal((8, 6)).astype(np.float32),
            "fc2.weight": rng.standard_normal((6, 8)).astype(np.float32)}  # fmt: skip
    for r in range(2):
        save_file({"fc1.weight": np.ascontiguousarray(full["fc1.weight"][4 * r : 4 * r + 4]),
                   "fc2.weight": np.ascontiguousarray(full["fc2.weight"][:, 4 * r : 4 * r + 4])},
                  str(tmp_path / f"rank{r}.safetensors"))  # fmt: skip
    files = [str(tmp_path / f"rank{r}.safetensors") for r in range(2)]
    s = suggest(files, full)
    assert s.unplaced_a == [] and s.unplaced_b == []
    got = {(r.sources, r.targets, describe_chain(r.ops)) for r in s.mapping.rules}
    assert got == {
        (("rank{r}.safetensors:fc1.weight",), ("fc1.weight",), "concat(axis=0)"),
        (("rank{r}.safetensors:fc2.weight",), ("fc2.weight",), "concat(axis=1)"),
    }


def test_suggest_flax_kernels_against_torch_weights_names_the_optimizer_state() -> None:
    if not tm.FIXTURES.is_dir():
        pytest.skip(f"JAX fixtures not found at {tm.FIXTURES}")
    flax = dict(np.load(tm.FIXTURES / "A_step_10.npz"))
    port = {}
    for i, j in ((1, 0), (2, 2), (3, 4)):
        port[f"{j}.weight"] = np.ascontiguousarray(flax[f"model.l{i}.kernel"].T)
        port[f"{j}.bias"] = flax[f"model.l{i}.bias"].copy()
    s = suggest(flax, port)
    assert s.unplaced_b == []
    assert sorted(s.unplaced_a) == sorted(n for n in flax if n.startswith("optimizer."))
    import dataclasses

    declared = dataclasses.replace(s.mapping, ignore_a=("optimizer.*",))
    pairs = per_target(declared, list(flax), list(port))
    assert pairs["2.weight"] == (("model.l2.kernel",), "transpose()")
    assert pairs["4.bias"] == (("model.l3.bias",), "identity")
    s2 = summarize(dmlib.compare(flax, port, mapping=declared))
    assert s2["n_tensors"] == 6 and s2["n_diff"] == 0 and len(s2["only_in_a"]) == 14


def test_a_pair_that_differs_slightly_is_proposed_with_low_confidence(gpt2) -> None:
    sd, conv = gpt2
    conv = dict(conv)
    w = conv["blocks.0.mlp.c_fc.weight"].copy()
    w[1, 2] = np.nextafter(w[1, 2], np.float32(np.inf))
    conv["blocks.0.mlp.c_fc.weight"] = w
    s = suggest(sd, conv)
    assert s.unplaced_a == [] and s.unplaced_b == []
    (num,) = [r.number for r in s.mapping.rules if r.targets == ("blocks.0.mlp.c_fc.weight",)]
    assert s.confidence[num].startswith("confidence: low")
    row = (
        dmlib.compare(sd, conv, mapping=s.mapping).set_index("name").loc["blocks.0.mlp.c_fc.weight"]
    )
    assert (
        row["n_diff"] == 1 and row["first_diff_source"] == "transformer.h.0.mlp.c_fc.weight[2, 1]"
    )


def flax_llama(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Llama's attention as Flax ``DenseGeneral`` kernels, MLP as ``Dense`` kernels, by loops.

    q/k/v kernels are ``[embed, heads, head_dim]`` (kernel[e, h, j] = W[h * hd + j, e]),
    the output kernel ``[heads, head_dim, embed]`` (kernel[h, j, e] = W[e, h * hd + j]),
    a Dense kernel ``[in, out]`` (the weight transposed).
    """
    hd = tm.D // tm.HEADS
    out = {}
    for name, w in hf.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            heads = w.shape[0] // hd
            k = np.empty((w.shape[1], heads, hd), w.dtype)
            for e in range(w.shape[1]):
                for h in range(heads):
                    for j in range(hd):
                        k[e, h, j] = w[h * hd + j, e]
            out["flax." + name.replace(".weight", ".kernel")] = k
        elif name.endswith("o_proj.weight"):
            k = np.empty((tm.HEADS, hd, w.shape[0]), w.dtype)
            for h in range(tm.HEADS):
                for j in range(hd):
                    k[h, j, :] = w[:, h * hd + j]
            out["flax." + name.replace(".weight", ".kernel")] = k
        elif w.ndim == 2 and "embed_tokens" not in name:
            out["flax." + name.replace(".weight", ".kernel")] = np.ascontiguousarray(w.T)
        else:
            out["flax." + name] = w.copy()
    return out


def test_suggest_flax_dense_general_kernels_against_torch_llama() -> None:
    hf = tm.llama_hf()
    fx = flax_llama(hf)
    s = suggest(fx, hf)
    assert s.unplaced_a == [] and s.unplaced_b == []
    got = per_target(s.mapping, list(fx), list(hf))
    hd = tm.D // tm.HEADS
    q = "model.layers.1.self_attn.q_proj.weight"
    assert got[q] == (("flax.model.layers.1.self_attn.q_proj.kernel",),
                      f"reshape(shape=[{tm.D}, {tm.D}]) | transpose()")  # fmt: skip
    k = "model.layers.0.self_attn.k_proj.weight"
    assert got[k][1] == f"reshape(shape=[{tm.D}, {tm.KV_HEADS * hd}]) | transpose()"
    o = "model.layers.0.self_attn.o_proj.weight"
    assert got[o] == (("flax.model.layers.0.self_attn.o_proj.kernel",),
                      f"reshape(shape=[{tm.D}, {tm.D}]) | transpose()")  # fmt: skip
    assert got["model.layers.0.mlp.up_proj.weight"][1] == "transpose()"
    # and the proposed mapping compares the two as identical
    assert summarize(dmlib.compare(fx, hf, mapping=s.mapping))["identical"]


def _gpt2_at_init() -> dict[str, np.ndarray]:
    """A tiny GPT-2 as transformers initialises it: biases zero, LayerNorms ones and zeros."""
    cfg = tm.transformers.GPT2Config(n_layer=tm.LAYERS, n_embd=tm.D, n_head=2, vocab_size=50,
                                  n_positions=8, bos_token_id=0, eos_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    sd = {k: v.detach().numpy().copy()
          for k, v in tm.transformers.GPT2LMHeadModel(cfg).state_dict().items()}  # fmt: skip
    sd.pop("lm_head.weight")  # tied to wte
    assert not sd["transformer.h.0.attn.c_attn.bias"].any()  # the case: zero at init
    return sd


def _megatron_ranks(sd: dict[str, np.ndarray], folder: Path) -> list[str]:
    """GPT-2 in a Megatron-style layout over two rank files, by hand (the ground truth):
    q/k/v as separate Linear weights and biases, a column-parallel fc1 (rows and bias
    halves on each rank), a row-parallel fc2 (column halves; its bias on rank 0)."""
    from safetensors.numpy import save_file

    D = tm.D
    ranks: list[dict[str, np.ndarray]] = [{}, {}]
    r0 = ranks[0]
    r0["embedding.word_embeddings.weight"] = sd["transformer.wte.weight"]
    r0["embedding.position_embeddings.weight"] = sd["transformer.wpe.weight"]
    r0["final_layernorm.weight"] = sd["transformer.ln_f.weight"]
    r0["final_layernorm.bias"] = sd["transformer.ln_f.bias"]
    for i in range(tm.LAYERS):
        h, o = f"transformer.h.{i}.", f"layers.{i}."
        w, b = sd[h + "attn.c_attn.weight"], sd[h + "attn.c_attn.bias"]  # Conv1D [in, 3D]
        for j, x in enumerate("qkv"):
            r0[o + f"self_attention.{x}.weight"] = w[:, j * D : (j + 1) * D].T
            r0[o + f"self_attention.{x}.bias"] = b[j * D : (j + 1) * D]
        r0[o + "self_attention.dense.weight"] = sd[h + "attn.c_proj.weight"].T
        r0[o + "self_attention.dense.bias"] = sd[h + "attn.c_proj.bias"]
        for n, to in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            r0[o + to + ".weight"], r0[o + to + ".bias"] = (
                sd[h + n + ".weight"],
                sd[h + n + ".bias"],
            )
        fc1, fc1_b = sd[h + "mlp.c_fc.weight"].T, sd[h + "mlp.c_fc.bias"]  # [4D, D]
        fc2 = sd[h + "mlp.c_proj.weight"].T  # [D, 4D]
        half = 2 * D
        for r in range(2):
            ranks[r][o + "mlp.fc1.weight"] = fc1[r * half : (r + 1) * half]
            ranks[r][o + "mlp.fc1.bias"] = fc1_b[r * half : (r + 1) * half]
            ranks[r][o + "mlp.fc2.weight"] = fc2[:, r * half : (r + 1) * half]
        r0[o + "mlp.fc2.bias"] = sd[h + "mlp.c_proj.bias"]
    paths = []
    for r, tensors in enumerate(ranks):
        paths.append(str(folder / f"rank{r}.safetensors"))
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, paths[-1])
    return paths


def test_suggest_places_zero_biases_by_their_weights_layout(tmp_path: Path) -> None:
    """GPT-2 at init against a Megatron-style layout over two rank files: the biases (all
    zero) follow their weights' split and rank layout, marked 'by name and layout'; the
    mapping then pairs every bias of a trained model (distinct values) exactly."""
    sd = _gpt2_at_init()
    (tmp_path / "init").mkdir()
    s = suggest(sd, _megatron_ranks(sd, tmp_path / "init"))
    assert s.unplaced_a == [] and s.unplaced_b == []
    text = to_toml(s.mapping)
    assert "confidence: by name and layout" in text
    layout_rules = [r for r in s.mapping.rules if "by name and layout" in s.confidence[r.number]]
    assert {t.rsplit(".", 2)[-2] for r in layout_rules for t in r.targets} >= {
        "q", "k", "v", "dense", "fc1", "fc2",
    }  # fmt: skip
    # ground truth: the same layout written from a model whose biases are all distinct
    g = np.random.default_rng(1)
    trained = {k: (g.standard_normal(v.shape).astype(v.dtype)
                   if k.endswith("bias") and ".ln_" not in k else v) for k, v in sd.items()}  # fmt: skip
    (tmp_path / "trained").mkdir()
    ranks = _megatron_ranks(trained, tmp_path / "trained")
    again = loads(to_toml(s.mapping).replace(str(tmp_path / "init"), str(tmp_path / "trained")))
    df = dmlib.compare(trained, ranks, mapping=again)
    biases = df[df["name"].str.endswith("bias")]
    assert len(biases) and (biases["n_diff"] == 0).all(), biases[["name", "n_diff"]]
    assert summarize(df)["identical"]


def test_layout_of_a_bias_is_checked_not_assumed(tmp_path: Path) -> None:
    """A target bias that does not hold its weight's rows (3D elements beside a 2D-row
    weight) is left unplaced, with the bias of the same split on the other rank."""
    sd = _gpt2_at_init()
    (tmp_path / "r").mkdir()
    paths = _megatron_ranks(sd, tmp_path / "r")
    from safetensors.numpy import load_file, save_file

    r0 = load_file(paths[0])
    r0["layers.0.mlp.fc1.bias"] = np.zeros(3 * tm.D, np.float32)  # not the weight's rows
    save_file(r0, paths[0])
    s = suggest(sd, paths)
    placed = {t for r in s.mapping.rules for t in r.targets}
    assert not any("layers.0.mlp.fc1.bias" in t for t in placed if "{" not in t)
    assert any("fc1.bias" in n for n in s.unplaced_b)
