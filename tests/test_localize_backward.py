"""The backward in the capture: gradient boundaries against plain torch autograd, a planted
1-ULP change in one module's grad_input found there, micro-batches accumulated."""

from __future__ import annotations

import fnmatch
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import dmlib  # noqa: E402
from dmlib.localize.boundaries import compare_captures  # noqa: E402
from dmlib.localize.culprits import CaptureVerdict  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),  # (the oracle's hooks)
]

O_PROJ = "base_model.model.model.layers.0.self_attn.o_proj"
MODULES = ("*.layers.*.self_attn.*_proj", "*.layers.*.mlp", "*.layers.?", "*.norm", "*lm_head")


def _model():
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    m = transformers.Qwen2ForCausalLM(cfg).float()
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    m = peft.get_peft_model(m, lora)
    with torch.no_grad():  # B is zero at init: give every LoRA factor values
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    return m


IDS = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
ROWS = [[("r0", j) for j in range(6)], [("r1", j) for j in range(6)]]


def _plant(m):
    """+1 ULP on the first element of o_proj's gradient w.r.t. its input (a hook)."""

    def hook(mod, grad_input, grad_output):
        g = grad_input[0].clone()
        flat = g.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(np.inf))
        return (g, *grad_input[1:])

    return m.get_submodule(O_PROJ).register_full_backward_hook(hook)


def _run(m, path, *, plant=False, seed=7, **kw):
    handle = _plant(m) if plant else None
    m.zero_grad(set_to_none=True)
    try:
        with dmlib.capture(m, path, modules=MODULES, row_map=ROWS, backward=True,
                           grad_seed=seed, overwrite=True, **kw) as rec:  # fmt: skip
            rec.backward(m(input_ids=IDS).logits)
    finally:
        if handle is not None:
            handle.remove()


def _same_hooks(m, got):
    """Plain full backward hooks on the modules the capture hooks, collecting clones.

    Full backward hooks put a node before and after each hooked module, and autograd sums
    the gradients of a tensor used by several of them in the order they arrive: in float32
    that order shows in the last bits, so the oracle hooks the same modules (and nothing
    of dmlib) to run the same backward graph."""
    names = [n for n, _ in m.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in MODULES)]
    handles = []
    for n in names:
        mod = m.get_submodule(n)

        def pre(mod, grad_output, n=n):
            got.setdefault(f"{n}:grad_output0", grad_output[0].clone())

        def post(mod, grad_input, grad_output, n=n):
            if grad_input[0] is not None:
                got.setdefault(f"{n}:grad_input0", grad_input[0].clone())

        handles += [mod.register_full_backward_pre_hook(pre), mod.register_full_backward_hook(post)]
    return handles


def _oracle(m, seed=7):
    """Plain autograd with plain hooks: module gradients and every parameter's .grad."""
    got = {}
    handles = _same_hooks(m, got)
    m.zero_grad(set_to_none=True)
    out = m(input_ids=IDS).logits
    g = torch.Generator().manual_seed(seed)
    out.backward(torch.randn(out.shape, generator=g, dtype=out.dtype))
    for h in handles:
        h.remove()
    got["params"] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    return got


def test_captured_gradients_equal_plain_autograd(tmp_path):
    m = _model()
    want = _oracle(m)
    _run(m, tmp_path / "a", dump=("*grad*",))
    c = dmlib.open_capture(tmp_path / "a")
    assert json.loads((tmp_path / "a" / "manifest.json").read_text())["metadata"]["backward"] == {
        "upstream": "randn", "grad_seed": 7, "draws": 1}  # fmt: skip
    gi, go = c.boundary(f"{O_PROJ}:grad_input0"), c.boundary(f"{O_PROJ}:grad_output0")
    assert gi.category.name == "grad_input" and go.category.name == "grad_output"
    grads = [b for b in c.boundaries if b.grad and b.slot in ("grad_input0", "grad_output0")]
    assert {b.name for b in grads} == set(want) - {"params"}
    for b in grads:
        assert np.array_equal(c.tensor(b), want[b.name].numpy()), b.name
    # per request like the forward: request r1's rows are batch row 1's
    assert np.array_equal(c.tensor(gi, "r1"), want[gi.name][1].numpy())
    assert np.array_equal(c.tensor(go, "r0"), want[go.name][0].numpy())
    params = [b for b in c.boundaries if b.param_grad]
    assert {b.module for b in params} == set(want["params"])  # only the LoRA factors
    for b in params:
        assert b.name == f"{b.module}:grad"
        assert np.array_equal(c.tensor(b), want["params"][b.module].numpy())
    # backward order: the head's gradient first, then down the layers, the grads last
    grads = [b for b in c.boundaries if b.grad]
    assert grads[0].name.endswith("lm_head:grad_output0")
    order = [b.name for b in c.boundaries]
    assert order.index(f"{O_PROJ}:grad_output0") < order.index(f"{O_PROJ}:grad_input0")
    assert order.index(grads[-1].name) < order.index(params[0].name)


def test_planted_ulp_in_one_grad_input_is_the_backward_culprit(tmp_path, capsys):
    m = _model()
    _run(m, tmp_path / "a")
    _run(m, tmp_path / "a2")
    _run(m, tmp_path / "b", plant=True)
    df = compare_captures(tmp_path / "a", tmp_path / "b", repeat=tmp_path / "a2")
    v = CaptureVerdict.of(df)
    assert v.first_divergent_boundary is None and v.culprit is None  # the forward matches
    assert v.status == "different" and not v
    bw = df.attrs["backward"]
    assert bw["first_divergent_boundary"] == f"{O_PROJ}:grad_input0"
    assert bw["culprit"] == f"{O_PROJ}:grad_input0"
    assert df.attrs["repeat_control"]["held"] and df.attrs["valid"]
    assert f"backward culprit (gradients in identical, gradient out differs): {O_PROJ}" in str(v)
    roles = dict(zip(df["boundary"], df["role"], strict=True))
    assert roles[f"{O_PROJ}:grad_output0"] == "clean"
    # what the planted gradient reaches later is a carrier (layer 0's q_proj, the factors)
    assert roles["base_model.model.model.layers.0.self_attn.q_proj:grad_output0"] == "carrier"
    assert roles["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight:grad"] == (
        "carrier"
    )
    # the command line: exit 1, the backward's lines apart from the forward's
    from dmlib.cli import main

    assert main(["localize", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out
    assert "forward: no divergent boundary" in out
    assert f"backward: first divergent boundary (backward order): {O_PROJ}:grad_input0" in out
    # the same run twice: identical, backward included
    same = CaptureVerdict.of(compare_captures(tmp_path / "a", tmp_path / "a2"))
    assert same.backward["status"] == "identical" and same.first_divergent_boundary is None
    assert same.status != "different", same.unjudged


def test_a_different_upstream_gradient_enters_at_the_head(tmp_path):
    m = _model()
    _run(m, tmp_path / "a", seed=7)
    _run(m, tmp_path / "b", seed=8)
    bw = compare_captures(tmp_path / "a", tmp_path / "b").attrs["backward"]
    assert bw["entry"] == "base_model.model.lm_head:grad_output0"
    assert bw["culprit"] is None


def test_micro_batches_accumulate_in_one_capture(tmp_path):
    m = _model()
    halves = (IDS[:1], IDS[1:])
    m.zero_grad(set_to_none=True)
    want = []
    handles = _same_hooks(m, {})
    for x in halves:  # the oracle: .grad after each backward, accumulated
        m(input_ids=x).logits.sum().backward()
        want.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    for h in handles:
        h.remove()
    m.zero_grad(set_to_none=True)
    with dmlib.capture(m, tmp_path / "c", modules=MODULES, backward=True,
                       dump=("*:grad*",)) as rec:  # fmt: skip
        for x in halves:
            rec.backward(m(input_ids=x).logits.sum())
    c = dmlib.open_capture(tmp_path / "c")
    for k in (0, 1):
        got = [b for b in c.boundaries if b.param_grad and b.call == k]
        assert {b.module for b in got} == set(want[k])
        for b in got:
            assert b.name == f"{b.module}:grad" + (f"#{k}" if k else "")
            assert np.array_equal(c.tensor(b), want[k][b.module].numpy())
    assert not torch.equal(want[0][b.module], want[1][b.module])  # accumulated, not equal
    # each micro-batch's module gradients are its own calls
    assert f"{O_PROJ}:grad_input0#1" in c and f"{O_PROJ}:grad_input0#2" not in c


def test_backward_settings_are_checked():
    with pytest.raises(dmlib.errors.CaptureError, match="grad_seed"):
        dmlib.CaptureOptions(grad_seed=-1)
    assert dmlib.CaptureOptions(backward=1, grad_seed=3).backward is True


def test_a_backward_only_one_side_recorded_is_never_identical(tmp_path):
    m = _model()
    _run(m, tmp_path / "a")
    m.zero_grad(set_to_none=True)
    with dmlib.capture(m, tmp_path / "f", modules=MODULES, row_map=ROWS) as _:
        m(input_ids=IDS).logits.sum().backward()  # a backward the capture does not record
    for x, y in (("a", "f"), ("f", "a")):
        df = compare_captures(tmp_path / x, tmp_path / y)
        assert df.attrs["first_divergent_boundary"] is None  # the forwards match
        assert df.attrs["backward"]["status"] == "inconclusive"
        assert df.attrs["status"] == "inconclusive"


class _Boom(Exception):
    pass


class _MaybeRaise(torch.autograd.Function):
    """Identity forward; its backward raises the given exception where one is given."""

    @staticmethod
    def forward(ctx, x, err):
        ctx.err = err
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.err is not None:
            raise ctx.err
        return g, None


class _Net(torch.nn.Module):
    """lin1 -> a step whose backward may raise -> lin2 (backward order: lin2, then lin1)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.lin1, self.lin2 = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x, err=None):
        return self.lin2(_MaybeRaise.apply(self.lin1(x), err))


X = torch.randn(2, 4, generator=torch.Generator().manual_seed(5))


def _failing_then_ok(m, backward):
    """A backward that raises partway (lin2's gradients made, lin1's not), then one that
    ends; returns the exception the first raised."""
    m.zero_grad(set_to_none=True)
    err = _Boom("planted failure")
    with pytest.raises(_Boom) as info:
        backward(m(X, err).sum())
    backward(m(X).sum())
    assert info.value is err  # the user's exception, unchanged
    return err


@pytest.mark.parametrize("how", ["rec.backward", "plain .backward()"])
def test_a_backward_that_raises_leaves_the_capture_consistent(tmp_path, how):
    m = _Net()
    _failing_then_ok(m, lambda out: out.backward())  # the oracle: plain torch
    want = {n: p.grad.clone() for n, p in m.named_parameters()}
    for side in ("a", "b"):
        with dmlib.capture(m, tmp_path / side, modules=("lin1", "lin2"), backward=True,
                           dump=("*:grad*",)) as rec:  # fmt: skip
            _failing_then_ok(m, rec.backward if how == "rec.backward" else lambda o: o.backward())
    c = dmlib.open_capture(tmp_path / "a")
    failed = c.metadata["backward"]["failed"]
    assert [f["pass"] for f in failed] == [0]
    if how == "rec.backward":  # seen as it went by; else at the next pass's first hook
        assert failed[0]["error"] == "_Boom: planted failure"
    # the failed pass: lin2's gradients recorded, no parameter's .grad; the second pass's
    # .grad (over both passes, as torch accumulates them) recorded and equal to torch's
    params = {b.module: b for b in c.boundaries if b.param_grad}
    assert set(params) == set(want) and {b.call for b in params.values()} == {1}
    for n, b in params.items():
        assert b.name == f"{n}:grad#1"
        assert np.array_equal(c.tensor(b), want[n].numpy()), n
    # lin2's backward ran in both passes, lin1's in the second only
    assert "lin2:grad_input0#1" in c and "lin1:grad_output0" in c
    assert "lin1:grad_output0#1" not in c
    # two such captures: the backward is not identical (a failed pass), never a false match
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    bw = df.attrs["backward"]
    assert bw["status"] == "inconclusive" and bw["n_divergent"] == 0
    assert any("raised before its end" in u["reason"] for u in bw["unjudged"])
    assert df.attrs["status"] == "inconclusive"


def test_capture_generate_refuses_a_backward(tmp_path):
    from dmlib.localize.hf import capture_generate

    ids = torch.zeros(1, 3, dtype=torch.long)
    for kw in ({"backward": True}, {"options": dmlib.CaptureOptions(backward=True)}):
        with pytest.raises(dmlib.errors.CaptureError, match="generate\\(\\) runs without grad"):
            capture_generate(_model(), tmp_path / "g", row_map=[[("r0", j) for j in range(3)]],
                             generate_kwargs={"input_ids": ids, "max_new_tokens": 1}, **kw)  # fmt: skip
        assert not (tmp_path / "g").exists()  # refused before anything was written


def test_backward_with_op_level_capture(tmp_path):
    """ops=True beside backward=True: the module gradients and .grad still equal plain
    autograd's, and a planted ULP in one grad_input is still the backward's first
    divergent boundary (the op boundaries are the forward's)."""
    m = _model()
    want = _oracle(m)
    _run(m, tmp_path / "a", dump=("*grad*",), ops=True)
    c = dmlib.open_capture(tmp_path / "a")
    order = [b.name for b in c.boundaries]
    ops = [i for i, n in enumerate(order) if "/aten." in n]
    first_grad = next(i for i, b in enumerate(c.boundaries) if b.grad)
    assert ops and max(ops) < first_grad  # the ops recorded are the forward's
    grads = [b for b in c.boundaries if b.grad and b.slot in ("grad_input0", "grad_output0")]
    assert {b.name for b in grads} == set(want) - {"params"}
    for b in grads:
        assert np.array_equal(c.tensor(b), want[b.name].numpy()), b.name
    params = [b for b in c.boundaries if b.param_grad]
    assert {b.module for b in params} == set(want["params"])
    for b in params:
        assert np.array_equal(c.tensor(b), want["params"][b.module].numpy()), b.name
    _run(m, tmp_path / "b", plant=True, ops=True)
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    assert df.attrs["first_divergent_boundary"] is None  # the forward, ops included, matches
    bw = df.attrs["backward"]
    assert bw["first_divergent_boundary"] == f"{O_PROJ}:grad_input0"
    assert bw["culprit"] == f"{O_PROJ}:grad_input0"
    assert df.attrs["status"] == "different"
