"""generate() of a PEFT LoRA model captured pass by pass, as the model it wraps is.

A PEFT model's ``generate()`` never runs its own forward: it calls its base model's
``generate()``, which runs the base model's forward (``base_model.model``) once per pass.
The capture numbers those passes all the same. Tiny random-init Qwen2 and Llama from their
configs, LoRA on q/k/v/o with every factor given values. The oracles are plain torch hooks
(the passes the base model's forward ran, the rows and cache states it produced) and
generate()'s own output; a difference is planted (+1 ULP on one LoRA factor's output in
one decode pass, through a hook), never left to this CPU.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import dmlib  # noqa: E402
from dmlib.errors import CaptureError  # noqa: E402
from dmlib.localize.boundaries import compare_captures  # noqa: E402
from dmlib.localize.hf import capture_generate, row_map_from_attention_mask  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")

PREFIX = "base_model.model."  # where a PEFT model holds the model it wraps
Q = PREFIX + "model.layers.0.self_attn.q_proj"
LORA_B = Q + ".lora_B.default"
K = PREFIX + "model.layers.0.self_attn.k_proj"
#: the same modules in a PEFT model and in the model it wraps (default modules differ: a
#: root's children are hooked, and the roots' children are not the same modules)
MODULES = ["*.layers.?", "*.self_attn.?_proj", "*.lora_?.default", "*.norm", "*lm_head"]
NEW = 4  # tokens generated: the prefill, then NEW - 1 decode passes
PAD = 2  # the probe's prompt is left-padded by this much
IDS = [[0, 0, 5, 6, 7], [1, 2, 3, 4, 9]]
MASK = [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]


def _peft(family="qwen2", task_type="CAUSAL_LM"):
    torch.manual_seed(0)
    size = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
            "eos_token_id": None, "bos_token_id": None, "pad_token_id": 0}  # fmt: skip
    if family == "qwen2":
        base = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**size))
    else:
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**size))
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type=task_type,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    m = peft.get_peft_model(base.eval(), lora)
    with torch.no_grad():  # B is zero at init: give every LoRA factor values
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    return m.eval()


def _generate(model, path, **capture_kw):
    """capture_generate over the probe (3 prompt tokens, left-padded) and another request;
    returns the output and how many forwards the base model and the PEFT model itself ran
    (plain pre-hooks, the oracle)."""
    ids, mask = torch.tensor(IDS), torch.tensor(MASK)
    forwards = {"base": 0, "peft": 0}
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model

    def counter(key):
        def hook(mod, args):
            forwards[key] += 1

        return hook

    handles = [inner.register_forward_pre_hook(counter("base"))]
    if inner is not model:
        handles.append(model.register_forward_pre_hook(counter("peft")))
    kw = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": NEW, "do_sample": False,
          "pad_token_id": 0}  # fmt: skip
    rm = row_map_from_attention_mask(mask, ["probe", "other"])
    try:
        with torch.no_grad():
            out = capture_generate(model, path, row_map=rm, generate_kwargs=kw,
                                   **{"block_rows": 1, **capture_kw})  # fmt: skip
    finally:
        for h in handles:
            h.remove()
    return out, forwards


def _by_hand(passes):
    """pass_rows worked out by hand: pass 0 names each row's last prompt position; decode
    pass s computes position P + s - 1 of the request filling the row (P: its prompt's
    length without padding: the probe 3, the other 5)."""
    table = {"0": [["probe", 2], ["other", 4]]}
    for s in range(1, passes):
        table[str(s)] = [["probe", 2 + s], ["other", 4 + s]]
    return table


def _structure(path, prefix=""):
    """(boundary name without ``prefix``, step) of every boundary of a capture."""
    c = dmlib.open_capture(path)
    return {(b.name.removeprefix(prefix), b.step) for b in c.boundaries}


@pytest.mark.parametrize(
    ("family", "task_type"), [("qwen2", "CAUSAL_LM"), ("llama", "CAUSAL_LM"), ("qwen2", None)]
)
def test_one_step_per_pass_as_on_the_unwrapped_model(tmp_path, family, task_type):
    model = _peft(family, task_type)
    out, forwards = _generate(model, tmp_path / "peft", modules=MODULES)
    # the oracle: generate() ran the base model's forward once per token, never the wrapper's
    made = out.shape[1] - len(IDS[0])
    assert made == NEW and forwards == {"base": NEW, "peft": 0}
    c = dmlib.open_capture(tmp_path / "peft")
    assert c.metadata["generate"]["passes"] == NEW
    assert c.metadata["pass_rows"] == _by_hand(NEW)
    steps = {b.step for b in c.boundaries}
    assert steps == set(range(NEW))
    # a LoRA factor runs once per pass: its n-th call is recorded in pass n
    lora = [b for b in c.boundaries if b.module == LORA_B and b.kind == "output"]
    assert [(b.call, b.step) for b in lora] == [(s, s) for s in range(NEW)]
    # the same modules unwrapped (the model the PEFT model wraps, LoRA layers and all)
    out_u, forwards_u = _generate(model.get_base_model(), tmp_path / "unwrapped", modules=MODULES)
    assert torch.equal(out_u, out) and forwards_u["base"] == NEW
    u = dmlib.open_capture(tmp_path / "unwrapped")
    assert u.metadata["pass_rows"] == c.metadata["pass_rows"]
    assert u.metadata["generate"]["tokens"] == c.metadata["generate"]["tokens"]
    assert _structure(tmp_path / "peft", PREFIX) == _structure(tmp_path / "unwrapped")
    # and merged into the base weights: another model, the same passes and rows
    merged = copy.deepcopy(model).merge_and_unload()
    out_m, forwards_m = _generate(merged, tmp_path / "merged")
    assert forwards_m["base"] == NEW == out_m.shape[1] - len(IDS[0])
    assert dmlib.open_capture(tmp_path / "merged").metadata["pass_rows"] == _by_hand(NEW)


def _rowwise(mod):
    """``mod`` (a Linear) computes each row by its own call: a row's value does not depend
    on how many rows share the pass, by construction."""
    f = torch.nn.functional.linear

    def forward(x):
        rows = [f(r, mod.weight, mod.bias) for r in x.reshape(-1, x.shape[-1])]
        return torch.stack(rows).reshape(*x.shape[:-1], mod.out_features)

    mod.forward = forward


def _sample(model, path, plant_step=None):
    """The sampler: capture_generate of the PEFT model; +1 ULP planted in the probe's row
    of lora_B's output at pass ``plant_step``. Returns the probe's full sequence and
    lora_B's (input, output) per pass (plain hooks)."""
    lora_b = model.get_submodule(LORA_B)
    calls, seen = [0], []

    def plant(mod, args, out):
        k = calls[0]
        calls[0] += 1
        if k != plant_step:
            return None
        out = out.clone()
        out[0, -1, 0] = torch.nextafter(out[0, -1, 0], torch.tensor(float("inf")))
        return out

    handles = [lora_b.register_forward_hook(plant)]  # first: the capture sees the plant
    handles.append(lora_b.register_forward_hook(
        lambda m, a, o: seen.append((a[0].detach().clone(), o.detach().clone()))))  # fmt: skip
    try:
        out, _ = _generate(model, path)
    finally:
        for h in handles:
            h.remove()
    return out[0, PAD:], seen


def _train(model, path, seq):
    """The trainer: the probe's full sequence in one full forward of the PEFT model."""
    seen = []
    h = model.get_submodule(LORA_B).register_forward_hook(
        lambda m, a, o: seen.append((a[0].detach().clone(), o.detach().clone())))  # fmt: skip
    rm = [[("probe", j) for j in range(len(seq))]]
    try:
        with torch.no_grad(), dmlib.capture(model, path, row_map=rm, block_rows=1):
            model(input_ids=seq[None])
    finally:
        h.remove()
    return seen[0]


def _oracle(trainer, sampler, which=1):
    """Per pass: {position: the probe's rows equal}, by hand (``which``: 0 inputs, 1 outputs)."""
    t = trainer[which][0]
    prompt = len(IDS[0]) - PAD
    out = {0: {p: torch.equal(t[p], sampler[0][which][0, PAD + p]) for p in range(prompt)}}
    for s in range(1, len(sampler)):
        out[s] = {prompt - 1 + s: torch.equal(t[prompt - 1 + s], sampler[s][which][0, 0])}
    return out


def test_a_planted_decode_pass_of_a_lora_factor_found_at_its_position(tmp_path):
    model = _peft()
    _rowwise(model.get_submodule(LORA_B))
    step = 2  # the second decode pass computes the probe's position prompt + 1
    pos = len(IDS[0]) - PAD - 1 + step
    seq0, clean = _sample(model, tmp_path / "s0")
    seq, planted = _sample(model, tmp_path / "s", plant_step=step)
    assert torch.equal(seq0, seq)  # the plant moved no token: one trainer serves both
    assert len(planted) == NEW and not torch.equal(planted[step][1], clean[step][1])
    trainer = _train(model, tmp_path / "t", seq)
    oracle, oracle0 = _oracle(trainer, planted), _oracle(trainer, clean)
    assert oracle[step][pos] is False  # the planted row differs from the trainer's
    df0 = compare_captures(tmp_path / "t", tmp_path / "s0", request="probe")
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="probe")
    for frame, by_pass in ((df0, oracle0), (df, oracle)):
        rows = frame[(frame["module"] == LORA_B) & (frame["kind"] == "output")]
        rows = rows.set_index("boundary")
        assert len(rows) == NEW  # the prefill and each decode pass, each its own
        for s, by_pos in by_pass.items():
            name = LORA_B if s == 0 else f"{LORA_B}#{s}"
            assert bool(rows.loc[name, "identical"]) == all(by_pos.values())
            assert (rows.loc[name, "diff_positions"] or []) == [
                p for p, v in by_pos.items() if not v
            ]
    hit = df.set_index("boundary").loc[f"{LORA_B}#{step}"]
    assert hit["diff_positions"] == [pos]
    if _oracle(trainer, planted, which=0)[step][pos]:  # its input row equal: it is the culprit
        assert hit["role"] == "culprit"
    # what differs with the plant and not without it begins at the planted pass's lora_B
    differs0 = set(df0["boundary"][df0["identical"].eq(False).fillna(False)])
    new = [b for b in df["boundary"][df["identical"].eq(False).fillna(False)] if b not in differs0]
    assert new[0] == f"{LORA_B}#{step}"
    assert df.attrs["status"] == "different"
    if df0.attrs["first_divergent_boundary"] is None:  # nothing else differs: the plant is first
        first = df.attrs["first_divergent_position"]
        assert first["boundary"] == f"{LORA_B}#{step}"
        assert first["step"] == step and first["positions"] == [pos]


def _states(model, path, plant_step=None):
    """capture_generate of the PEFT model; returns, per pass, the keys and values of each
    layer of the DynamicCache its base model's forward returned (a plain hook's copies).
    +1 ULP planted in the probe's row of layer 0's k_proj output at pass ``plant_step``."""
    calls, copies = [0], []

    def plant(mod, args, out):
        calls[0] += 1
        if calls[0] - 1 != plant_step:
            return None
        out = out.clone()
        out[0, -1, 0] = torch.nextafter(out[0, -1, 0], torch.tensor(float("inf")))
        return out

    def keep(mod, args, kwargs, out):
        layers = out.past_key_values.layers
        copies.append([{"keys": x.keys.clone(), "values": x.values.clone()} for x in layers])

    handles = [model.get_submodule(K).register_forward_hook(plant),
               model.get_base_model().register_forward_hook(keep, with_kwargs=True)]  # fmt: skip
    try:
        _generate(model, path)
    finally:
        for h in handles:
            h.remove()
    return copies


def test_the_cache_states_recorded_per_pass(tmp_path):
    """Each pass's DynamicCache keys and values are recorded in that pass, with the shape
    the base model's forward left them in; two runs' states judged per request as the
    oracle judges them (torch.equal of the request's cache rows, plain hooks' copies)."""
    model = _peft()
    step = 2
    clean = _states(model, tmp_path / "s0")
    planted = _states(model, tmp_path / "s", plant_step=step)
    assert len(clean) == len(planted) == NEW
    c = dmlib.open_capture(tmp_path / "s")
    assert len([b for b in c.boundaries if b.state]) == NEW * 2 * 2  # keys, values, 2 layers
    slots = {"probe": (0, PAD), "other": (1, 0)}  # batch row, first slot that is no padding
    oracle = {}
    for s, layers in enumerate(planted):
        for i, kinds in enumerate(layers):
            for what, t in kinds.items():
                name = f"(model):state.layers.{i}.{what}" + (f"#{s}" if s else "")
                assert c.boundary(name).step == s
                assert tuple(c.boundary(name).shape) == tuple(t.shape)
                assert t.shape[2] == len(IDS[0]) + s  # the cache grows by one per pass
                for r, (row, first) in slots.items():
                    same = torch.equal(t[row, :, first:], clean[s][i][what][row, :, first:])
                    oracle[name, r] = same
    assert oracle[f"(model):state.layers.0.keys#{step}", "probe"] is False  # the plant, seen
    for r in slots:
        df = compare_captures(tmp_path / "s0", tmp_path / "s", request=r).set_index("boundary")
        for (name, req), same in oracle.items():
            if req == r:
                assert bool(df.loc[name, "identical"]) == same, (name, r)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated")  # (torch's import)
def test_a_compiled_wrapper_is_numbered_pass_by_pass(tmp_path):
    """torch.compile's wrapper hands generate() to the module it wraps (whose forward
    each pass runs): the passes are numbered all the same."""
    model = _peft()
    compiled = torch.compile(model)
    out, forwards = _generate(compiled, tmp_path / "c")
    assert forwards["base"] == NEW == out.shape[1] - len(IDS[0])
    c = dmlib.open_capture(tmp_path / "c")
    assert c.metadata["generate"]["passes"] == NEW
    assert c.metadata["pass_rows"] == _by_hand(NEW)


class _OwnLoop(torch.nn.Module):
    """A generate() of its own running the backbone and the head, no pass module's forward."""

    def __init__(self, lm):
        super().__init__()
        self.backbone, self.head = lm.model, lm.lm_head

    def generate(self, input_ids, max_new_tokens, **kw):
        seq = input_ids
        for _ in range(max_new_tokens):
            logits = self.head(self.backbone(input_ids=seq).last_hidden_state)
            seq = torch.cat([seq, logits[:, -1:].argmax(-1)], 1)
        return seq


def test_passes_not_seen_are_refused_not_numbered_wrong(tmp_path):
    model = _OwnLoop(_peft().merge_and_unload())
    ids = torch.tensor([IDS[1]])
    with torch.no_grad(), pytest.raises(CaptureError, match=f"chose {NEW} tokens per row"):
        capture_generate(model, tmp_path / "c", row_map=[[("p", j) for j in range(5)]],
                         generate_kwargs={"input_ids": ids, "max_new_tokens": NEW})  # fmt: skip
    with pytest.raises(CaptureError, match="incomplete"):
        dmlib.open_capture(tmp_path / "c")


def test_a_plain_forward_and_backward_of_the_peft_model(tmp_path):
    """The PEFT model handed to dmlib.capture is the root: hooked where "" is asked for, its
    logits captured; its forward, running the base model's inside, is one pass."""
    model = _peft()
    ids = torch.tensor([IDS[1]])
    rm = [[("p", j) for j in range(5)]]
    mods = ["", "*.layers.*.self_attn.*_proj", "*lm_head"]
    with torch.no_grad(), dmlib.capture(model, tmp_path / "root", row_map=rm, modules=mods):
        for _ in range(2):
            model(input_ids=ids)
    c = dmlib.open_capture(tmp_path / "root")
    assert c.coverage["root_hooked"] is True and c.not_captured == []
    out = [b for b in c.boundaries if b.module == c.root and b.kind == "output" and not b.state]
    assert [(b.slot, b.step) for b in out] == [("output0.logits", 0), ("output0.logits", 1)]
    with torch.no_grad(), dmlib.capture(model, tmp_path / "q", row_map=rm, modules=mods[1]):
        model(input_ids=ids)
    c = dmlib.open_capture(tmp_path / "q")  # the root not hooked: its logits listed as unseen
    assert c.coverage["root_hooked"] is False
    assert [u["what"] for u in c.not_captured] == [f"{c.root}:output0.logits"]
    # backward: the LoRA factors' gradients in the one pass
    calls = []
    h = model.get_submodule(LORA_B).register_full_backward_hook(lambda m, gi, go: calls.append(1))
    try:
        with dmlib.capture(model, tmp_path / "b", row_map=rm, modules=mods[1:] + ["*.lora_B.*"],
                           backward=True) as rec:  # fmt: skip
            rec.backward(model(input_ids=ids).logits)
    finally:
        h.remove()
    c = dmlib.open_capture(tmp_path / "b")
    assert {b.step for b in c.boundaries} == {0}
    grads = [b for b in c.boundaries if b.module == LORA_B and b.slot.startswith("grad_output")]
    assert len(grads) == len(calls) == 1


def test_what_generate_ran_and_no_module_captured_is_listed(tmp_path):
    """The model itself hooked ("") but generate() never runs its forward: the outputs of
    the forward it ran (the base model's) are listed as not captured where no hooked
    module returned them, and not where lm_head did (the logits are its output)."""
    model = _peft()
    _generate(model, tmp_path / "a", modules=["", "*.layers.?"])
    a = dmlib.open_capture(tmp_path / "a")
    assert a.coverage["root_hooked"] is True
    assert not [b for b in a.boundaries if b.module == a.root and not b.state]  # never ran
    unseen = {u["what"]: u["reason"] for u in a.not_captured}
    assert list(unseen) == ["base_model.model:output0.logits"]
    assert "modules did not include 'base_model.model'" in unseen["base_model.model:output0.logits"]
    _generate(model, tmp_path / "b", modules=["*.layers.?", "*lm_head"])
    assert dmlib.open_capture(tmp_path / "b").not_captured == []
