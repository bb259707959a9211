"""Grouped-KV heads in a common form: SDPA on 2 KV heads in one run, on them repeated to 4
in the other (transformers repeats them when an attention mask is given, or wherever
``sdpa_attention.use_gqa_in_sdpa`` says no).

Oracle: a wrapper of our own around ``torch.nn.functional.scaled_dot_product_attention``
keeps each call's keys and values; the probe's rows of the repeated side are checked to be
exact copies with ``torch.equal`` on integer views, collapsed to one head per group and
compared bit for bit with the other side's. dmlib's verdict on each SDPA op's key and
value inputs is asserted equal to the oracle's, never which op differs on this CPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import transformers.integrations.sdpa_attention as hf_sdpa  # noqa: E402

import dmlib  # noqa: E402
from tests.test_localize_hf import N_PROBE, layouts, make  # noqa: E402

SDPA = "aten._scaled_dot_product_flash_attention_for_cpu"


def _run(model, kwargs, tamper: bool = False):
    """Keys and values of each SDPA call (batch row 0's probe rows cut later)."""
    seen, real = [], torch.nn.functional.scaled_dot_product_attention

    def wrapper(q, k, v, *a, **kw):
        if tamper and k.shape[1] == 4:  # break the copy of KV head 0 in head 1
            k = k.clone()
            k[:, 1] += 2.0**-10
        seen.append((k.detach().clone(), v.detach().clone()))
        return real(q, k, v, *a, **kw)

    torch.nn.functional.scaled_dot_product_attention = wrapper
    try:
        with torch.no_grad():
            model(**kwargs)
    finally:
        torch.nn.functional.scaled_dot_product_attention = real
    return seen


def _bits(t):
    return t.view(torch.int32)


def _oracle_same(xa, xb) -> bool:
    """Probe rows (heads, positions, d): equal after collapsing the side with more heads."""
    big, small = (xa, xb) if xa.shape[0] > xb.shape[0] else (xb, xa)
    g = big.shape[0] // small.shape[0]
    grouped = _bits(big).reshape(small.shape[0], g, *big.shape[1:])
    if not torch.equal(grouped, grouped[:, :1].expand_as(grouped)):
        return False  # the repeated heads are not copies: a difference
    return torch.equal(grouped[:, 0], _bits(small))


def _capture(model, path, kwargs, rows, tamper=False, device=False):
    real = torch.nn.functional.scaled_dot_product_attention

    def wrapper(q, k, v, *a, **kw):
        if tamper and k.shape[1] == 4:
            k = k.clone()
            k[:, 1] += 2.0**-10
        return real(q, k, v, *a, **kw)

    torch.nn.functional.scaled_dot_product_attention = wrapper
    try:
        with torch.no_grad(), dmlib.capture(model, path, row_map=rows, ops=True,
                                            op_modules="model.layers.*.self_attn") as rec:  # fmt: skip
            rec._device_path_on_cpu = device  # the device checksums, taken on CPU tensors
            model(**kwargs)
    finally:
        torch.nn.functional.scaled_dot_product_attention = real


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "case", ["repeated_only", "batched", "copies_broken", "repeated_only_device", "batched_device"]
)
def test_repeated_kv_heads_judged_collapsed_against_oracle(tmp_path, kind, case):
    model = make(kind, "sdpa", torch.float32)
    alone, rows_a, batched, rows_b, where = layouts("right")
    if case.startswith("batched"):
        other, other_rows, cut = batched, rows_b, where
    else:  # the same request alone, transformers told to repeat the KV heads
        other, other_rows, cut = alone, rows_a, slice(0, N_PROBE)
    tamper, device = case == "copies_broken", case.endswith("_device")
    sa = _run(model, alone)
    _capture(model, tmp_path / "a", alone, rows_a, device=device)
    with pytest.MonkeyPatch.context() as mp:
        if not case.startswith("batched"):
            mp.setattr(hf_sdpa, "use_gqa_in_sdpa", lambda *a, **k: False)
        sb = _run(model, other, tamper)
        _capture(model, tmp_path / "b", other, other_rows, tamper, device)
    assert len(sa) == len(sb) == 2 and sa[0][0].shape[1] == 2 and sb[0][0].shape[1] == 4
    df = dmlib.compare_captures(tmp_path / "a", tmp_path / "b", request="probe")
    df = df.set_index("boundary")
    verdicts = []
    for layer in range(2):
        for slot, part in (("input1", 0), ("input2", 1)):
            expect = _oracle_same(sa[layer][part][0], sb[layer][part][0][:, cut])
            name = f"model.layers.{layer}.self_attn/{SDPA}#0:{slot}"
            got = df.loc[name, "identical"]
            assert got is not None and bool(got) == expect, (name, df.loc[name, "note"])
            assert "grouped KV heads" in df.loc[name, "note"]
            if device:  # the device checksums (and their collapsed form) were compared
                assert dmlib.open_capture(tmp_path / "b").boundary(name).hash == "cksum4-v1"
            verdicts.append(expect)
    if case.startswith("repeated_only"):  # one batch, same matmuls: the oracle finds the keys equal
        assert all(verdicts)
    if case == "copies_broken":
        k0 = f"model.layers.0.self_attn/{SDPA}#0:input1"
        assert not verdicts[0] and "not exact copies" in df.loc[k0, "note"]


@pytest.mark.parametrize("case", ["batched", "repeated"])
def test_patch_test_on_sdpa_in_every_layer_against_a_plain_patch(tmp_path, case):
    """patch_test on SDPA in both layers (GQA: 2 KV heads alone, 4 repeated in the other).

    Oracle: the same patch by hand: the second run's SDPA outputs get the probe's rows of
    the alone run's outputs (wrapping ``scaled_dot_product_attention``). Where the probe's
    logits already match without the patch, patch_test must say every boundary already
    matched; otherwise confirmed is asserted equal to whether the patched logits equal
    the alone run's bit for bit. ``batched``: whatever this CPU gives; ``repeated``: the
    same request alone with transformers told to repeat the KV heads.
    """
    from dmlib.localize.patch import patch_test

    model = make("llama", "sdpa", torch.float32)
    alone, rows_a, batched, rows_b, where = layouts("right")
    if case == "repeated":
        batched, rows_b, where = alone, rows_a, slice(0, N_PROBE)
    real = torch.nn.functional.scaled_dot_product_attention
    outs: list[torch.Tensor] = []
    calls = [0]

    def keep(*a, **kw):
        out = real(*a, **kw)
        outs.append(out.detach().clone())
        return out

    def patched(*a, **kw):
        out = real(*a, **kw).clone()
        out[0, :, where] = outs[calls[0]][0]
        calls[0] += 1
        return out

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        if case == "repeated":
            mp.setattr(hf_sdpa, "use_gqa_in_sdpa", lambda *a, **k: False)
        lb0 = model(**batched).logits
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", keep)
        with pytest.MonkeyPatch.context() as mp2:
            mp2.setattr(hf_sdpa, "use_gqa_in_sdpa", lambda *a, **k: True)
            la = model(**alone).logits
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", patched)
        lb = model(**batched).logits
    already = torch.equal(la[0], lb0[0, where])
    expect = torch.equal(la[0], lb[0, where])
    with torch.no_grad(), dmlib.capture(model, tmp_path / "alone", row_map=rows_a, ops=True,
                                        op_modules="model.layers.*.self_attn", dump="*"):  # fmt: skip
        model(**alone)
    names = [f"model.layers.{i}.self_attn/{SDPA}#0" for i in range(2)]
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        if case == "repeated":
            mp.setattr(hf_sdpa, "use_gqa_in_sdpa", lambda *a, **k: False)
        res = patch_test(model, source=tmp_path / "alone", boundary=names, request="probe",
                         row_map=rows_b, run=lambda: model(**batched))  # fmt: skip
    t = res.table.set_index("boundary")
    assert bool(t.loc["lm_head", "identical_before"]) == already
    assert bool(t.loc["lm_head", "identical_after"]) == expect
    if already and all(bool(t.loc[n, "identical_before"]) for n in names):
        assert not res.confirmed and "already matched" in res.reason
    else:
        assert res.confirmed == expect, res.reason
