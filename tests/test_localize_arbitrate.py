"""fp64 arbitration against planted wrong paths and independent numpy float64 oracles."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from _support import opsmodel  # noqa: E402
from _support.opsmodel import Net, layout  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as tf  # noqa: E402

import dmlib  # noqa: E402
from dmlib.localize.arbitrate import arbitrate  # noqa: E402
from dmlib.localize.ops import op_table  # noqa: E402

QUIRK_OP = "model.quirk/dmtest.batch_round#0"
ROWSUM_OP = "model.mixer/dmtest.rowsum#0"
REFS = {"dmtest.batch_round": opsmodel.ref_batch_round, "dmtest.rowsum": opsmodel.ref_rowsum}


def f32_ulps(out: np.ndarray, ref64: np.ndarray) -> np.ndarray:
    """ULP distance in float32 by hand: ordered integer keys of the bit patterns."""

    def key(v):
        i = np.ascontiguousarray(v, dtype=np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    return np.abs(key(out) - key(ref64.astype(np.float32)))


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    root = tmp_path_factory.mktemp("arb")
    model = Net()
    model.model.mixer.active = True
    for kind in ("alone", "packed"):
        x, rows = layout(kind)
        with torch.no_grad(), dmlib.capture(model, root / kind, modules="*", row_map=rows,
                                            ops=True, dump="model.*/dmtest.*"):  # fmt: skip
            model(x)
    return root


def test_planted_float16_rounding_departs(caps):
    res = arbitrate(caps / "alone", caps / "packed", QUIRK_OP, request="q", reference=REFS)
    assert res.verdict == "b-departs" and not res
    t = res.table.set_index("run")
    alone = dmlib.open_capture(caps / "alone")
    x = np.asarray(alone.tensor(QUIRK_OP + ":input0")).reshape(-1, opsmodel.F)
    exact = x.astype(np.float64) * 3.0  # exact in float64 (26 significant bits)
    # alone: one IEEE float32 multiply is correctly rounded: 0 ULP everywhere
    assert t.loc["a", "max_ulp"] == 0 and t.loc["a", "frac_exact"] == 1.0
    x16 = x.astype(np.float16).astype(np.float32) * np.float32(3.0)
    assert t.loc["b", "max_ulp"] == f32_ulps(x16, exact).max() > 1
    rel = np.linalg.norm(x16.astype(np.float64) - exact) / np.linalg.norm(exact)
    assert math.isclose(t.loc["b", "rel_err"], rel, rel_tol=1e-9)


def test_float16_accumulation_departs(caps):
    # the first plant already changed rowsum's inputs; arbitration replays each run from
    # its own inputs, so it still judges the op itself
    res = arbitrate(caps / "alone", caps / "packed", ROWSUM_OP, request="q", reference=REFS)
    assert res.verdict == "b-departs"
    t = res.table.set_index("run")
    for run, kind in (("a", "alone"), ("b", "packed")):
        c = dmlib.open_capture(caps / kind)
        x = np.asarray(c.tensor(ROWSUM_OP + ":input0"))
        out = np.asarray(c.tensor(ROWSUM_OP))
        ref = x.astype(np.float64).sum(-1)
        q = c.row_map.requests["q"]
        ulps = f32_ulps(out.reshape(-1)[q], ref.reshape(-1)[q])
        assert abs(int(t.loc[run, "max_ulp"]) - int(ulps.max())) <= 1
    # 8 non-negative float32 terms summed left to right: at most 7 rounding errors
    assert t.loc["a", "max_ulp"] <= 8 and t.loc["b", "max_ulp"] > 100


def test_custom_op_without_reference_is_inconclusive(caps):
    res = arbitrate(caps / "alone", caps / "packed", QUIRK_OP, request="q")
    assert res.verdict == "inconclusive" and "reference" in res.reason and not res


def test_default_op_is_the_culprit(caps):
    res = arbitrate(caps / "alone", caps / "packed", request="q", reference=REFS)
    assert res.op == QUIRK_OP and res.verdict == "b-departs"


def test_hash_only_capture_is_inconclusive(tmp_path):
    model = Net()
    for kind in ("alone", "packed"):
        x, rows = layout(kind)
        with torch.no_grad(), dmlib.capture(model, tmp_path / kind, modules="*", row_map=rows,
                                            ops=True):  # fmt: skip
            model(x)
    res = arbitrate(tmp_path / "alone", tmp_path / "packed", QUIRK_OP, reference=REFS)
    assert res.verdict == "inconclusive" and "not dumped" in res.reason


class OneOp(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def np_softmax(z, axis=-1):
    e = np.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def np_conv1d(x, w, b):
    n, _, length = x.shape
    o, _, k = w.shape
    out = np.zeros((n, o, length - k + 1))
    for i in range(length - k + 1):
        out[:, :, i] = np.einsum("ncj,ocj->no", x[:, :, i : i + k], w) + b
    return out


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# a padding-style key mask: batch row 1 sees only its first three keys
MASK = torch.ones(2, 1, 5, 5, dtype=torch.bool)
MASK[1, :, :, 3:] = False


CASES = {
    # name: (fn, inputs, recorded op, numpy float64 oracle)
    "addmm": (lambda x, w, b: tf.linear(x, w, b), (_r(6, 5), _r(3, 5, seed=1), _r(3, seed=2)),
              "aten.addmm", lambda x, w, b: x @ w.T + b),
    "bmm": (torch.bmm, (_r(2, 4, 7), _r(2, 7, 3, seed=1)), "aten.bmm", lambda a, b: a @ b),
    "softmax": (lambda x: torch.softmax(x, -1), (_r(4, 9),), "aten._softmax", np_softmax),
    "layer_norm": (lambda x: tf.layer_norm(x, [6], eps=1e-5), (_r(5, 6),),
                   "aten.native_layer_norm",
                   lambda x: (x - x.mean(-1, keepdims=True))
                   / np.sqrt(x.var(-1, keepdims=True) + 1e-5)),
    "sum": (lambda x: x.sum(-1), (_r(3, 40),), "aten.sum", lambda x: x.sum(-1)),
    "mean": (lambda x: x.mean(0), (_r(30, 4),), "aten.mean", lambda x: x.mean(0)),
    "sdpa": (tf.scaled_dot_product_attention, (_r(1, 2, 5, 4), _r(1, 2, 5, 4, seed=1),
                                                _r(1, 2, 5, 4, seed=2)),
             "aten._scaled_dot_product_flash_attention_for_cpu",
             lambda q, k, v: np_softmax(q @ np.swapaxes(k, -1, -2) / 2.0) @ v),
    "sdpa_bool_mask": (lambda q, k, v, m: tf.scaled_dot_product_attention(q, k, v, attn_mask=m),
                       (_r(2, 2, 5, 4), _r(2, 2, 5, 4, seed=1), _r(2, 2, 5, 4, seed=2), MASK),
                       "aten._scaled_dot_product_flash_attention_for_cpu",
                       lambda q, k, v, m: np_softmax(np.where(m, q @ np.swapaxes(k, -1, -2) / 2.0,
                                                              -np.inf)) @ v),
    "sdpa_causal_scaled": (lambda q, k, v: tf.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                           scale=0.3),
                           (_r(1, 3, 6, 4), _r(1, 3, 6, 4, seed=1), _r(1, 3, 6, 4, seed=2)),
                           "aten._scaled_dot_product_flash_attention_for_cpu",
                           lambda q, k, v: np_softmax(np.where(np.tril(np.ones((6, 6), bool)),
                                                               q @ np.swapaxes(k, -1, -2) * 0.3,
                                                               -np.inf)) @ v),
    "baddbmm": (lambda c, a, b: torch.baddbmm(c, a, b, beta=0.5, alpha=2.0),
                (_r(2, 3, 4), _r(2, 3, 5, seed=1), _r(2, 5, 4, seed=2)), "aten.baddbmm",
                lambda c, a, b: 0.5 * c + 2.0 * (a @ b)),
    "log_softmax": (lambda x: torch.log_softmax(x, 0), (_r(7, 3),), "aten._log_softmax",
                    lambda x: np.log(np_softmax(x, 0))),
    "conv1d": (tf.conv1d, (_r(2, 3, 9), _r(4, 3, 3, seed=1), _r(4, seed=2)),
               "aten.convolution", np_conv1d),
}  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "numpy"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_aten_replay_matches_a_numpy_float64_oracle(case, backend, tmp_path):
    fn, inputs, op_prefix, oracle = CASES[case]
    m = OneOp(fn)
    with torch.no_grad(), dmlib.capture(m, tmp_path / "c", modules="", ops=True, dump="*"):
        out = m(*inputs)
    c = dmlib.open_capture(tmp_path / "c")
    ops = [o for o in op_table(c) if o.op.startswith(op_prefix + ".")]
    assert len(ops) == 1, [o.op for o in op_table(c)]
    res = arbitrate(c, c, ops[0].id, backend=backend)
    if backend == "numpy" and case == "conv1d":  # no numpy replay: said, never guessed
        assert res.verdict == "inconclusive" and "no numpy float64 replay" in res.reason
        return
    assert res.verdict == "both-close"  # the same run twice
    t = res.table.set_index("run")
    ref = oracle(*(i.double().numpy() for i in inputs))
    got = out.numpy()
    assert abs(int(t.loc["a", "max_ulp"]) - int(f32_ulps(got, ref).max())) <= 1
    rel = np.linalg.norm((got.astype(np.float64) - ref).ravel()) / np.linalg.norm(ref.ravel())
    assert t.loc["a", "rel_err"] == pytest.approx(rel, rel=1e-6, abs=1e-15)


def test_numpy_replay_runs_where_torch_cannot_be_imported(caps, tmp_path):
    """The report kernels have no torch: arbitrate there gives the numpy backend's table."""
    import json
    import os
    import subprocess
    import sys

    blocker = tmp_path / "no_torch"
    (blocker / "torch").mkdir(parents=True)
    (blocker / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    script = (
        "import json, sys, dmlib\n"
        f"r = dmlib.arbitrate({str(caps / 'alone')!r}, {str(caps / 'packed')!r}, {QUIRK_OP!r}, "
        "request='q', reference={'dmtest.batch_round': lambda x: x * 3.0})\n"
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None\n"
        "print(json.dumps([r.verdict, r.table[['max_ulp', 'rel_err']].values.tolist()]))\n"
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")])),
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    verdict, rows = json.loads(done.stdout)
    here = arbitrate(caps / "alone", caps / "packed", QUIRK_OP, request="q", reference=REFS)
    assert verdict == here.verdict == "b-departs"
    assert [r[0] for r in rows] == list(here.table["max_ulp"])
    assert np.allclose([r[1] for r in rows], here.table["rel_err"], rtol=1e-12)


def test_unknown_backend_is_refused(caps):
    with pytest.raises(dmlib.DmlibError, match="backend"):
        arbitrate(caps / "alone", caps / "packed", QUIRK_OP, backend="jax")
