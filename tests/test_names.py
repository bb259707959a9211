"""Name mapping between two sets (dmlib/names.py) and the hints compare gives."""

from __future__ import annotations

import numpy as np
import pytest

import dmlib
from dmlib.cli import main
from dmlib.names import Rename, mapped_names, parse_renames, suggest_alignment
from dmlib.tensor import ArrayTensorSet


@pytest.mark.parametrize(
    ("a", "b", "spec", "after"),
    [
        (["module.fc.w", "module.fc.b"], ["fc.w", "fc.b"], "a:module.=", 2),
        (["fc.w", "fc.b"], ["_orig_mod.fc.w", "_orig_mod.fc.b"], "b:_orig_mod.=", 2),
        (["model.enc.w", "model.dec.w", "opt.x"], ["enc.w", "dec.w"], "a:model.=", 2),
        (["net.a", "net.b"], ["body.a", "body.b"], "a:net.= b:body.=", 2),  # any first component
    ],
)
def test_suggest_alignment(a, b, spec, after):
    s = suggest_alignment(a, b)
    assert s["spec"] == spec and s["shared_before"] == 0 and s["shared_after"] == after


def test_no_alignment_when_nothing_pairs_more():
    assert suggest_alignment(["a.x"], ["a.x"]) is None
    assert suggest_alignment(["p.x"], ["q.y"]) is None


def test_rename_parsing_and_application():
    r = Rename.parse("b:=module.")
    assert (r.side, r.old, r.new) == ("b", "", "module.") and r.apply("fc.w") == "module.fc.w"
    assert Rename.parse("a:model.=").apply("other.w") == "other.w"  # not under the prefix
    assert parse_renames(("a", "x.", "y.")) == [Rename("a", "x.", "y.")]
    for bad in ("a:=", "c:x=y", "ax=y", "a:x"):
        with pytest.raises(dmlib.DmlibError, match="invalid name mapping"):
            Rename.parse(bad)
    with pytest.raises(dmlib.DmlibError, match="maps both 'model.w' and 'w'"):
        mapped_names(["model.w", "w"], [Rename("a", "model.", "")], "a")


def test_partial_overlap_gets_a_note(capsys, tmp_path):
    x = np.arange(4, dtype=np.float32)
    a = {"model.x": x, "y": x, "model.z": x}
    b = {"x": x, "y": x, "z": x}
    df = dmlib.compare(ArrayTensorSet(a), ArrayTensorSet(b))
    assert df.attrs["alignment_hint"] == {
        "spec": "a:model.=",
        "shared_before": 1,
        "shared_after": 3,
    }
    np.savez(tmp_path / "a.npz", **a)
    np.savez(tmp_path / "b.npz", **b)
    assert main(["compare", str(tmp_path / "a.npz"), str(tmp_path / "b.npz")]) == 1
    out = capsys.readouterr().out
    assert "note: only 1 names are shared; mapping a:model.= would pair 3" in out
    assert "not compared: 2 only in A, 2 only in B" in out.splitlines()[-1]
    assert (
        main(["compare", str(tmp_path / "a.npz"), str(tmp_path / "b.npz"), "--rename", "a:model.="])
        == 0
    )
    assert capsys.readouterr().out.splitlines()[-1].startswith("IDENTICAL: 0 of 3 compared")


def test_cli_selection_errors(capsys, tmp_path):
    x = np.arange(4, dtype=np.float32)
    np.savez(tmp_path / "a.npz", fc_w=x, fc_b=x)
    np.savez(tmp_path / "b.npz", fc_w=x, fc_b=x)
    a, b = str(tmp_path / "a.npz"), str(tmp_path / "b.npz")
    before = [(tmp_path / n).read_bytes() for n in ("a.npz", "b.npz")]
    cases = [
        (["compare", a, b, "--include", "fc", "--exclude", "fc_"], "leaves no tensor"),
        (["matrix", f"p1={a}", f"p2={b}", "--include", "fc_q"], "'fc_q' matches no tensor name"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert [(tmp_path / n).read_bytes() for n in ("a.npz", "b.npz")] == before
