"""Which boundaries around an experts module two captures may pair, and how.

1. A module called inside an experts module (the eager implementation's activation
   ``act_fn``: its n-th call runs on the n-th expert hit's gathered tokens) is paired by
   call number only where both captures' calls provably line up. Oracle: the test's own
   ``TorchFunctionMode`` sees each ``F.linear`` on a slice ``[e]`` of an experts module's
   ``gate_up_proj`` (the expert, from the slice's storage) and maps its input rows to
   tokens by equality with the experts module's input rows (a plain forward pre-hook);
   a plain forward pre-hook on ``act_fn`` records, per call, the expert and tokens of the
   ``gate_up_proj`` run just before it.
2. Expert rows of a full-sequence forward (trainer) against ``capture_generate``'s prefill +
   decode passes (sampler), paired by position. Oracle: the same mode hashes every expert
   row with hashlib's SHA-256 per token, and plants +1 ULP (one step of the bit pattern)
   in one expert row of one decode pass; the pairing by position is the test's own
   (prefill token ``t`` is position ``t``, decode pass ``s``'s token is position
   ``P + s - 1``). Which rows differ naturally between trainer and sampler on this CPU is
   never asserted: only that dmlib's judgement equals the oracle's, and the plant.
"""

from __future__ import annotations

import hashlib
import json

import pandas as pd
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch.overrides import TorchFunctionMode  # noqa: E402

import dmlib  # noqa: E402
from dmlib.cli import main  # noqa: E402
from dmlib.errors import CaptureError  # noqa: E402
from dmlib.localize.boundaries import compare_captures  # noqa: E402
from tests.test_localize_capture_experts import OTHER, PROBE, _model, recorded  # noqa: E402

STAGES = ("gate_up_proj", "down_proj")
LAYER0, LAYER1 = "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"


class Rows(TorchFunctionMode):
    """``rows[(module, call, expert, stage, token)] = sha256`` of every expert row,
    ``acts[(module, act_fn call)] = (expert, tokens)`` from a plain pre-hook on each
    ``act_fn``; ``plant=(module, call, expert, stage, token)`` adds 1 ULP to that row."""

    def __init__(self, model, plant=None):  # type: ignore[no-untyped-def]
        super().__init__()
        self.plant, self.planted = plant, 0
        self.rows: dict[tuple, str] = {}  # type: ignore[type-arg]
        self.acts: list[tuple[str, int, tuple[int, ...]]] = []
        self.mods = {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}
        self.calls: dict[str, int] = {}
        self.now = None
        self.last: tuple[int, tuple[int, ...]] | None = None  # the latest gate_up's (e, tokens)
        self.order: dict[tuple[str, int, int], list[int]] = {}
        # (module, call, token) -> the sha256 of its rows of the experts module's three inputs
        self.inputs: dict[tuple[str, int, int], tuple[str, ...]] = {}
        self.handles = [
            m.register_forward_pre_hook(self._pre(n), with_kwargs=True)
            for n, m in self.mods.items()
        ]
        self.handles += [
            m.act_fn.register_forward_pre_hook(self._act(n)) for n, m in self.mods.items()
        ]

    def _pre(self, name):  # type: ignore[no-untyped-def]
        def hook(mod, args, kwargs):  # type: ignore[no-untyped-def]
            call = self.calls.get(name, 0)
            self.calls[name] = call + 1
            keys = ("hidden_states", "top_k_index", "top_k_weights")
            ins = [args[i] if len(args) > i else kwargs[k] for i, k in enumerate(keys)]
            self.now = (name, call, ins[0].detach().clone())
            for t in range(ins[0].shape[0]):
                self.inputs[(name, call, t)] = tuple(
                    hashlib.sha256(
                        x[t].contiguous().view(torch.uint8).numpy().tobytes()
                    ).hexdigest()
                    for x in ins
                )

        return hook

    def _act(self, name):  # type: ignore[no-untyped-def]
        def hook(mod, args):  # type: ignore[no-untyped-def]
            assert self.last is not None
            self.acts.append((name, *self.last))

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is not torch.nn.functional.linear or self.now is None or len(args) < 2:
            return out
        with torch._C.DisableTorchFunction():
            return self._seen(args[0], args[1], out)

    def _seen(self, x, w, out):  # type: ignore[no-untyped-def]
        name, call, hidden = self.now  # type: ignore[misc]
        mod = self.mods[name]
        for stage in STAGES:
            whole = getattr(mod, stage)
            hit = [e for e in range(whole.shape[0]) if w.data_ptr() == whole[e].data_ptr()]
            if not hit:
                continue
            e = hit[0]
            if stage == "gate_up_proj":
                tokens = []
                for r in range(x.shape[0]):
                    same = [t for t in range(hidden.shape[0]) if torch.equal(x[r], hidden[t])]
                    assert len(same) == 1, "two tokens with one hidden row: choose other ids"
                    tokens.append(same[0])
                self.order[(name, call, e)] = tokens
                self.last = (e, tuple(tokens))
            tokens = self.order[(name, call, e)]
            if self.plant is not None and self.plant[:4] == (name, call, e, stage):
                out = out.clone()
                bits = out.view(torch.int16 if out.dtype == torch.bfloat16 else torch.int32)
                bits[tokens.index(self.plant[4]), 0] += 1
                self.planted += 1
            for r, t in enumerate(tokens):
                data = out[r].contiguous().view(torch.uint8).numpy().tobytes()
                self.rows[(name, call, e, stage, t)] = hashlib.sha256(data).hexdigest()
            return out
        return out


def forward(model, path, batch, rows, **kw):  # type: ignore[no-untyped-def]
    """One forward inside a capture, under the oracle."""
    ids = torch.tensor(batch)
    oracle = Rows(model, kw.pop("plant", None))
    try:
        with torch.no_grad(), oracle, dmlib.capture(model, path, row_map=rows, **kw):
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        oracle.close()
    return oracle


def alone(model, path, **kw):  # type: ignore[no-untyped-def]
    return forward(model, path, [PROBE], [[("probe", i) for i in range(12)]], **kw)


def packed(model, path, **kw):  # type: ignore[no-untyped-def]
    rows = [[("other", i) for i in range(12)], [("probe", i) for i in range(12)]]
    return forward(model, path, [OTHER, PROBE], rows, **kw)


def _acts(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["boundary"].str.contains(r"mlp\.experts\.act_fn")]


# -- 1. a module inside an experts module, without experts=True ------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_act_fn_calls_of_two_layouts_are_not_paired(tmp_path, dtype):
    model = _model(dtype=dtype)
    oa = alone(model, tmp_path / "a")
    ob = packed(model, tmp_path / "b")
    # the oracle: act_fn's n-th call ran on another expert's rows, or other tokens of the
    # probe, in the two runs (packed: the probe is tokens 12..23)
    probe_a = [(m, e, tuple(t for t in ts)) for m, e, ts in oa.acts]
    probe_b = [(m, e, tuple(t - 12 for t in ts if t >= 12)) for m, e, ts in ob.acts]
    assert len(oa.acts) > 2 and probe_a != probe_b
    # every capture names its experts modules
    cov = json.loads((tmp_path / "b" / "manifest.json").read_text())["coverage"]
    assert sorted(cov["experts_modules"]) == [LAYER0, LAYER1]
    assert {v["calls"] for v in cov["experts_modules"].values()} == {1}

    df = compare_captures(tmp_path / "a", tmp_path / "b", request="probe")
    inside = _acts(df)
    assert len(inside) == 2 * len(oa.acts)  # input and output of each call in A
    assert inside["identical"].isna().all()
    assert (inside["role"] == "unjudged").all()
    assert inside["note"].str.contains("which the two runs need not share").all()
    assert inside["note"].str.endswith("capture with experts=True").all()
    assert df.attrs["first_divergent_boundary"] is None or ".act_fn" not in str(
        df.attrs["first_divergent_boundary"]
    )
    assert df.attrs["status"] != "identical"
    unjudged = {u["boundary"] for u in df.attrs["unjudged"]}
    assert set(inside["boundary"]) <= unjudged


def test_act_fn_calls_of_one_layout_twice_are_judged(tmp_path):
    model = _model()
    oa = alone(model, tmp_path / "a")
    orr = alone(model, tmp_path / "r")
    assert oa.acts == orr.acts  # the oracle: the same expert and tokens per call
    df = compare_captures(tmp_path / "a", tmp_path / "r")
    inside = _acts(df)
    assert len(inside) and inside["identical"].eq(True).all()
    assert df.attrs["status"] == "identical"


def test_a_routing_change_in_one_layout_leaves_that_module_unjudged(tmp_path):
    """One layout, but layer 1's router sends token 4 to another expert in B (a forward
    hook on its gate rewrites the ids): layer 1's act_fn calls are not paired, layer 0's
    still are."""
    model = _model()
    alone(model, tmp_path / "a")
    gate = model.model.layers[1].mlp.gate

    def swap(mod, args, out):  # type: ignore[no-untyped-def]
        logits, weights, idx = out
        idx = idx.clone()
        taken = set(idx[4].tolist())
        idx[4, 1] = next(e for e in range(8) if e not in taken)
        return logits, weights, idx

    h = gate.register_forward_hook(swap)
    try:
        ob = alone(model, tmp_path / "b")
    finally:
        h.remove()
    assert any(m == LAYER1 for m, _, _ in ob.acts)
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    inside = _acts(df)
    l0 = inside[inside["boundary"].str.startswith(LAYER0)]
    l1 = inside[inside["boundary"].str.startswith(LAYER1)]
    assert len(l0) and l0["identical"].eq(True).all()
    assert len(l1) and l1["identical"].isna().all()
    assert l1["note"].str.contains("its routing differs between the runs").all()


def _drop_key(path) -> None:  # type: ignore[no-untyped-def]
    mf = path / "manifest.json"
    m = json.loads(mf.read_text())
    del m["coverage"]["experts_modules"]
    mf.write_text(json.dumps(m))


def test_captures_without_the_coverage_key(tmp_path):
    """Written before coverage.experts_modules: both without it, judged as before (by
    name and call); one with it, the other without, not judged (nothing shows that the
    older capture's calls line up)."""
    model = _model()
    alone(model, tmp_path / "a")
    alone(model, tmp_path / "r")
    packed(model, tmp_path / "b")
    _drop_key(tmp_path / "r")
    df = compare_captures(tmp_path / "a", tmp_path / "r")
    inside = _acts(df)
    assert inside["identical"].isna().all()
    assert inside["note"].str.contains("does not say which modules are experts modules").all()
    _drop_key(tmp_path / "a")
    assert _acts(compare_captures(tmp_path / "a", tmp_path / "r"))["identical"].eq(True).all()
    # both old: packed against alone compares whole where the shapes agree, as before
    _drop_key(tmp_path / "b")
    old = _acts(compare_captures(tmp_path / "a", tmp_path / "b", request="probe"))
    assert old["note"].str.contains("need not share").sum() == 0


@pytest.mark.parametrize(
    "bad",
    [{LAYER0: {"calls": "one"}}, {LAYER0: {"calls": -1, "routing": None}},
     {LAYER0: {"calls": 1, "routing": "not hex"}}, [LAYER0]],
    ids=["calls-not-int", "calls-negative", "routing-not-sha256", "a-list"],
)  # fmt: skip
def test_a_malformed_coverage_key_is_one_clear_error(tmp_path, capsys, bad):
    model = _model()
    alone(model, tmp_path / "a")
    alone(model, tmp_path / "b")
    mf = tmp_path / "b" / "manifest.json"
    m = json.loads(mf.read_text())
    m["coverage"]["experts_modules"] = bad
    mf.write_text(json.dumps(m))
    with pytest.raises(CaptureError, match="experts_modules' is malformed"):
        compare_captures(tmp_path / "a", tmp_path / "b")
    assert main(["localize", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "experts_modules" in err[0]


# -- 2. trainer (full forward) against sampler (prefill + decode) ------------------------


def _sampler(model, path, plant=None, new=3):  # type: ignore[no-untyped-def]
    from dmlib.localize.hf import capture_generate

    ids = torch.tensor([PROBE])
    gen = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": new,
           "do_sample": False, "pad_token_id": 0}  # fmt: skip
    oracle = Rows(model, plant)
    try:
        with torch.no_grad(), oracle:
            out = capture_generate(model, path, row_map=[[("probe", i) for i in range(12)]],
                                   generate_kwargs=gen, experts=True, block_rows=1)  # fmt: skip
    finally:
        oracle.close()
    return out, oracle


def _by_position(rows: dict, decode: bool) -> dict:  # type: ignore[type-arg]
    """(module, expert, stage, position) -> digest; a sampler's pass s > 0 computes
    position 12 + s - 1 (its one token), its prefill position t."""
    out = {}
    for (m, c, e, s, t), d in rows.items():
        p = (12 + c - 1) if decode and c > 0 else t
        out[(m, e, s, p)] = d
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_planted_ulp_in_a_decode_pass_is_found_at_its_expert_position_and_stage(
    tmp_path, stage, dtype
):
    model = _model(dtype=dtype)
    _, clean = _sampler(model, tmp_path / "clean")
    step, token = 2, 0  # decode pass 2: its one token, position 13
    e = min(k[2] for k in clean.rows if k[:2] == (LAYER1, step))
    seq, oracle = _sampler(model, tmp_path / "s", plant=(LAYER1, step, e, stage, token))
    assert oracle.planted == 1
    # the trainer: one forward of the prompt and the tokens the passes fed (positions 0-13)
    n = 12 + step
    trainer = forward(model, tmp_path / "t", [seq[0, :n].tolist()],
                      [[("probe", i) for i in range(n)]], experts=True, block_rows=1)  # fmt: skip

    ft = _by_position(trainer.rows, decode=False)
    fs = _by_position(oracle.rows, decode=True)
    both = ft.keys() & fs.keys()
    differ = sorted(k for k in both if ft[k] != fs[k])
    planted = (LAYER1, e, stage, 12 + step - 1)
    assert planted in differ
    assert _by_position(clean.rows, decode=True)[planted] != fs[planted]

    df = compare_captures(tmp_path / "t", tmp_path / "s", request="probe")
    ex = df.attrs["experts"]
    got = sorted((d["module"], d["expert"], d["stage"], d["position"]) for d in ex["differ"])
    assert got == differ
    assert ex["n_rows_identical"] == len(both) - len(differ)
    assert ex["n_rows_one_run"] == len(ft.keys() ^ fs.keys())
    name = f"{LAYER1}:expert{e}.{stage}#{step}"
    row = df.set_index("boundary").loc[name]
    assert row["identical"] is not pd.NA and not row["identical"]
    assert row["diff_positions"] == [12 + step - 1]
    # against the unplanted sampler: the plant is the one row more that differs, where the
    # unplanted row matched the trainer's on this machine (else nothing more to find)
    dc = compare_captures(tmp_path / "t", tmp_path / "clean", request="probe")
    before = sorted(
        (d["module"], d["expert"], d["stage"], d["position"]) for d in dc.attrs["experts"]["differ"]
    )
    fc = _by_position(clean.rows, decode=True)
    assert before == sorted(k for k in ft.keys() & fc.keys() if ft[k] != fc[k])
    carried = (LAYER1, e, "down_proj", 12 + step - 1)
    if ft[planted] == fc[planted]:  # the plant is new; at most its down_proj row carries it
        assert planted in set(got) - set(before) <= {planted, carried}
    # the oracle's role: the experts module's inputs of that token (hidden row, ids and
    # weights) and, for down_proj, its gate_up_proj row match the trainer's: the culprit
    p = 12 + step - 1
    up = (LAYER1, e, "gate_up_proj", p)
    if trainer.inputs[(LAYER1, 0, p)] == oracle.inputs[(LAYER1, step, token)] and (
        stage == "gate_up_proj" or ft[up] == fs[up]
    ):
        assert row["role"] == "culprit"
        assert (LAYER1, e, stage, p) in {
            (c["module"], c["expert"], c["stage"], c["position"]) for c in ex["culprits"]
        }
    if set(differ) <= {planted, carried}:  # nothing else differs here: the plant is first
        assert ex["first_divergent"]["boundary"] == name
        assert df.attrs["first_divergent_position"]["positions"] == [12 + step - 1]
    # the activation inside the experts modules is never paired across the two
    inside = _acts(df)
    assert len(inside) and inside["identical"].isna().all()


def test_expert_rows_after_a_request_ends_are_not_attributed(tmp_path):
    """Two requests, A ended by a criterion after its first generated token: pass 2
    computes a row for it still, which pass_rows names None: no expert row of A at
    position 5 + 1 (its prompt is 5 tokens). B's decode rows at 5 + s - 1."""
    from dmlib.localize.hf import capture_generate

    model = _model()

    class EndA(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):  # type: ignore[no-untyped-def]
            done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
            done[0] = input_ids.shape[1] - 5 >= 1
            return done

    ids = torch.tensor([PROBE[:5], OTHER[:5]])
    gen = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": 3,
           "do_sample": False, "pad_token_id": 0,
           "stopping_criteria": transformers.StoppingCriteriaList([EndA()])}  # fmt: skip
    rm = [[("A", i) for i in range(5)], [("B", i) for i in range(5)]]
    oracle = Rows(model)
    try:
        with torch.no_grad(), oracle:
            capture_generate(model, tmp_path / "g", row_map=rm, generate_kwargs=gen,
                             experts=True)  # fmt: skip
    finally:
        oracle.close()
    owner = {0: "A", 1: "B"}
    want = {}
    for (m, c, e, s, t), d in oracle.rows.items():
        if c == 0:
            want[(m, c, e, s, owner[t // 5], t % 5)] = d
        elif not (owner[t] == "A" and c >= 2):  # A's sequence: its prompt and one token
            want[(m, c, e, s, owner[t], 5 + c - 1)] = d
    assert any(c == 2 and t == 0 for (_, c, _, _, t) in oracle.rows)  # pass 2 ran A's row
    assert recorded(tmp_path / "g") == want


def test_a_routing_flip_in_a_decode_pass_is_named_not_judged(tmp_path):
    """The sampler's layer-1 router sends decode pass 2's token to another second expert
    (a forward hook rewrites the ids): the rows of the old expert (trainer only) and of
    the new one (sampler only) at position 13 are routing flips, counted, never judged."""
    model = _model()
    gate = model.model.layers[1].mlp.gate
    calls = [0]

    def swap(mod, args, out):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] != 3:  # pass 2
            return None
        logits, weights, idx = out
        idx = idx.clone()
        taken = set(idx[0].tolist())
        idx[0, 1] = next(e for e in range(8) if e not in taken)
        return logits, weights, idx

    h = gate.register_forward_hook(swap)
    try:
        seq, oracle = _sampler(model, tmp_path / "s")
    finally:
        h.remove()
    trainer = forward(model, tmp_path / "t", [seq[0, :14].tolist()],
                      [[("probe", i) for i in range(14)]], experts=True, block_rows=1)  # fmt: skip
    ft = _by_position(trainer.rows, decode=False)
    fs = _by_position(oracle.rows, decode=True)
    one_run = ft.keys() ^ fs.keys()
    assert {k[3] for k in one_run} == {13} and len(one_run) == 4  # 2 experts x 2 stages
    df = compare_captures(tmp_path / "t", tmp_path / "s", request="probe")
    ex = df.attrs["experts"]
    assert ex["n_rows_one_run"] == len(one_run)
    assert (
        not {(d["module"], d["expert"], d["stage"], d["position"]) for d in ex["differ"]} & one_run
    )
    for m, e, st, _ in fs.keys() - ft.keys():
        row = df.set_index("boundary").loc[f"{m}:expert{e}.{st}#2"]
        assert row["identical"] is pd.NA
        assert "routing flip, not a numerical difference" in row["note"]
    assert df.attrs["status"] != "identical"


def test_without_row_maps_the_routing_digest_decides(tmp_path):
    """Captures without a row map compare each tensor whole: one batch twice (the same
    routing) judged; a batch and its rows in the other order (another routing digest)
    not judged."""
    model = _model()

    def run(path, batch):  # type: ignore[no-untyped-def]
        ids = torch.tensor(batch)
        with torch.no_grad(), dmlib.capture(model, path):
            model(input_ids=ids, attention_mask=torch.ones_like(ids))

    run(tmp_path / "a", [PROBE, OTHER])
    run(tmp_path / "r", [PROBE, OTHER])
    run(tmp_path / "b", [OTHER, PROBE])
    assert _acts(compare_captures(tmp_path / "a", tmp_path / "r"))["identical"].eq(True).all()
    swapped = _acts(compare_captures(tmp_path / "a", tmp_path / "b"))
    assert len(swapped) and swapped["identical"].isna().all()
    assert swapped["note"].str.contains("its routing differs between the runs").all()
