"""A long ``generate()`` capture: the work of each pass does not grow with the passes before
it, and the state a pass leaves behind is still hashed whole after every pass.

Tiny random-init models from their configs: a Llama for the pass hook's walk, a float32
``Qwen3NextForCausalLM`` (3 Gated DeltaNet layers on the torch fallback, 1 attention
layer) for the states. Differences are planted (+1 ULP through a forward hook on the
model, in place, after a late pass), never left to this CPU. The oracle walks the cache
by hand after every pass (each layer's ``conv_states``/``recurrent_states`` and
``keys``/``values``, copied) and compares the two runs with ``torch.equal``; the work per
pass is counted against plain forward hooks on the same modules.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
xxhash = pytest.importorskip("xxhash")

import dmlib.localize.capture.hooks as hooks  # noqa: E402
from dmlib.localize.boundaries import compare_captures  # noqa: E402
from dmlib.localize.capture import capture, open_capture  # noqa: E402
from dmlib.localize.capture.tensors import default_modules  # noqa: E402
from dmlib.localize.hf import capture_generate, row_map_from_attention_mask  # noqa: E402

VOCAB = 64


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128,
                                   pad_token_id=0)  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


def hybrid():
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    assert cfg.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    return transformers.Qwen3NextForCausalLM(cfg).eval()


def prompt(n: int = 8):
    ids = torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(3))
    return ids, torch.ones_like(ids)


class Counting(list):
    """A list that counts the items handed out by iterating it."""

    visited = 0

    def __iter__(self):
        for x in list.__iter__(self):
            self.visited += 1
            yield x


def test_the_pass_hook_walks_only_this_pass_outputs(tmp_path, monkeypatch):
    """Root not hooked: after each pass the hook looks for the model's outputs among the
    boundaries recorded. Over 32 decode passes it visits as many entries each pass (the
    tensors the hooked modules output in that pass, by plain hooks), not all passes' so far."""
    model = llama()
    ids, mask = prompt()
    mods = default_modules(model)
    outputs: list[set[int]] = []  # the oracle: distinct output tensors per pass
    live: list = []  # (kept alive for the pass, as the recorder's weak references see them)

    def count(mod, args, out):
        seq = out if isinstance(out, tuple) else (out,)
        for t in seq:
            if torch.is_tensor(t):
                outputs[-1].add(id(t))
                live.append(t)

    def new_pass(mod, args):
        outputs.append(set())
        live.clear()

    named = dict(model.named_modules())
    handles = [model.register_forward_pre_hook(new_pass)]
    handles += [named[m].register_forward_hook(count) for m in mods]
    visits: list[int] = []
    original = hooks._recorded

    def counted(rec):
        saved, rec.pass_outputs = rec.pass_outputs, Counting(rec.pass_outputs)
        try:
            return original(rec)
        finally:
            visits.append(rec.pass_outputs.visited)
            rec.pass_outputs = saved

    monkeypatch.setattr(hooks, "_recorded", counted)
    gen = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 33, "min_new_tokens": 33,
           "do_sample": False}  # fmt: skip
    try:
        capture_generate(model, tmp_path / "c", row_map=row_map_from_attention_mask(mask),
                         generate_kwargs=gen)  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    assert len(visits) == len(outputs) == 33
    decode = visits[1:]
    assert len(set(decode)) == 1 and decode[0] > 0  # the same work in pass 1 and pass 32
    assert decode == [len(s) for s in outputs[1:]]
    assert visits[0] == len(outputs[0])
    # the logits are lm_head's output: found among them, so nothing is listed as not captured
    assert open_capture(tmp_path / "c").coverage["not_captured"] == []


def walk_cache(cache) -> dict[str, torch.Tensor]:
    """The oracle's copy of every state in a Qwen3-Next cache, walked by hand."""
    states = {}
    for i, layer in enumerate(cache.layers):
        for part in ("conv_states", "recurrent_states"):
            if isinstance(getattr(layer, part, None), dict):
                states[f"layers.{i}.{part}.0"] = getattr(layer, part)[0].clone()
        for part in ("keys", "values"):
            if torch.is_tensor(getattr(layer, part, None)):
                states[f"layers.{i}.{part}"] = getattr(layer, part).clone()
    return states


def one_ulp(x):
    """+1 ULP (one step of the bit pattern) in a float32 element, in place."""
    assert x.dtype == torch.float32 and x.numel() == 1
    x.view(torch.int32).add_(1)


LATE, NEW = 9, 12  # the pass planted in, the tokens generated (passes 0..11)
PLANTS = {
    "layers.0.recurrent_states.0": lambda c: one_ulp(c.layers[0].recurrent_states[0][0, 1, 2, 3:4]),
    # an early position (2, in the prompt) of the attention layer's keys, rewritten late
    "layers.3.keys": lambda c: one_ulp(c.layers[3].keys[0, 0, 2, 5:6]),
}


def generate(model, path, plant=None, device_path=False):
    """``generate()`` captured; returns the hand walk of the cache after each pass. With
    ``plant``, it first edits the cache after pass ``LATE`` (a plain hook registered
    before the capture's, so the capture sees the edit)."""
    ids, mask = prompt(12)
    walks: list[dict[str, torch.Tensor]] = []

    def hook(mod, args, kwargs, out):
        if plant is not None and len(walks) == LATE:
            plant(out.past_key_values)
        walks.append(walk_cache(out.past_key_values))

    h = model.register_forward_hook(hook, with_kwargs=True)
    gen = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": NEW, "min_new_tokens": NEW,
           "do_sample": False}  # fmt: skip
    try:
        with torch.no_grad(), capture(model, path, row_map=[[("p", j) for j in range(12)]]) as rec:
            rec._device_path_on_cpu = device_path  # the device's checksums, on this CPU
            model.generate(**gen)
    finally:
        h.remove()
    assert len(walks) == NEW
    return walks


def differing(a, b) -> list[set[str]]:
    """Per pass, the states whose bytes differ between the two hand walks."""
    return [{k for k in wa if not torch.equal(wa[k], wb[k])} for wa, wb in zip(a, b, strict=True)]


def dmlib_states(df, step: int) -> dict[str, bool | None]:
    """Pass ``step``'s state boundaries: path in the cache -> identical (None: not judged)."""
    out = {}
    for name, same in zip(df["boundary"], df["identical"], strict=True):
        if ":state." not in name:
            continue
        path, _, call = name.split(":state.", 1)[1].partition("#")
        if int(call or 0) == step:
            out[path] = None if same is pd_na() else bool(same)
    return out


def pd_na():
    import pandas as pd

    return pd.NA


@pytest.mark.parametrize("device_path", [False, True], ids=["host", "device-checksums"])
@pytest.mark.parametrize("planted", sorted(PLANTS))
def test_a_late_plant_in_a_state_is_seen_after_every_pass(tmp_path, planted, device_path):
    """+1 ULP in layer 0's recurrent state, or in the keys of prompt position 2, after pass
    9 of 12: every pass's states judged as the hand walk finds them (the planted one alone
    at pass 9; what it reaches after), so an old position rewritten is still seen."""
    model = hybrid()
    a = generate(model, tmp_path / "a", device_path=device_path)
    b = generate(model, tmp_path / "b", PLANTS[planted], device_path=device_path)
    expected = differing(a, b)
    assert expected[LATE] == {planted} and not any(expected[:LATE])  # the oracle: planted
    if planted == "layers.3.keys":
        assert all(planted in s for s in expected[LATE:])  # carried on by each pass's cat
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    for step in range(NEW):
        states = dmlib_states(df, step)
        assert set(states) == set(a[step])
        assert None not in states.values()
        assert {k for k, v in states.items() if v is False} == expected[step], step
    if device_path:
        c = open_capture(tmp_path / "b")
        assert {b.hash for b in c if b.state} == {"cksum4-v1"}


def test_state_digests_are_the_bytes_xxh3(tmp_path):
    """A state's digests, hashed on the recorder's path, are the XXH3-128 of its bytes whole
    and of each batch row (the ``xxh3-128-tree-v1`` leaf), by the xxhash package itself."""
    model = hybrid()
    walks = generate(model, tmp_path / "a")
    c = open_capture(tmp_path / "a")
    checked = 0
    for b in c:
        if not b.state or "keys" in b.name or "values" in b.name:
            continue
        path, _, call = b.name.split(":state.", 1)[1].partition("#")
        t = walks[int(call or 0)][path].contiguous().numpy()
        assert b.digest == xxhash.xxh3_128_hexdigest(t.tobytes())
        assert list(b.leading) == [xxhash.xxh3_128_hexdigest(r.tobytes()) for r in t]
        checked += 1
    assert checked == NEW * 6  # 3 linear-attention layers x (conv, recurrent) x 12 passes


def test_a_long_generation_keeps_a_bounded_number_of_cache_row_plans(tmp_path):
    """The rows of a KV cache of each length are worked out once per length; a long
    generate() meets a new length every pass, and what the capture keeps of them stays a
    few plans (not one per pass: batch x steps^2 / 2 rows by the end)."""
    model = llama()
    ids, mask = prompt()
    gen = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 48, "min_new_tokens": 48,
           "do_sample": False}  # fmt: skip
    with torch.no_grad(), capture(model, tmp_path / "c", row_map=[[("p", j) for j in range(8)]],
                                  modules=default_modules(model)) as rec:  # fmt: skip
        model.generate(**gen)
        kept = [p for p in [*rec.row_map._memo.values(), *rec._cache_plans.values()] if p]
    lengths = sorted(len(p[0]) for p in kept)
    # the last pass (47: the 48th token is not fed back) leaves 8 + 47 positions, 1 row
    assert lengths and max(lengths) == 8 + 47
    assert len(rec._cache_plans) <= 4
    assert sum(lengths) <= 36 * 55  # at most 32 + 4 plans, each of at most 55 rows


def test_the_rows_of_a_longer_cache_by_hand(tmp_path):
    """A cache of 5 positions after a prompt of 3 in a batch of 2: row 0 is request a
    (left-padded by one), row 1 holds b and c packed. By hand: a's prompt rows 1, 2 and its
    generated rows 3, 4 (row 0 is a's alone); b's rows 5, 6 and c's 7 (row 1 is shared, so
    nothing generated is theirs). The same from the general loop the fast path stands in for."""
    from dmlib.localize.capture.recorder import Recorder
    from dmlib.localize.capture.rowmap import RowMap

    nested = [[None, ("a", 0), ("a", 1)], [("b", 0), ("b", 1), ("c", 0)]]
    rec = Recorder(tmp_path / "c", row_map=RowMap(nested))
    rows, requests = rec._cache_rows_of((2, 1, 5, 4))
    assert len(rows) == 10
    assert requests == {"a": [1, 2, 3, 4], "b": [5, 6], "c": [7]}
    assert list(requests) == ["a", "b", "c"]  # the manifest's order: first appearance
    slow = Recorder(tmp_path / "d", row_map=RowMap(nested))
    slow._decode_layouts[(2, 3)] = None  # the general loop
    assert slow._cache_rows_of((2, 1, 5, 4))[1] == requests
    # a request filling two rows alone: generated positions in both, left to the general loop
    two = [[("a", 0), ("a", 1)], [("a", 2), ("a", 3)]]
    rec2 = Recorder(tmp_path / "e", row_map=RowMap(two))
    assert rec2._decode_layout(2, 2) is None
    rows, requests = rec2._cache_rows_of((2, 1, 3, 4))
    assert requests == {"a": [0, 1, 3, 4, 2, 5]}  # positions 0-3, then 4 (row 0), 4 (row 1)


class _Layer:
    def __init__(self) -> None:
        self.recurrent = torch.zeros(2, 4)


class _Cache:
    def __init__(self) -> None:
        self.layers = [_Layer()]


class _Toy(torch.nn.Module):
    """A model whose cache holds one state, written in place on even passes only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cache = _Cache()

    def forward(self, x, step):
        if step % 2 == 0:
            self.cache.layers[0].recurrent.add_(0.5)
        return {"logits": self.lin(x), "past_key_values": self.cache}


def test_a_state_unchanged_since_its_last_pass_shares_its_digests(tmp_path, monkeypatch):
    """A state tensor recorded at the same version is not hashed again (its digests
    shared); one written in place since (a new version) is: hashed on passes 0 and 2, shared
    on 1 and 3, and every pass's digests equal xxhash's of the bytes copied by hand."""
    from dmlib.localize.capture.recorder import Recorder

    hashed: list[int] = []
    digest = Recorder._digest

    def counted(self, entry, t, k, axes):
        if entry.get("state"):
            hashed.append(self.step)
        return digest(self, entry, t, k, axes)

    monkeypatch.setattr(Recorder, "_digest", counted)
    model = _Toy().eval()
    copies = []
    h = model.register_forward_hook(
        lambda mod, args, out: copies.append(out["past_key_values"].layers[0].recurrent.clone())
    )
    try:
        with torch.no_grad(), capture(model, tmp_path / "c", row_map=[[("a", 0)], [("b", 0)]]):
            for step in range(4):
                model(torch.ones(2, 1, 4), step)
    finally:
        h.remove()
    assert hashed == [0, 2]
    states = [b for b in open_capture(tmp_path / "c") if b.state]
    assert len(states) == 4
    for b, x in zip(states, copies, strict=True):
        assert b.digest == xxhash.xxh3_128_hexdigest(x.numpy().tobytes())
        assert list(b.leading) == [xxhash.xxh3_128_hexdigest(r.tobytes()) for r in x.numpy()]
    assert states[0].digest == states[1].digest != states[2].digest == states[3].digest
