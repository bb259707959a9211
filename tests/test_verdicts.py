"""Typed verdicts: bool (identical / passed), str (the printed verdict), to_dict, mapping access.

Inputs are built by hand; the expected lines and values are worked out from them here.
"""

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

import dmlib
from dmlib._json import jsonable
from dmlib.localize.boundaries import CaptureVerdict
from dmlib.stats.compare import summarize_records
from dmlib.stats.matrix import _verdict
from dmlib.stats.verdicts import MatrixVerdict, Summary

SUMMARY_KEYS = [
    "n_tensors", "numel", "n_diff", "frac_diff", "n_tensors_diff", "worst_rel_fro",
    "worst_rel_fro_name", "max_ulp", "max_ulp_name", "max_abs", "only_in_a", "only_in_b",
    "mismatched", "rounded", "byte_order_diff", "n_not_compared", "n_scalars_diff",
    "scalars_only", "not_read", "complete", "identical",
]  # fmt: skip


def _row(name="w", n_diff=0, rel=0.0, ulp=0, abs_=None, ha="h:1", hb="h:1"):
    return {"name": name, "numel": 4, "n_diff": n_diff, "rel_fro": rel, "max_ulp": ulp,
            "max_abs": abs_, "data_hash_a": ha, "data_hash_b": hb}  # fmt: skip


def _attrs(names=("w",), **extra):
    at = {"only_in_a": [], "only_in_b": [], "mismatched": [], "compared": list(names),
          "n_tensors_a": len(names), "n_tensors_b": len(names)}  # fmt: skip
    at.update(extra)
    return at


def test_summary_identical():
    s = summarize_records([_row()], _attrs())
    assert isinstance(s, Summary) and bool(s) is True
    assert str(s) == (
        "IDENTICAL: 0 of 1 compared tensors differ; not compared: none; n_diff 0 of numel 4 "
        "(frac_diff 0); worst rel_fro 0; max_ulp 0"
    )
    assert list(s.to_dict()) == SUMMARY_KEYS and list(s) == SUMMARY_KEYS
    assert s["identical"] is True and s.get("nope", 5) == 5 and "numel" in s
    assert dict(s) == s.to_dict() and s == s.to_dict()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.identical = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        s["identical"] = False  # type: ignore[index]


def test_summary_differs():
    s = summarize_records([_row(n_diff=2, rel=0.5, ulp=3, abs_=0.25, hb="h:2")], _attrs())
    assert bool(s) is False
    assert str(s) == (
        "DIFFERENT: 1 of 1 compared tensors differ; not compared: none; n_diff 2 of numel 4 "
        "(frac_diff 0.5); worst rel_fro 0.5 (w); max_ulp 3"
    )
    assert s["max_abs"] == 0.25 and s["max_ulp_name"] == "w"


def test_summary_one_side_tensor_is_not_identical():
    s = summarize_records([_row()], _attrs(only_in_a=["extra"]))
    assert bool(s) is False and s.word == "NOT ALL COMPARED"
    assert "not compared: 1 only in A;" in str(s)


def test_summary_one_side_scalar_is_not_identical():
    s = summarize_records([_row()], _attrs(scalars_only_in_b=["lr"]))
    assert bool(s) is False and s["scalars_only"] == ["lr"]
    assert str(s).startswith("NOT ALL COMPARED: 0 of 1 compared tensors differ; not compared: "
                             "1 scalars held by one side;")  # fmt: skip


def test_summary_differing_scalar_quoted():
    s = summarize_records([_row()], _attrs(scalars_diff={"step": [3, 4]}))
    assert bool(s) is False
    assert str(s).startswith("DIFFERENT:") and str(s).endswith(
        "; 1 scalars differ (e.g. step: 3 vs 4)"
    )


def test_summary_nothing_selected_is_not_identical():
    s = summarize_records([], _attrs(names=(), n_tensors_a=2, n_tensors_b=2))
    assert bool(s) is False


def test_summary_json_is_its_dict():
    s = summarize_records([_row(n_diff=1, rel=float("inf"), hb="h:2")], _attrs())
    assert json.loads(json.dumps(jsonable({"summary": s}))) == {"summary": jsonable(s.to_dict())}
    assert jsonable(s)["worst_rel_fro"] == "inf"


def test_summary_of_a_real_comparison():
    a = dmlib.ArrayTensorSet({"w": np.ones(3, np.float32), "x": np.zeros(2, np.int8)})
    b = dmlib.ArrayTensorSet({"w": np.ones(3, np.float32)})
    s = dmlib.summarize(dmlib.compare(a, b, progress=False))
    assert bool(s) is False and s["only_in_a"] == ["x"]  # a tensor of one side only
    assert Summary.of(s.to_dict()) == s  # rebuilt from its dict (JSON), equal


def _pair_rows(a, b, n_diff, rel):
    return [{"a": a, "b": b, "name": "w", "numel": 4, "n_diff": n_diff, "rel_fro": rel,
             "max_ulp": 1 if n_diff else 0, "median_ulp": None, "max_abs": None,
             "data_hash_a": None, "data_hash_b": None}]  # fmt: skip


def test_matrix_verdict():
    rows = (
        _pair_rows("x", "y", 0, 0.0) + _pair_rows("x", "z", 2, 1e-3) + _pair_rows("y", "z", 2, 1e-2)
    )
    attrs = {"runs": ["x", "y", "z"], "control": "z", "pairs": {}}
    v = _verdict(rows, attrs, None)
    assert isinstance(v, MatrixVerdict)
    assert v["always_identical"] is True  # the same-seed pair x/y
    assert bool(v) is False  # but the control's pairs differ: not every pair is identical
    assert v["identical_pairs"] == ["x/y"] and v["separation_orders"] == float("inf")
    assert v["control_rel_fro"] == 1e-3  # the least over control pairs
    assert str(v) == (
        "same-seed pairs: worst rel_fro 0.000e+00, max_ulp 0 (median_ulp <= - in every "
        "tensor), max_abs -\n"
        "control z: rel_fro 1.000e-03, max_ulp 1; separation inf orders of magnitude\n"
        "bit-identical pairs: x/y\n"
        "tensors that never differ (same-seed pairs): 1"
    )
    assert list(v) == [f.name for f in dataclasses.fields(MatrixVerdict)]
    assert bool(_verdict(_pair_rows("x", "y", 0, 0.0), {"runs": ["x", "y"], "pairs": {}}, None))


def test_matrix_one_side_tensor_is_not_identical():
    rows = _pair_rows("x", "y", 0, 0.0)
    attrs = {"runs": ["x", "y"], "pairs": {"x/y": {"only_in_b": ["extra"]}}}
    v = _verdict(rows, attrs, None)
    assert bool(v) is False and v["always_identical"] is False and v["identical_pairs"] == []


def _capture_frame(status, repeat=None, negative=True, **extra):
    df = pd.DataFrame({"boundary": ["m.output"]})
    df.attrs.update({
        "status": status, "n_comparable": 3, "unjudged": [], "first_divergent_boundary": None,
        "culprit": None, "culprits": [], "undetermined": [], "entry": None, "culprit_op": None,
        "op_alignment": None, "layout_inputs": [], "stats_missing": [], "repeat_control": repeat,
        "negative_control": {"passed": negative, "checks": []},
        "valid": None if repeat is None else bool(repeat["held"] and negative is not False),
        "not_captured": [], "identical_up_to": None, "routing": None,
        "first_divergent_position": None, "backward": None, "experts": None,
    })  # fmt: skip
    df.attrs.update(extra)
    return df


def test_capture_identical():
    v = CaptureVerdict.of(_capture_frame("identical"))
    assert bool(v) is True and v["status"] == "identical"
    assert str(v) == (
        "identical: all 3 boundaries match\nrepeat control: not run\n"
        "negative control: passed\nvalid: None"
    )
    assert str(v) == dmlib.localize.boundaries.capture_verdict(_capture_frame("identical"))


def test_capture_differs():
    df = _capture_frame("different", first_divergent_boundary="m.l1.output", culprit="m.l1.output",
                        culprits=["m.l1.output"])  # fmt: skip
    v = CaptureVerdict.of(df)
    assert bool(v) is False
    assert str(v).splitlines()[:2] == [
        "first divergent boundary: m.l1.output",
        "culprit (inputs identical, output differs): m.l1.output",
    ]


def test_capture_inconclusive_and_failed_controls():
    un = [{"boundary": "m.l2.output", "reason": "not dumped"}]
    v = CaptureVerdict.of(_capture_frame("inconclusive", unjudged=un))
    assert bool(v) is False and not v.failed_control
    assert str(v).startswith(
        "inconclusive: no difference in 3 judged boundaries, but 1 could not be judged and the "
        "model's outputs were not shown to match: m.l2.output (not dumped)"
    )
    failed = CaptureVerdict.of(_capture_frame("identical", repeat={"held": False, "checks": []}))
    assert (
        bool(failed) is False and failed.failed_control and "repeat control: FAILED" in str(failed)
    )
    unseen = CaptureVerdict.of(_capture_frame("identical", negative=False))
    assert bool(unseen) is False and "negative control: FAILED" in str(unseen)


def test_capture_to_dict_is_the_attrs():
    df = _capture_frame("identical")
    v = CaptureVerdict.of(df)
    assert v.to_dict() == {k: df.attrs[k] for k in v}
    assert jsonable(v) == jsonable(v.to_dict())
