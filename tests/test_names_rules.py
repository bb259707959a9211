"""Names across frameworks: regular-expression rules and the detected separator / ``.value``
mapping (expected pairings written out by hand)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dmlib
from dmlib.cli import main
from dmlib.errors import DmlibError
from dmlib.names import Rename, detect_mapping, parse_renames

ORBAX = ["model.l1.kernel.value", "model.l1.bias.value", "optimizer.step.value"]
SLASH = ["model/l1/kernel", "model/l1/bias", "optimizer/step"]
DOT = ["model.l1.kernel", "model.l1.bias", "optimizer.step"]


def test_regex_rule_parse_apply_and_spelling():
    r = Rename.parse(r"b:re:/=.")
    assert (r.side, r.old, r.new, r.regex) == ("b", "/", ".", True)
    assert r.apply("a/b/c") == "a.b.c" and str(r) == "b:re:/=."
    g = Rename.parse(r"a:re:^layers_(\d+)\.=blocks.\1.")
    assert g.apply("layers_12.w") == "blocks.12.w" and g.apply("head.w") == "head.w"
    # split at the last '=': a lookahead's '=' stays in the pattern
    la = Rename.parse(r"a:re:x(?=y)=Z")
    assert la.old == "x(?=y)" and la.apply("xy xz") == "Zy xz"
    assert Rename.parse("a:model.=").regex is False  # prefix rules as before
    assert [str(x) for x in parse_renames([r"a:re:\.value$=", "b:=m."])] == [
        r"a:re:\.value$=",
        "b:=m.",
    ]


@pytest.mark.parametrize("spec", ["a:re:(=x", "a:re:=x", "c:re:a=b"])
def test_bad_regex_rules(spec):
    with pytest.raises(DmlibError, match="invalid"):
        Rename.parse(spec)


def test_missing_group_in_replacement():
    with pytest.raises(DmlibError, match="name rule"):
        Rename.parse(r"a:re:x=\2").apply("x")


@pytest.mark.parametrize(
    ("a", "b", "spec"),
    [
        (ORBAX, DOT, r"a:re:\.value$="),
        (ORBAX, SLASH, r"a:re:\.value$= b:re:/=."),
        (DOT, SLASH, "b:re:/=."),
        (SLASH, ORBAX, r"a:re:/=. b:re:\.value$="),
        (["m/l/kernel/value"], ["m.l.kernel"], r"a:re:/=. a:re:\.value$="),
    ],
)
def test_detected_mapping(a, b, spec):
    got = detect_mapping(a, b)
    assert got is not None and got["spec"] == spec
    assert got["shared_before"] == 0 and got["shared_after"] == len(b)


def test_no_mapping_when_names_already_pair_or_rules_collide():
    assert detect_mapping(DOT, DOT) is None
    assert detect_mapping(["x"], ["y"]) is None
    # dropping '.value' would map 'w.value' and 'w' of side A onto one name: refused
    assert detect_mapping(["w.value", "w", "v.value"], ["v"]) is None


def test_ambiguous_is_refused():
    # '/' -> '.' pairs x/y with x.y; dropping '.value' pairs x.y.value with x.y; both rules
    # together map A's two names onto one. Two one-rule answers that differ: nothing renamed
    assert detect_mapping(["x/y", "x.y.value"], ["x.y"]) is None
    # with a third name the two rules together are the one best answer
    got = detect_mapping(["a/b", "c.value"], ["a.b.value", "c", "a.b"])
    assert (
        got is not None and got["spec"] == r"a:re:/=. a:re:\.value$=" and got["shared_after"] == 2
    )


def test_compare_pairs_across_frameworks(tmp_path, capsys):
    rng = np.random.default_rng(0)
    vals = {n: rng.standard_normal(3).astype(np.float32) for n in DOT}
    np.savez(tmp_path / "dot.npz", **vals)
    np.savez(tmp_path / "slash.npz", **{n.replace(".", "/"): v for n, v in vals.items()})
    a, b = str(tmp_path / "dot.npz"), str(tmp_path / "slash.npz")
    assert main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    assert "detected mapping b:re:/=." in out and "0 of 3 compared tensors differ" in out
    assert main(["compare", a, b, "--json"]) == 0
    at = json.loads(capsys.readouterr().out)["attrs"]
    assert at["rename"] == ["b:re:/=."] and at["rename_detected"] is True
    # an explicit rule replaces detection
    rule = r"b:re:^(model)/(l1)/=\1.\2."
    assert main(["compare", a, b, "--rename", rule, "--json"]) == 1
    at = json.loads(capsys.readouterr().out)["attrs"]
    assert at["rename_detected"] is False and at["rename"] == [rule]
    assert at["only_in_a"] == ["optimizer.step"] and at["only_in_b"] == ["optimizer/step"]
    df = dmlib.compare(tmp_path / "dot.npz", tmp_path / "slash.npz", rename="b:re:/=.")
    assert sorted(df["name"]) == sorted(DOT) and (df["n_diff"] == 0).all()
