"""The ``expert`` boundary kind: each expert's rows written into a capture
(``capture(..., experts=True)``) and judged per (expert, request, position) by a comparison.

Model: a tiny random-init Qwen3-MoE from its config (8 experts, top-2, eager experts), in
float32 and bfloat16. Oracle: the test's own TorchFunctionMode sees every ``F.linear``
run with a slice ``[e]`` of an experts module's ``gate_up_proj`` / ``down_proj``, maps
each gathered row to its token by the gate_up input row equal to the token's hidden row
(the experts module's input, read by a plain forward pre-hook; no assumption on the
order), and hashes each output row's bytes with hashlib's SHA-256; a plant adds 1 ULP (one
step of the bit pattern) to one token's output row of one expert stage. Which rows differ
between the probe alone and packed is never asserted: only that dmlib's judgement equals
the oracle's, row by row.
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
from dmlib.localize.boundaries import CaptureVerdict, compare_captures  # noqa: E402

PROBE = [5, 9, 1, 33, 7, 60, 2, 18, 44, 3, 12, 27]
OTHER = [40, 41, 8, 13, 21, 34, 55, 6, 17, 29, 31, 37]
STAGES = ("gate_up_proj", "down_proj")
LAYER1 = "model.layers.1.mlp.experts"
DTYPES = [torch.float32, torch.bfloat16]


def _model(impl: str = "eager", dtype: torch.dtype = torch.float32) -> object:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=64,
    )  # fmt: skip
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).eval().to(dtype)


class Oracle(TorchFunctionMode):
    """Every expert row by hand: ``rows[(module, call, expert, stage, token)] = sha256``
    of the row's bytes; ``plant=(module, expert, stage, token)`` adds 1 ULP to that row's
    first element (call 0)."""

    def __init__(self, model: object, plant: tuple[str, int, str, int] | None = None) -> None:
        super().__init__()
        self.plant, self.planted = plant, 0
        self.rows: dict[tuple[str, int, int, str, int], str] = {}
        self.mods = {n: m for n, m in model.named_modules() if n.endswith("mlp.experts")}
        self.calls: dict[str, int] = {}
        self.now: tuple[str, int, torch.Tensor] | None = None
        self.order: dict[tuple[str, int, int], list[int]] = {}
        self.handles = [m.register_forward_pre_hook(self._pre(n)) for n, m in self.mods.items()]

    def _pre(self, name: str):  # type: ignore[no-untyped-def]
        def hook(mod, args):  # type: ignore[no-untyped-def]
            call = self.calls.get(name, 0)
            self.calls[name] = call + 1
            self.now = (name, call, args[0].detach().clone())

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

    def _seen(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
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
            tokens = self.order[(name, call, e)]
            if self.plant is not None and self.plant[:3] == (name, e, stage) and call == 0:
                out = out.clone()
                bits = out.view(torch.int16 if out.dtype == torch.bfloat16 else torch.int32)
                bits[tokens.index(self.plant[3]), 0] += 1  # the next float away from zero
                self.planted += 1
            for r, t in enumerate(tokens):
                data = out[r].contiguous().view(torch.uint8).numpy().tobytes()
                self.rows[(name, call, e, stage, t)] = hashlib.sha256(data).hexdigest()
            return out
        return out


def run(model, path, batch, rows, plant=None, **kw):  # type: ignore[no-untyped-def]
    """One forward inside a capture with experts=True, under the oracle."""
    ids = torch.tensor(batch)
    oracle = Oracle(model, plant)
    try:
        with torch.no_grad(), oracle, dmlib.capture(model, path, row_map=rows, experts=True, **kw):
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
    finally:
        oracle.close()
    return oracle


def alone(model, path, plant=None):  # type: ignore[no-untyped-def]
    return run(model, path, [PROBE], [[("probe", i) for i in range(12)]], plant)


def packed(model, path):  # type: ignore[no-untyped-def]
    rows = [[("other", i) for i in range(12)], [("probe", i) for i in range(12)]]
    return run(model, path, [OTHER, PROBE], rows)


def recorded(path) -> dict[tuple[str, int, int, str, str, int], str]:  # type: ignore[no-untyped-def]
    """(module, call, expert, stage, request, position) -> digest, from the manifest."""
    out = {}
    for d in json.loads((path / "manifest.json").read_text())["boundaries"]:
        if "expert" in d:
            ex = d["expert"]
            for r, pairs in ex["rows"].items():
                for p, dg in pairs:
                    out[(d["module"], d["call"], ex["index"], ex["stage"], r, p)] = dg
    return out


def by_request(oracle: Oracle, requests: dict[int, tuple[str, int]]) -> dict:  # type: ignore[type-arg]
    """The oracle's rows keyed like :func:`recorded` (flat token -> request, position)."""
    return {(m, c, e, s, *requests[t]): dg for (m, c, e, s, t), dg in oracle.rows.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("stage", STAGES)
def test_a_planted_ulp_in_one_expert_row_is_the_first_divergence_and_the_culprit(
    tmp_path, capsys, dtype, stage
):
    model = _model(dtype=dtype)
    base = alone(model, tmp_path / "a")
    token = 6
    e = min(k[2] for k in base.rows if k[0] == LAYER1 and k[4] == token)  # routed there
    planted = alone(model, tmp_path / "b", plant=(LAYER1, e, stage, token))
    assert planted.planted == 1
    flat = {t: ("probe", t) for t in range(12)}
    # the capture holds exactly the rows the oracle hashed, each under its token
    assert recorded(tmp_path / "a") == by_request(base, flat)
    assert recorded(tmp_path / "b") == by_request(planted, flat)

    df = compare_captures(tmp_path / "a", tmp_path / "b")
    name = f"{LAYER1}:expert{e}.{stage}"
    assert df.attrs["first_divergent_boundary"] == name
    assert df.attrs["culprit"] == name
    ex = df.attrs["experts"]
    first = ex["first_divergent"]
    assert (first["module"], first["expert"], first["stage"], first["request"],
            first["position"]) == (LAYER1, e, stage, "probe", token)  # fmt: skip
    assert [(c["expert"], c["stage"], c["position"]) for c in ex["culprits"]] == [(e, stage, token)]
    role = df.set_index("boundary")["role"]
    assert role[name] == "culprit"
    row = df.set_index("boundary").loc[LAYER1]  # the experts module's own output
    if row["identical"] is not pd.NA and not row["identical"]:
        assert role[LAYER1] == "encloses-culprit"
    # the activation inside the experts module: one layout, the same experts hit by the
    # same tokens, so its n-th call is the same expert's in both and it is judged
    inside = df[df["boundary"].str.startswith(f"{LAYER1}.act_fn")]
    assert len(inside) and inside["identical"].notna().all()
    assert (inside["role"] != "culprit").all()
    if stage == "gate_up_proj":  # the same expert's down_proj row carries the plant on
        down = df.set_index("boundary").loc[f"{LAYER1}:expert{e}.down_proj"]
        if down["identical"] is not pd.NA and not down["identical"]:
            assert role[f"{LAYER1}:expert{e}.down_proj"] == "carrier"
    # every expert row before the planted one (layer 0 whole) identical
    assert all(d["module"] == LAYER1 for d in ex["differ"])
    assert df.attrs["status"] == "different"

    assert main(["localize", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    text = capsys.readouterr().out
    assert f"first divergent expert row: expert {e} of {LAYER1}, token {token} of request " \
        f"'probe', {stage}" in text  # fmt: skip
    assert main(["localize", "--json", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["attrs"]["experts"]["first_divergent"]["position"] == token


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_alone_against_packed_every_expert_row_judged_as_the_oracle_does(tmp_path, dtype):
    model = _model(dtype=dtype)
    oa = alone(model, tmp_path / "a")
    ob = packed(model, tmp_path / "b")
    ra = by_request(oa, {t: ("probe", t) for t in range(12)})
    rb = by_request(ob, {t: (("other", t) if t < 12 else ("probe", t - 12)) for t in range(24)})
    assert recorded(tmp_path / "a") == ra
    assert recorded(tmp_path / "b") == rb

    # the oracle's judgement of the probe's rows: (module, call, expert, stage, position)
    pa = {(m, c, e, s, p): d for (m, c, e, s, r, p), d in ra.items()}
    pb = {(m, c, e, s, p): d for (m, c, e, s, r, p), d in rb.items() if r == "probe"}
    both = pa.keys() & pb.keys()
    differ = sorted(k for k in both if pa[k] != pb[k])
    one_run = len(pa.keys() ^ pb.keys())

    df = compare_captures(tmp_path / "a", tmp_path / "b", request="probe")
    ex = df.attrs["experts"]
    got = sorted(
        (d["module"], d["call"], d["expert"], d["stage"], d["position"]) for d in ex["differ"]
    )
    assert got == differ
    assert ex["n_rows_identical"] == len(both) - len(differ)
    assert ex["n_rows_one_run"] == one_run
    by_name = df.set_index("boundary")
    for m, c, e, s in {k[:4] for k in pa}:
        name = f"{m}:expert{e}.{s}" + (f"#{c}" if c else "")
        mine = [k for k in pa if k[:4] == (m, c, e, s)]
        want = (False if any(k in differ for k in mine)
                else None if any(k not in pb for k in mine) else True)  # fmt: skip
        have = by_name.loc[name, "identical"]
        assert (None if have is pd.NA else bool(have)) is want, name
    # the activation inside the experts modules: its n-th call is the n-th expert hit, whose
    # tokens the packed run does not share, so it is left to the expert rows
    inside = df[df["boundary"].str.contains(r"mlp\.experts\.act_fn")]
    assert len(inside) and inside["identical"].isna().all()
    assert (inside["role"] == "unjudged").all()
    assert inside["note"].str.contains("judged by that module's expert").all()
    # a capture judged per expert is never "identical" with a routing flip in it
    if one_run:
        assert df.attrs["status"] != "identical"


def test_an_experts_module_not_judged_is_written_and_never_identical(tmp_path, capsys, monkeypatch):
    """An experts implementation experts.py does not read row by row (here grouped_mm's
    forward registered under a name of the test's own, which no check knows): the capture
    says so, and two identical runs compare as inconclusive (exit 3), never identical."""
    from transformers.integrations import moe

    monkeypatch.setitem(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, "bespoke",
                        moe.grouped_mm_experts_forward)  # fmt: skip
    model = _model(impl="bespoke")
    alone(model, tmp_path / "a")
    alone(model, tmp_path / "b")
    c = dmlib.open_capture(tmp_path / "a")
    assert not [b for b in c.boundaries if b.expert is not None]
    whats = {u["what"]: u["reason"] for u in c.not_captured}
    assert set(whats) == {"model.layers.0.mlp.experts: expert rows", f"{LAYER1}: expert rows"}
    assert all(r.startswith("not judged: experts_implementation 'bespoke'") for r in whats.values())
    df = compare_captures(tmp_path / "a", tmp_path / "b")
    v = CaptureVerdict.of(df)
    assert df.attrs["status"] == "inconclusive" and not v
    assert main(["localize", str(tmp_path / "a"), str(tmp_path / "b")]) == 3
    assert "not judged: experts_implementation 'bespoke'" in capsys.readouterr().out


def _edit(path, change) -> None:  # type: ignore[no-untyped-def]
    mf = path / "manifest.json"
    m = json.loads(mf.read_text())
    d = next(d for d in m["boundaries"] if "expert" in d)
    change(d["expert"])
    mf.write_text(json.dumps(m))


@pytest.mark.parametrize(
    ("change", "where"),
    [
        (lambda ex: ex["rows"]["probe"][0].__setitem__(0, "3"), "open"),
        (lambda ex: ex["rows"]["probe"].append(list(ex["rows"]["probe"][0])), "open"),
        (lambda ex: ex.__setitem__("index", -1), "open"),
        (lambda ex: ex["rows"].__setitem__("probe", {"0": "x"}), "open"),
        (lambda ex: ex["rows"]["probe"][0].__setitem__(0, 99), "compare"),
    ],
    ids=["position-not-int", "position-twice", "negative-expert", "rows-not-pairs", "past-end"],
)
def test_a_hostile_expert_entry_is_one_clear_error(tmp_path, capsys, change, where):
    model = _model()
    alone(model, tmp_path / "a")
    alone(model, tmp_path / "b")
    _edit(tmp_path / "b", change)
    if where == "open":
        with pytest.raises(CaptureError, match="malformed"):
            dmlib.open_capture(tmp_path / "b")
    else:
        with pytest.raises(CaptureError, match="position 99; the request has 12 positions"):
            compare_captures(tmp_path / "a", tmp_path / "b")
    assert main(["localize", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ("manifest" in err[0] or "boundary" in err[0])


def test_a_decode_step_row_is_the_position_after_the_prompt(tmp_path):
    from dmlib.localize.hf import capture_generate

    model = _model()
    oracle = Oracle(model)
    ids = torch.tensor([PROBE])
    gen = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": 3,
           "do_sample": False, "pad_token_id": 0}  # fmt: skip
    try:
        with torch.no_grad(), oracle:
            capture_generate(model, tmp_path / "g", row_map=[[("probe", i) for i in range(12)]],
                             generate_kwargs=gen, experts=True)  # fmt: skip
    finally:
        oracle.close()
    # pass s > 0 feeds one token per batch row: request 'probe' at position 12 + s - 1
    want = {(m, c, e, s, "probe", t if c == 0 else 11 + c): d
            for (m, c, e, s, t), d in oracle.rows.items()}  # fmt: skip
    assert {k[1] for k in want} == {0, 1, 2}
    assert recorded(tmp_path / "g") == want


def test_the_report_section_lists_the_differing_expert_rows(tmp_path):
    """The capture notebook's expert cell (report.sections_captures.expert_rows): the
    planted row, one row of the table, and the count recorded."""
    from pathlib import Path

    from dmlib import report
    from dmlib.report import sections_captures as sections

    model = _model()
    base = alone(model, tmp_path / "a")
    e = min(k[2] for k in base.rows if k[0] == LAYER1 and k[4] == 3)
    alone(model, tmp_path / "b", plant=(LAYER1, e, "down_proj", 3))
    report.configure(figure_dir=tmp_path / "stage" / "figures", notebook="experts_test")
    try:
        df = compare_captures(tmp_path / "a", tmp_path / "b")
        table = sections.expert_rows(sections.Captures(study=None, results={"a vs b": df}))
        assert table is not None
        got = table[["module", "expert", "stage", "request", "position", "role"]]
        assert got.values.tolist() == [[LAYER1, e, "down_proj", "probe", 3, "culprit"]]
        n = report.load_numbers(report.numbers_path())
        assert n["expert_rows_differ"] == {"a vs b": 1}
    finally:
        report.configure(figure_dir=Path("reports") / "figures", notebook="notebook")


def test_every_expert_entry_reads_back_to_itself(tmp_path):
    """The writer's expert entries through Boundary.from_entry and to_entry: the same JSON
    text (the kind's row of format.KINDS, its marker key in OPTIONAL_KEYS)."""
    from dmlib.localize.capture.format import Boundary

    oracle = alone(_model(), tmp_path / "a")
    entries = json.loads((tmp_path / "a" / "manifest.json").read_text())["boundaries"]
    mine = [(i, d) for i, d in enumerate(entries) if "expert" in d]
    # one entry per (module, expert, stage) the oracle saw run
    assert len(mine) == len({(m, e, st) for m, _, e, st, _ in oracle.rows})
    for i, d in mine:
        b = Boundary.from_entry(i, d, tmp_path / "a", 4)
        assert b.category.name == "expert"
        assert json.dumps(b.to_entry()) == json.dumps(d), d["name"]


def test_expert_rows_against_a_capture_without_them_are_not_judged(tmp_path):
    """One capture with experts=True, the other without: the expert boundaries are not
    judged (the other side recorded none), never called routing flips, and the comparison
    is not identical about them, whichever side has them."""
    model = _model()
    alone(model, tmp_path / "a")
    ids = torch.tensor([PROBE])
    with (
        torch.no_grad(),
        dmlib.capture(model, tmp_path / "b", row_map=[("probe", i) for i in range(12)]),
    ):
        model(input_ids=ids, attention_mask=torch.ones_like(ids))
    for x, y in (("a", "b"), ("b", "a")):
        df = compare_captures(tmp_path / x, tmp_path / y)
        reasons = [u["reason"] for u in df.attrs["unjudged"] if ":expert" in u["boundary"]]
        assert reasons and all("recorded no expert rows" in r for r in reasons)
        assert df.attrs["status"] != "identical"
    assert compare_captures(tmp_path / "a", tmp_path / "b").attrs["experts"]["n_rows_one_run"] == 0
