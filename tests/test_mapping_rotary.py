"""The rotary permutation on some pieces of a split: a Meta-layout fused QKV weight against a
tiny Hugging Face Llama's separate q/k/v, with and without grouped key/value heads.

The fused tensor is built here by explicit loops over rows (Meta row ``h*d + 2m + r`` holds
HF row ``h*d + r*d/2 + m``, the inverse of the ``permute`` in Hugging Face's
``convert_llama_weights_to_hf.py``), not by dmlib's ``rotary``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import dmlib
from dmlib.errors import DmlibError
from dmlib.mapping import suggest, to_toml
from dmlib.mapping.spec import loads
from dmlib.mapping.transforms import describe_chain
from dmlib.mapping.view import mapped_set, source_index
from dmlib.stats.compare import summarize
from dmlib.tensor import ArrayTensorSet

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from _support.mapmodels import hf_to_meta_by_loops, tiny_llama  # noqa: E402

HIDDEN, HEADS, LAYERS = 32, 4, 2
HD = HIDDEN // HEADS  # head_dim 8
FUSED = "model.layers.{i}.self_attn.wqkv.weight"
QKV = [f"model.layers.{{i}}.self_attn.{x}_proj.weight" for x in "qkv"]


def llama(kv_heads: int) -> dict[str, np.ndarray]:
    """A tiny LlamaForCausalLM from its config, every parameter drawn at random."""
    return tiny_llama(HIDDEN, HEADS, kv_heads, LAYERS, intermediate=48, vocab=24, seed=kv_heads)


to_meta_rows = hf_to_meta_by_loops  # HF row order -> Meta's interleaved rotary order


def fused_meta(hf: dict[str, np.ndarray], kv_heads: int) -> dict[str, np.ndarray]:
    """``hf`` with each layer's q, k, v replaced by one Meta-layout fused [q; k; v] weight."""
    out = dict(hf)
    for i in range(LAYERS):
        q, k, v = (out.pop(p.format(i=i)) for p in QKV)
        out[FUSED.format(i=i)] = np.concatenate(
            [to_meta_rows(q, HEADS), to_meta_rows(k, kv_heads), v], axis=0
        )
    return out


def hand_map(kv_heads: int, per_piece_heads: bool = False) -> str:
    kv = kv_heads * HD
    if per_piece_heads:  # the head counts, one rotary per piece
        rot = (
            f'{{ op = "rotary", heads = {HEADS}, to = "hf", pieces = [0] }}, '
            f'{{ op = "rotary", heads = {kv_heads}, to = "hf", pieces = [1] }}'
        )
    else:  # one rotary on both pieces: q and k share the head size
        rot = f'{{ op = "rotary", head_dim = {HD}, to = "hf", pieces = [0, 1] }}'
    targets = ", ".join(f'"{t}"' for t in QKV)
    return f"""
same_names = true
[[rule]]
source = "{FUSED}"
target = [{targets}]
transforms = [{{ op = "split", axis = 0, sizes = [{HIDDEN}, {kv}, {kv}] }}, {rot}]
"""


def hf_to_meta_row(row: int, d: int) -> int:
    """Where HF row ``row`` of a head-major projection lies in Meta's order (by hand)."""
    h, within = divmod(row, d)
    r, m = divmod(within, d // 2)
    return h * d + 2 * m + r


@pytest.fixture(scope="module", params=[HEADS, 2], ids=["mha", "gqa"])
def model(request):
    kv_heads = request.param
    hf = llama(kv_heads)
    return kv_heads, hf, fused_meta(hf, kv_heads)


def test_fused_meta_qkv_maps_onto_hf_bit_for_bit(model) -> None:
    kv_heads, hf, meta = model
    for per_piece in (False, True):
        df = dmlib.compare(meta, hf, mapping=loads(hand_map(kv_heads, per_piece)))
        assert summarize(df)["identical"] and len(df) == len(hf)
    # v does not take the permutation: putting it on piece 2 as well is a difference
    wrong = loads(hand_map(kv_heads).replace("pieces = [0, 1]", "pieces = [0, 1, 2]"))
    bad = dmlib.compare(meta, hf, mapping=wrong)
    assert set(bad[bad.n_diff > 0]["name"]) == {QKV[2].format(i=i) for i in range(LAYERS)}


@pytest.mark.parametrize("piece", [0, 1, 2])
def test_one_ulp_found_at_its_exact_source_and_target(model, piece) -> None:
    kv_heads, hf, meta = model
    kv = kv_heads * HD
    name = QKV[piece].format(i=1)
    row, col = (HD + 3, 5) if piece == 0 else (HD + 6, 1)  # head 1 of q, or of k / v
    changed = dict(hf)
    w = hf[name].copy()
    w[row, col] = np.nextafter(w[row, col], np.float32(np.inf))
    changed[name] = w
    df = dmlib.compare(meta, changed, mapping=loads(hand_map(kv_heads))).set_index("name")
    got = df.loc[name]
    assert got["n_diff"] == 1 and got["max_ulp"] == 1
    # by hand: q rows then k rows (both in Meta's order), then v rows as they are
    src_row = {
        0: hf_to_meta_row(row, HD),
        1: HIDDEN + hf_to_meta_row(row, HD),
        2: HIDDEN + kv + row,
    }[piece]
    assert got["first_diff_target"] == f"{name}[{row}, {col}]"
    assert got["first_diff_source"] == f"{FUSED.format(i=1)}[{src_row}, {col}]"
    assert (df.drop(index=name)["n_diff"] == 0).all()


def test_suggest_finds_the_rotary_on_q_and_k_only(model) -> None:
    kv_heads, hf, meta = model
    s = suggest(meta, hf)
    assert s.unplaced_a == [] and s.unplaced_b == []
    fused = [r for r in s.mapping.rules if any("wqkv" in x for x in r.sources)]
    assert len(fused) == 1
    kv = kv_heads * HD
    split = "parts=3" if kv == HIDDEN else f"sizes=[{HIDDEN}, {kv}, {kv}]"
    assert describe_chain(fused[0].ops) == (
        f"split(axis=0, {split}) | rotary(head_dim={HD}, to=hf, pieces=[0, 1])"
    )
    assert list(fused[0].targets) == QKV
    again = loads(to_toml(s.mapping))  # written out and read back
    assert summarize(dmlib.compare(meta, hf, mapping=again))["identical"]


def test_source_index_through_a_piece_rotary() -> None:
    # 2 heads of 4 rows for q, 1 head for k, 4 rows of v; every element is its own number
    fused = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
    src = ArrayTensorSet({"qkv": fused})
    m = loads(
        """
[[rule]]
source = "qkv"
target = ["q", "k", "v"]
transforms = [{ op = "split", axis = 0, sizes = [8, 2, 2] }, { op = "rotary", head_dim = 2, to = "hf", pieces = [0, 1] }]
"""
    )
    m4 = loads(
        """
[[rule]]
source = "qkv"
target = ["q", "k", "v"]
transforms = [{ op = "split", axis = 0, sizes = [4, 4, 4] }, { op = "rotary", head_dim = 4, to = "hf", pieces = [0, 1] }]
"""
    )
    view = mapped_set(src, m4, ["q", "k", "v"])
    # HF row 1 of a 4-row head is Meta row 2 (m = 1, r = 0); HF row 2 is Meta row 1
    assert view["k"].load()[1].tolist() == fused[4 + 2].tolist()
    assert source_index(view, "k", (1, 2)) == ("qkv", (6, 2))
    assert source_index(view, "q", (2, 0)) == ("qkv", (1, 0))
    assert source_index(view, "v", (3, 1)) == ("qkv", (11, 1))
    # head_dim 2: a head of two rows is its own rotary order
    view2 = mapped_set(src, m, ["q", "k", "v"])
    assert source_index(view2, "q", (5, 1)) == ("qkv", (5, 1))


def test_piece_rotary_refusals() -> None:
    src = ArrayTensorSet({"qkv": np.zeros((12, 2), np.float32)})
    base = '[[rule]]\nsource = "qkv"\ntarget = ["q", "k", "v"]\ntransforms = [{{ op = "split", axis = 0, parts = 3 }}, {rot}]\n'
    bad_piece = loads(base.format(rot='{ op = "rotary", head_dim = 2, to = "hf", pieces = [3] }'))
    with pytest.raises(DmlibError, match="piece 3 does not exist, the chain holds 3"):
        mapped_set(src, bad_piece, ["q", "k", "v"])
    for rot, msg in (
        (
            '{ op = "rotary", heads = 2, head_dim = 2, to = "hf" }',
            "exactly one of heads or head_dim",
        ),
        ('{ op = "rotary", to = "hf" }', "exactly one of heads or head_dim"),
        ('{ op = "rotary", head_dim = 2, to = "hf", pieces = [-1] }', "distinct positions"),
        ('{ op = "rotary", head_dim = 2, to = "hf", pieces = [0, 0] }', "distinct positions"),
        ('{ op = "rotary", head_dim = 3, to = "hf" }', None),
    ):
        if msg is None:  # an odd head size is refused when the shapes are known
            with pytest.raises(DmlibError, match="head_dim 3"):
                mapped_set(src, loads(base.format(rot=rot)), ["q", "k", "v"])
            continue
        with pytest.raises(DmlibError, match=msg):
            loads(base.format(rot=rot))


def test_ladder_locates_a_difference_in_the_source(model, tmp_path: Path) -> None:
    kv_heads, hf, meta = model
    name = QKV[1].format(i=0)
    row, col = 3, 7  # in k, head 0
    hf20 = {k: v * np.float32(2) for k, v in hf.items()}
    meta20 = fused_meta(hf20, kv_heads)
    hf20[name] = hf20[name].copy()
    hf20[name][row, col] = np.nextafter(hf20[name][row, col], np.float32(-np.inf))
    ladder = {"hf": {10: hf, 20: hf20}, "meta": {10: meta, 20: meta20}}
    df = dmlib.step_ladder(ladder, reference="hf", mapping={"meta": loads(hand_map(kv_heads))})
    assert (df[df.step == 10]["n_diff"] == 0).all()
    assert df[df.n_diff > 0][["step", "name"]].values.tolist() == [[20, name]]
    # HF row 3 of a head of 8: r = 0, m = 3 -> Meta row 6; k's rows start after q's
    assert hf_to_meta_row(row, HD) == 6
    assert df.attrs["located"] == [
        {
            "step": 20,
            "pair": "hf/meta",
            "name": name,
            "target": f"{name}[{row}, {col}]",
            "source_b": f"{FUSED.format(i=0)}[{HIDDEN + 6}, {col}]",
        }
    ]


def test_ladder_without_a_mapping_locates_nothing() -> None:
    a = {"w": np.ones((2, 2), np.float32)}
    b = {"w": np.full((2, 2), 2, np.float32)}
    df = dmlib.step_ladder({"x": {1: a}, "y": {1: b}})
    assert df.attrs["located"] == []
