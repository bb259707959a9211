"""The one tiling rule the binary readers share (dmlib.io._checks.tiling_problem)."""

from __future__ import annotations

import pytest

from dmlib.io._checks import tiling_problem


def test_exact_tiling_in_any_order_is_accepted():
    # 24 + 16 + 8 bytes back to back, given out of offset order
    assert tiling_problem([(24, 40, "b"), (0, 24, "a"), (40, 48, "c")], 48) is None
    assert tiling_problem([], 0) is None


def test_gap_names_the_tensor_before_it_and_the_bytes():
    got = tiling_problem([(0, 24, "a"), (32, 48, "b")], 48)
    assert got.kind == "gap"
    assert "gap of 8 bytes after tensor 'a'" in got.message
    assert "data offsets 24..32 belong to no tensor" in got.message
    first = tiling_problem([(4, 10, "a")], 10)
    assert first.kind == "gap" and "gap of 4 bytes at the start of the data" in first.message


def test_overlap_names_both_tensors():
    got = tiling_problem([(0, 24, "a"), (16, 32, "b")], 32)
    assert got == ("overlap", "tensors 'a' and 'b' overlap at data offset 16")


def test_out_of_bounds_is_reported_in_file_bytes_before_any_overlap():
    # region of 32 bytes starting at byte 100 of the file; 'b' ends at data offset 40
    got = tiling_problem([(0, 24, "a"), (16, 40, "b")], 32, base=100)
    assert got.kind == "bounds"
    assert got.message == "tensor 'b' ends at byte 140, past the end of the file (132 bytes)"


def test_trailing_bytes_unless_the_end_may_be_followed():
    got = tiling_problem([(0, 8, "a")], 12, base=50)
    assert got == (
        "trailing",
        "4 bytes after the last tensor (data ends at byte 58, the file has 62)",
    )
    assert tiling_problem([(0, 8, "a")], 12, exact_end=False) is None


@pytest.mark.parametrize(
    ("spans", "kind"),
    [
        ([(0, 0, "e"), (0, 8, "a"), (8, 8, "f")], None),  # empty tensors at the seams
        ([(0, 16, "a"), (8, 8, "e")], "overlap"),  # an empty tensor inside another
        ([(0, 8, "a"), (12, 12, "e")], "gap"),  # an empty tensor past the end of the last one
    ],
)
def test_zero_size_tensors(spans, kind):
    got = tiling_problem(spans, max(e for _, e, _ in spans))
    assert (got.kind if got else None) == kind


def test_empty_tensor_inside_another_when_allowed():
    assert tiling_problem([(0, 16, "a"), (8, 8, "e")], 16, empty_may_overlap=True) is None


def test_alignment_padding_is_allowed_and_a_shift_by_one_unit_is_not():
    # 'a' holds 40 bytes: padding to 64 is the writer's; 'b' at 96 leaves 32 bytes unowned
    assert tiling_problem([(0, 40, "a"), (64, 70, "b")], 96, align=32) is None
    got = tiling_problem([(0, 40, "a"), (96, 102, "b")], 128, align=32)
    assert got.kind == "gap" and "gap of 32 bytes after tensor 'a'" in got.message
    off = tiling_problem([(0, 40, "a"), (40, 48, "b")], 48, align=32)
    assert off.kind == "align" and "data offset 40 is not a multiple of the alignment 32" in (
        off.message
    )
    # padding after the last tensor is not trailing data; a whole unit more is
    assert tiling_problem([(0, 40, "a")], 64, align=32) is None
    assert tiling_problem([(0, 40, "a")], 96, align=32).kind == "trailing"
