"""dmlib.sources: one opener that closes only what it opened; one pattern rule."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import dmlib
from dmlib.errors import DmlibError
from dmlib.sources import name_filter, open_source, opened, patterns, select
from dmlib.tensor import TensorSet

W = np.arange(6, dtype="<f4").reshape(2, 3)


def test_a_path_is_opened_and_closed(tmp_path):
    path = tmp_path / "m.safetensors"
    dmlib.write_safetensors(path, {"w": W})
    with opened(path) as ts:
        assert isinstance(ts, TensorSet) and ts.path == str(path)
        np.testing.assert_array_equal(ts["w"].load(), W)
    with pytest.raises(DmlibError, match="closed"):
        ts["w"].load()  # opened here, closed here


def test_a_tensor_set_passed_in_stays_open(tmp_path):
    path = tmp_path / "m.safetensors"
    dmlib.write_safetensors(path, {"w": W})
    with dmlib.open_tensors(path) as mine:
        with opened(mine) as ts:
            assert ts is mine
        np.testing.assert_array_equal(mine["w"].load(), W)  # its owner closes it


def test_open_source_closes_on_stack_exit(tmp_path):
    path = tmp_path / "m.safetensors"
    dmlib.write_safetensors(path, {"w": W})
    with contextlib.ExitStack() as stack:
        ts = open_source(str(path), stack)
        np.testing.assert_array_equal(ts["w"].load(), W)
    with pytest.raises(DmlibError, match="closed"):
        ts["w"].load()


def test_a_mapping_of_arrays_is_a_tensor_set():
    with opened({"w": W.tolist()}) as ts:
        assert list(ts) == ["w"]
        np.testing.assert_array_equal(ts["w"].load(), W)


def test_anything_else_is_refused_naming_its_type():
    with pytest.raises(DmlibError, match="cannot read tensors from a int"):
        with opened(3):  # type: ignore[arg-type]
            pass


def test_patterns_and_selection_by_hand():
    assert patterns(None) == [] and patterns("a") == ["a"] and patterns(("a", "b")) == ["a", "b"]
    names = ["enc.0.w", "enc.0.b", "enc.1.w", "head.w"]
    assert select(names) == names
    assert select(names, "*.w") == ["enc.0.w", "enc.1.w", "head.w"]
    assert select(names, "re:^enc", exclude="re:\\.1\\.") == ["enc.0.w", "enc.0.b"]
    keep = name_filter(["head.*", "*.b"], exclude="enc.*")
    assert [n for n in names if keep(n)] == ["head.w"]
    with pytest.raises(DmlibError, match="bad regular expression"):
        name_filter("re:(")


def test_plain_patterns_are_substrings_and_globs_whole_names():
    names = ["enc.0.w", "enc.0.b", "enc.10.w", "head.w"]
    assert select(names, "enc.0") == ["enc.0.w", "enc.0.b"]  # no glob characters: substring
    assert select(names, ".w") == ["enc.0.w", "enc.10.w", "head.w"]
    assert select(names, "enc.?.w") == ["enc.0.w"]  # glob: the whole name
    assert select(names, "enc") == ["enc.0.w", "enc.0.b", "enc.10.w"]
    assert select(names, "enc*") == ["enc.0.w", "enc.0.b", "enc.10.w"]
    assert select(names, "[eh]*.w", exclude="10") == ["enc.0.w", "head.w"]


def test_a_selection_over_nothing_is_refused():
    from dmlib.sources import check_selection

    with pytest.raises(
        DmlibError, match="'atn' matches no tensor name in a.pt or b.pt .*closest names: attn.q"
    ):
        check_selection(["attn.q", "mlp.w"], ["attn.q"], "atn", None, "a.pt", "b.pt")
    with pytest.raises(DmlibError, match="leaves no tensor"):
        check_selection(["attn.q"], [], "attn", "q", "a.pt")
    check_selection(["attn.q"], [], "attn", None, "a.pt")  # fine: returns quietly
