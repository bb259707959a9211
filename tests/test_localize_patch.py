"""patch_test confirms the planted cause, and refuses to confirm anything else."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from _support.opsmodel import Net, layout  # noqa: E402

import dmlib  # noqa: E402
from dmlib.errors import CaptureError  # noqa: E402
from dmlib.localize.patch import patch_test  # noqa: E402

QUIRK_OP = "model.quirk/dmtest.batch_round#0"


def source(model, path, **kw):
    x, rows = layout("alone")
    with torch.no_grad(), dmlib.capture(model, path, row_map=rows, modules="*", ops=True,
                                        dump="*", dump_requests=["q"], block_rows=4, **kw):  # fmt: skip
        model(x)
    return path


def packed_run(model):
    x, rows = layout("packed")

    def run():
        with torch.no_grad():
            return model(x)

    return rows, run


@pytest.fixture
def model():
    return Net()


@pytest.mark.parametrize("boundary", [QUIRK_OP, "model.quirk"])
def test_patch_at_the_plant_is_confirmed(model, tmp_path, boundary):
    src = source(model, tmp_path / "src")
    rows, run = packed_run(model)
    res = patch_test(model, source=src, boundary=boundary, request="q", row_map=rows, run=run)
    assert res.confirmed and bool(res) and res.first_still_differing is None
    t = res.table.set_index("boundary")
    assert t.loc[boundary, "identical_before"] == False  # noqa: E712  (pd.NA-aware)
    assert t.loc[boundary, "identical_after"] == True  # noqa: E712
    later = res.table[res.table["after_patch"]]
    assert len(later) > 5 and later["identical_after"].dropna().all()
    # without the patch those later boundaries differed: the patch made the difference
    assert not later["identical_before"].dropna().all()
    assert "confirmed" in str(res)


def test_patch_at_an_already_matching_boundary_is_not_confirmed(model, tmp_path):
    src = source(model, tmp_path / "src")
    rows, run = packed_run(model)
    res = patch_test(model, source=src, boundary="model.stage1", request="q", row_map=rows,
                     run=run)  # fmt: skip
    assert res.confirmed is False and not res
    assert "already matched" in res.reason
    assert res.first_still_differing == QUIRK_OP  # the plant still fires downstream


def test_second_cause_downstream_is_reported(model, tmp_path):
    model.model.mixer.active = True  # a second plant, float16 accumulation, after the first
    src = source(model, tmp_path / "src")
    rows, run = packed_run(model)
    res = patch_test(model, source=src, boundary=QUIRK_OP, request="q", row_map=rows, run=run)
    assert res.confirmed is False and "downstream" in res.reason
    assert res.first_still_differing == "model.mixer/dmtest.rowsum#0"
    # patching only the second cause leaves its input differing (the first plant): the
    # patched rows match, but everything after still carries the first difference
    res2 = patch_test(model, source=src, boundary="model.mixer/dmtest.rowsum#0", request="q",
                      row_map=rows, run=run)  # fmt: skip
    assert res2.confirmed is False and res2.first_still_differing is not None
    t2 = res2.table.set_index("boundary")
    assert t2.loc["model.mixer/dmtest.rowsum#0", "identical_after"] == True  # noqa: E712
    assert t2.loc["model.mixer:input0", "identical_after"] == False  # noqa: E712


def test_bad_patch_requests(model, tmp_path):
    x, rows = layout("alone")
    with torch.no_grad(), dmlib.capture(model, tmp_path / "h", row_map=rows, modules="*"):
        model(x)  # hashes only: nothing to patch with
    rows_p, run = packed_run(model)
    with pytest.raises(CaptureError, match="not dumped"):
        patch_test(model, source=tmp_path / "h", boundary="model.quirk", request="q",
                   row_map=rows_p, run=run)  # fmt: skip
    src = source(model, tmp_path / "src")
    with pytest.raises(CaptureError, match="not a first output"):
        patch_test(model, source=src, boundary=QUIRK_OP + ":input0", request="q",
                   row_map=rows_p, run=run)  # fmt: skip
    with pytest.raises(CaptureError, match="not in the row map"):
        patch_test(model, source=src, boundary=QUIRK_OP, request="zz", row_map=rows_p, run=run)


class Outer(torch.nn.Module):
    """The plant in a child and the same custom op again in the parent, after it."""

    def __init__(self):
        super().__init__()
        self.child = Quirky()

    def forward(self, x):
        h = self.child(x)
        return torch.ops.dmtest.batch_round(h * 0.5) + 1.0


class Quirky(torch.nn.Module):
    def forward(self, x):
        return torch.ops.dmtest.batch_round(x)


def test_patched_op_is_counted_as_the_capture_names_it(tmp_path):
    m = Outer()
    x, rows = layout("alone")
    with torch.no_grad(), dmlib.capture(m, tmp_path / "src", modules=["", "child"], ops=True,
                                        row_map=rows, dump="*", dump_requests=["q"]):  # fmt: skip
        m(x)
    target = "(model)/dmtest.batch_round#0"  # the parent's own call, the second one to run
    assert dmlib.open_capture(tmp_path / "src").boundary(target).index > dmlib.open_capture(
        tmp_path / "src").boundary("child/dmtest.batch_round#0").index  # fmt: skip
    rows_p, run = packed_run(m)
    res = patch_test(m, source=tmp_path / "src", boundary=target, request="q", row_map=rows_p,
                     run=run)  # fmt: skip
    t = res.table.set_index("boundary")
    # the child's op still differs (not patched); the parent's matches; everything after too
    assert t.loc["child/dmtest.batch_round#0", "identical_after"] == False  # noqa: E712
    assert t.loc[target, "identical_after"] == True  # noqa: E712
    assert res.confirmed and res.first_still_differing is None


def test_patching_both_causes_at_once_is_confirmed(model, tmp_path):
    model.model.mixer.active = True  # two plants: float16 rounding, then float16 accumulation
    src = source(model, tmp_path / "src")
    rows, run = packed_run(model)
    both = [QUIRK_OP, "model.mixer/dmtest.rowsum#0"]
    res = patch_test(model, source=src, boundary=both, request="q", row_map=rows, run=run)
    assert res.confirmed and res.boundary == ", ".join(both)
    t = res.table.set_index("boundary")
    assert not t.loc[both, "after_patch"].any() and t.loc[both, "identical_after"].all()
    # a boundary that already matched among them is skipped, and the result says so
    res2 = patch_test(model, source=src, boundary=["model.stage1", *both], request="q",
                      row_map=rows, run=run)  # fmt: skip
    assert res2.confirmed, res2.reason
    assert "skipped 1 that already matched the source: model.stage1" in res2.reason
    assert res2.table.attrs["skipped"] == ["model.stage1"]
    with pytest.raises(CaptureError, match="distinct"):
        patch_test(model, source=src, boundary=[QUIRK_OP, QUIRK_OP], request="q", row_map=rows,
                   run=run)  # fmt: skip
