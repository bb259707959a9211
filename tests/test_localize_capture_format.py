"""One schema for the capture's writer and reader, and the boundary kinds as one table.

- Every entry the writer wrote (ops, layout inputs, a KV cache and a sliding-window one,
  decode steps, repeated KV heads) reads back into a :class:`Boundary` whose
  ``to_entry()`` is that entry again, key order included (the JSON text is compared);
- each entry's kind (:func:`kind_of`) against what hand-made entries and the lab's op
  captures (data/packed/ops, version 1) say it is;
- the table itself: one row per kind, the reserved kinds to come named with their rules;
- boundary names by the documented rule, worked out by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dmlib.localize.capture.format import (
    ENTRY_KEYS,
    KINDS,
    OPTIONAL_KEYS,
    Boundary,
    boundary_name,
    kind_named,
    kind_of,
)

DATA = Path(__file__).resolve().parent.parent / "data" / "packed"


def test_the_kinds_table_has_one_row_per_kind_and_the_reserved_kinds():
    names = [k.name for k in KINDS]
    assert len(names) == len(set(names))
    assert len({(k.marker, k.entry_kind) for k in KINDS}) == len(KINDS)
    recorded = {k.name for k in KINDS if k.recorded}
    assert recorded == {"layout", "cache", "op-input", "op-output", "module-input",
                        "module-output", "state", "router", "grad_output", "grad_input",
                        "param_grad", "recorded", "expert"}  # fmt: skip
    assert not [k.name for k in KINDS if not k.recorded]
    for k in KINDS:  # every row states its identity and its row rule
        assert k.identity and k.rows and k.entry_kind in ("input", "output")
        assert not k.recorded or k.marker is None or k.marker in OPTIONAL_KEYS
    assert kind_named("router").marker == "router"


@pytest.mark.parametrize(
    ("entry", "kind"),
    [
        ({"kind": "input"}, "module-input"),
        ({"kind": "output"}, "module-output"),
        ({"kind": "input", "layout": True}, "layout"),
        ({"kind": "input", "cache": True, "rolled": True}, "cache"),
        ({"kind": "input", "op": "m/aten.mm#0", "param": "m.weight"}, "op-input"),
        ({"kind": "output", "op": "m/aten.mm#0"}, "op-output"),
        ({"kind": "output", "router": True}, "router"),
        ({"kind": "output", "expert": {"index": 0, "stage": "down_proj", "rows": {}}}, "expert"),
        ({"kind": "input", "grad": True}, "grad_input"),
        ({"kind": "output", "layout": False}, "module-output"),  # a false marker marks nothing
    ],
)
def test_an_entry_is_of_the_first_kind_whose_marker_it_holds(entry, kind):
    assert kind_of(entry).name == kind


def test_an_entry_without_a_direction_has_no_kind():
    with pytest.raises(ValueError, match="boundary kind 'sideways'"):
        kind_of({"kind": "sideways"})


def test_boundary_names_follow_the_rule():
    assert boundary_name("enc.0", 0, "output", "output0") == "enc.0"
    assert boundary_name("enc.0", 2, "output", "output1") == "enc.0:output1#2"
    assert boundary_name("attn", 1, "input", "input.mask") == "attn:input.mask#1"
    assert boundary_name("m/aten.mm#3", 0, "input", "input0") == "m/aten.mm#3:input0"


@pytest.mark.parametrize("name", ["alone", "packed"])
def test_the_lab_op_captures_read_as_op_kinds(name):
    dmlib = pytest.importorskip("dmlib")
    c = dmlib.open_capture(DATA / "ops" / name)
    ops = [b for b in c if b.category.name.startswith("op-")]
    assert ops and all(b.op == b.module and "/" in b.module for b in ops)
    assert all("/" not in b.module for b in c if not b.category.name.startswith("op-"))
    assert {b.category.entry_kind for b in ops} == {"input", "output"}


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _mistral():
    from test_localize_caches import _mistral_sliding  # (a 4-slot sliding window)

    return _mistral_sliding()


def _roundtrip(path: Path) -> list[str]:
    """Every entry of the manifest at ``path`` read and written again; returns the kinds."""
    manifest = json.loads((path / "manifest.json").read_text())
    kinds = []
    for i, d in enumerate(manifest["boundaries"]):
        assert list(d)[: len(ENTRY_KEYS)] == list(ENTRY_KEYS)
        assert set(d) - set(ENTRY_KEYS) <= set(OPTIONAL_KEYS)
        b = Boundary.from_entry(i, d, path, manifest["version"])
        assert json.dumps(b.to_entry()) == json.dumps(d), d["name"]
        kinds.append(b.category.name)
    return kinds


def test_every_entry_the_writer_writes_reads_back_to_itself(tmp_path):
    from dmlib.localize.hf import capture_generate, row_map_from_attention_mask

    model = _mistral()
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    rows = row_map_from_attention_mask(mask, ["probe", "other"])
    gen = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 2, "do_sample": False,
           "pad_token_id": 0}  # fmt: skip
    kinds = []
    for name, cache in (("dynamic", None), ("static", "static")):
        kw = dict(gen, **({"cache_implementation": cache} if cache else {}))
        with torch.no_grad():
            capture_generate(model, tmp_path / name, row_map=rows, generate_kwargs=kw,
                             modules=["model.layers.0", "model.norm"], ops=True,
                             op_modules="model.layers.0.self_attn")  # fmt: skip
        kinds += _roundtrip(tmp_path / name)
    assert {"layout", "cache", "op-input", "op-output", "module-input",
            "module-output"} <= set(kinds)  # fmt: skip
    static = json.loads((tmp_path / "static" / "manifest.json").read_text())["boundaries"]
    assert any(d.get("rolled") for d in static)  # the sliding-window layer's cache
    assert any(d.get("step") for d in static) and any("kv_repeat" in d for d in static)
