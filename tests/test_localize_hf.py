"""Tiny Hugging Face causal LMs from configs: a probe alone versus batched with others.

The oracle is independent of dmlib's capture: plain forward hooks on the leaf modules,
taking the probe's rows of each output and comparing their bytes with ``torch.equal``.
Which module differs on this CPU is never asserted: dmlib's set of differing module
outputs is asserted equal to the oracle's. Where the oracle finds no difference, a
batch-variant plant (a hook that rounds a module's output only when the batch holds
more than one row) makes one whose place is known.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import dmlib  # noqa: E402
from dmlib.localize.hf import (  # noqa: E402
    capture_generate,
    compare_generations,
    row_map_from_attention_mask,
    row_map_packed,
)

VOCAB, N_PROBE, N_OTHER, PAD = 64, 11, 14, 3


def make(kind: str, attn: str, dtype: torch.dtype):
    """A 2-layer model of ``kind`` with hidden size 32 (GQA: 2 KV heads for 4 heads)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=64, attn_implementation=attn)  # fmt: skip
        cls = transformers.GPT2LMHeadModel
    else:
        common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attn_implementation=attn, pad_token_id=0)  # fmt: skip
        if kind == "llama":
            cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
        else:
            cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    return cls(cfg).eval().to(dtype)


class Plant:
    """Rounds a module's output to a coarser grid when the batch has several rows."""

    def __init__(self, module, only_prompt: bool = False) -> None:
        self.on, self.only_prompt = True, only_prompt
        self.handle = module.register_forward_hook(self.hook)

    def hook(self, mod, args, out):
        t = out[0] if isinstance(out, tuple) else out
        if not self.on or t.shape[0] < 2 or (self.only_prompt and t.shape[1] == 1):
            return None
        bumped = t * (1 + 2.0**-6)  # changes every nonzero element in f32 and bf16
        return (bumped, *out[1:]) if isinstance(out, tuple) else bumped

    def remove(self) -> None:
        self.handle.remove()


def layouts(layout: str):
    """(alone kwargs, its row map, batched kwargs, its row map, probe slice in batch row 0)."""
    g = torch.Generator().manual_seed(1)
    probe = torch.randint(1, VOCAB, (1, N_PROBE), generator=g)
    others = torch.randint(1, VOCAB, (3, N_OTHER), generator=g)
    alone = {"input_ids": probe}
    rows_alone = row_map_from_attention_mask(torch.ones(1, N_PROBE), ["probe"])
    n = N_OTHER
    if layout == "packed":  # probe then one other in row 0, positions restarting at 0
        ids = torch.cat([probe[0], others[0]])[None]
        pos = torch.cat([torch.arange(N_PROBE), torch.arange(N_OTHER)])[None]
        rows = row_map_packed(position_ids=pos, request_ids=["probe", "o1"])
        return alone, rows_alone, {"input_ids": ids, "position_ids": pos}, rows, slice(0, N_PROBE)
    pad = torch.zeros(1, n - N_PROBE, dtype=torch.long)
    row0 = torch.cat([pad, probe], 1) if layout == "left" else torch.cat([probe, pad], 1)
    ids = torch.cat([row0, others])
    mask = torch.ones_like(ids)
    if layout == "left":
        mask[0, : n - N_PROBE] = 0
        where = slice(n - N_PROBE, n)
    else:
        mask[0, N_PROBE:] = 0
        where = slice(0, N_PROBE)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    rows = row_map_from_attention_mask(mask, ["probe", "o1", "o2", "o3"])
    batched = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    return alone, rows_alone, batched, rows, where


def leaves(model) -> list[str]:
    return [n for n, m in model.named_modules() if n and not list(m.children())]


def oracle(model, alone, batched, where) -> tuple[list[str], bool]:
    """(leaf modules whose probe rows differ, whether the probe's logits differ), by hooks."""
    got: dict[str, list] = {"a": [], "b": []}
    side = ["a"]
    named = dict(model.named_modules())
    handles = []
    for name in leaves(model):

        def hook(mod, args, out, name=name):
            t = out[0] if isinstance(out, tuple) else out
            if torch.is_tensor(t) and t.dim() >= 2 and t.shape[1] > 1:
                got[side[0]].append((name, t.detach().clone()))

        handles.append(named[name].register_forward_hook(hook))
    with torch.no_grad():
        la = model(**alone).logits
        side[0] = "b"
        lb = model(**batched).logits
    for h in handles:
        h.remove()
    assert [n for n, _ in got["a"]] == [n for n, _ in got["b"]]
    differ = [
        n
        for (n, x), (_, y) in zip(got["a"], got["b"], strict=True)
        if x.shape[1] == N_PROBE and not torch.equal(x[0], y[0, where])
    ]
    return differ, not torch.equal(la[0], lb[0, where])


def capture_both(model, tmp_path, alone, rows_a, batched, rows_b, **kw):
    with torch.no_grad():
        with dmlib.capture(model, tmp_path / "a", row_map=rows_a, **kw):
            model(**alone)
        with dmlib.capture(model, tmp_path / "b", row_map=rows_b, **kw):
            model(**batched)
    return dmlib.compare_captures(tmp_path / "a", tmp_path / "b", request="probe")


def differing_outputs(df) -> list[str]:
    """Leaf-module outputs dmlib finds different for the probe (first outputs, first pass)."""
    rows = df[(df["kind"] == "output") & (df["identical"] == False)]  # noqa: E712
    return sorted({b for b in rows["boundary"] if ":" not in b and "#" not in b})


CASES = [
    ("llama", "eager", torch.float32, "left"),
    ("llama", "sdpa", torch.bfloat16, "right"),
    ("gpt2", "eager", torch.bfloat16, "left"),
    ("gpt2", "sdpa", torch.float32, "right"),
    ("llama", "sdpa", torch.float32, "packed"),
    ("qwen2", "eager", torch.float32, "right"),
    ("qwen2", "sdpa", torch.bfloat16, "left"),
]


@pytest.mark.parametrize(("kind", "attn", "dtype", "layout"), CASES)
def test_agrees_with_the_hook_oracle(kind, attn, dtype, layout, tmp_path):
    model = make(kind, attn, dtype)
    alone, rows_a, batched, rows_b, where = layouts(layout)
    differ, logits_differ = oracle(model, alone, batched, where)
    plant = None
    if not differ:
        # no difference on this CPU: plant one in layer 1's MLP output projection
        target = "transformer.h.1.mlp.c_proj" if kind == "gpt2" else "model.layers.1.mlp.down_proj"
        plant = Plant(dict(model.named_modules())[target])
        differ, logits_differ = oracle(model, alone, batched, where)
        assert target in differ
    leaf = set(leaves(model))
    df = capture_both(model, tmp_path, alone, rows_a, batched, rows_b, modules=["", "*"])
    if plant is not None:
        plant.remove()
    at = df.attrs
    assert sorted(n for n in differing_outputs(df) if n in leaf) == sorted(differ)
    assert at["status"] == ("different" if differ or logits_differ else "identical")
    # layout inputs are never judged, never the first divergence, never the culprit
    roles = df.set_index("boundary")["role"]
    for name in at["layout_inputs"]:
        assert name not in roles.index or roles[name] == "layout"
    masks = [b for b in df["boundary"] if ":input.attention_mask" in b or "position_ids" in b]
    assert masks and all(roles[b] == "layout" for b in masks)
    first, culprit = at["first_divergent_boundary"], at["culprit"]
    if differ:
        assert first is not None and ":input." not in first
        assert culprit is not None and roles[culprit] == "culprit" and ":input" not in culprit
        # the culprit's inputs match (oracle: its leaf output is the first the oracle sees)
        if culprit in leaf:
            assert culprit == differ[0]
    # the root has its own label, distinct from the submodule called "model"
    root = dmlib.open_capture(tmp_path / "a").root
    assert root not in dict(model.named_modules())


def test_left_padded_eager_mask_is_not_a_difference(tmp_path):
    """The eager 4-d mask's rows follow the layout; identical probes stay identical."""
    model = make("llama", "eager", torch.float32)
    alone, rows_a, batched, rows_b, where = layouts("left")
    differ, logits_differ = oracle(model, alone, batched, where)
    if differ or logits_differ:
        pytest.skip(f"the oracle finds a difference on this CPU ({differ[:2]}): covered above")
    df = capture_both(model, tmp_path, alone, rows_a, batched, rows_b)
    assert df.attrs["status"] == "identical", dmlib.localize.boundaries.capture_verdict(df)
    assert any("attention_mask" in b for b in df.attrs["layout_inputs"])


def test_gqa_heads_are_an_equivalence_with_ops(tmp_path):
    """SDPA runs on 2 KV heads alone and 4 (repeated) batched: never a divergence."""
    model = make("llama", "sdpa", torch.float32)
    alone, rows_a, batched, rows_b, where = layouts("left")
    target = dict(model.named_modules())["model.layers.0.self_attn.o_proj"]
    plant = Plant(target)
    df = capture_both(model, tmp_path, alone, rows_a, batched, rows_b,
                      ops=True, op_modules="model.layers.0.self_attn", dump="*")  # fmt: skip
    plant.remove()
    heads = df[df["note"].fillna("").str.contains("grouped KV heads")]
    # transformers runs SDPA on the 2 KV heads alone (no mask: enable_gqa) and repeats them
    # to 4 when a padding mask is passed: the key and value inputs change shape, and are
    # judged with the repeats collapsed (tests/test_localize_gqa.py checks them against
    # an oracle)
    assert len(heads) >= 2, df["note"].dropna().unique()[:5]
    for name in heads["boundary"]:
        assert df.set_index("boundary").loc[name, "identical"] is not pd_na()
    # a culprit is named: the plant guarantees a difference
    t = df.set_index("boundary")
    assert t.loc["model.layers.0.self_attn.o_proj", "identical"] == False  # noqa: E712
    assert df.attrs["culprit"] is not None and t.loc[df.attrs["culprit"], "role"] == "culprit"
    op = df.attrs["culprit_op"]
    if op is not None:  # whatever op it names, arbitrate and patch_test accept it
        assert ":" not in op
        res = dmlib.arbitrate(tmp_path / "a", tmp_path / "b", op, backend="numpy")
        assert res.verdict in ("both-close", "a-departs", "b-departs", "inconclusive")


def pd_na():
    import pandas as pd

    return pd.NA


@pytest.mark.slow
def test_generate_steps_cache_and_tokens(tmp_path):
    """generate(): per-step comparison, the KV cache judged per request, tokens compared."""
    model = make("llama", "eager", torch.float32)
    alone, rows_a, batched, rows_b, where = layouts("left")
    gen = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    # a plant on layer 1's keys in the prompt pass only: its cache differs from then on
    plant = Plant(dict(model.named_modules())["model.layers.1.self_attn.k_proj"], only_prompt=True)
    with torch.no_grad():
        oa = capture_generate(model, tmp_path / "a", row_map=rows_a,
                              generate_kwargs={"input_ids": alone["input_ids"], **gen})  # fmt: skip
        ob = capture_generate(model, tmp_path / "b", row_map=rows_b,
                              generate_kwargs={"input_ids": batched["input_ids"],
                                               "attention_mask": batched["attention_mask"], **gen})  # fmt: skip
    plant.remove()
    ta, tb = oa[0, N_PROBE:].tolist(), ob[0, N_OTHER:].tolist()  # the oracle: generate's own
    part = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), None)
    res = compare_generations(tmp_path / "a", tmp_path / "b", request="probe")
    r = res["requests"]["probe"]
    assert r["tokens_a"] == ta and r["tokens_b"] == tb and r["first_parting_step"] == part
    assert [s["step"] for s in res["steps"]] == [0, 1, 2]
    df = res["table"].set_index("boundary")
    # layer 1's cached keys hold the planted prompt keys: they differ at every decode step,
    # so layer 1's decode calls can never be the culprit (their cache input differs)
    cache = [
        b for b in df.index if b.startswith("model.layers.1:") and b.endswith("layers.1.keys#1")
    ]
    assert cache and all(df.loc[b, "identical"] == False for b in cache)  # noqa: E712
    assert df.loc[cache[0], "note"].startswith("KV cache: ")
    assert df.loc["model.layers.1#1", "role"] != "culprit"
    assert df.loc["model.layers.1#1", "identical"] is not pd_na()


def test_row_map_helpers_by_hand():
    mask = [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert row_map_from_attention_mask(mask, ["a", "b"]) == [
        [None, None, ("a", 0), ("a", 1)],
        [("b", 0), ("b", 1), ("b", 2), None],
    ]
    pos = [[0, 1, 2, 0, 1]]
    assert row_map_packed(position_ids=pos) == [[(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]]
    assert row_map_packed(cu_seqlens=[0, 2, 5], length=6, request_ids=["x", "y"]) == [
        [("x", 0), ("x", 1), ("y", 0), ("y", 1), ("y", 2), None]
    ]
    with pytest.raises(dmlib.CaptureError, match="jumps"):
        row_map_packed(position_ids=[[0, 1, 3]])
    with pytest.raises(dmlib.CaptureError, match="exactly one"):
        row_map_packed()


def test_bfloat16_read_in_a_fresh_process_without_torch(tmp_path):
    model = make("llama", "sdpa", torch.bfloat16)
    alone, rows_a, batched, rows_b, where = layouts("right")
    plant = Plant(dict(model.named_modules())["model.layers.0.mlp.down_proj"])
    capture_both(model, tmp_path, alone, rows_a, batched, rows_b, dump="*")
    plant.remove()
    code = (
        "import sys, json, dmlib\n"
        f"df = dmlib.compare_captures({str(tmp_path / 'a')!r}, {str(tmp_path / 'b')!r})\n"
        "row = df.set_index('boundary').loc['model.layers.0.mlp.down_proj']\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'status': df.attrs['status'],"
        " 'n_diff': int(row['n_diff'])}))\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # the oracle: the dumped rows' bytes, compared here with numpy
    a, b = dmlib.open_capture(tmp_path / "a"), dmlib.open_capture(tmp_path / "b")
    xa = a.tensor("model.layers.0.mlp.down_proj", "probe").view(np.uint16)
    xb = b.tensor("model.layers.0.mlp.down_proj", "probe").view(np.uint16)
    assert got == {"torch": False, "status": "different", "n_diff": int((xa != xb).sum())}
    assert got["n_diff"] > 0
    # the CLI too: exit 1 (different), not 4, and torch never imported
    cli = (
        "import sys\nfrom dmlib.cli import main\n"
        f"rc = main(['localize', {str(tmp_path / 'a')!r}, {str(tmp_path / 'b')!r}])\n"
        "print('TORCH', 'torch' in sys.modules, 'RC', rc)\n"
    )
    out = subprocess.run([sys.executable, "-c", cli], capture_output=True, text=True,
                         cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert out.stdout.strip().splitlines()[-1] == "TORCH False RC 1", out.stderr[-2000:]
