"""The plot functions draw exactly the values of the frame passed in (artists, not pixels)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PolyCollection

from dmlib import plots as plot
from dmlib.errors import DmlibError


@pytest.fixture
def ax():
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def _bar_heights(ax) -> list[float]:
    return [p.get_height() for p in ax.patches]


def _bar_widths(ax) -> list[float]:
    return [p.get_width() for p in ax.patches]


def _spans(coll) -> list[tuple[float, float]]:
    """(x start, width) of every rectangle of a broken_barh collection."""
    out = []
    for path in coll.get_paths():
        xs = path.vertices[:, 0]
        out.append((float(xs.min()), float(xs.max() - xs.min())))
    return out


def test_ax_none_draws_on_current_axes():
    fig, ax = plt.subplots()
    try:
        df = pd.DataFrame({"bucket": ["0", "1"], "count": [5, 7], "pair": ["p", "p"]})
        assert plot.ulp_histogram(df) is ax
    finally:
        plt.close(fig)


def test_layout_map_spans_are_offsets_and_sizes(ax):
    table = pd.DataFrame(
        {
            "name": ["a", "b", "c"],
            "offset": [256, 512, 2048],
            "nbytes": [12, 1000, 4],
            "record": [0, 0, 1],
        }
    )
    gaps = pd.DataFrame(
        {
            "start": [268, 1512],
            "nbytes": [244, 536],
            "nonzero_bytes": [0, 3],
            "kind": ["between-tensors"] * 2,
        }
    )
    plot.layout_map(table, gaps, ax=ax)
    colls = [c for c in ax.collections if isinstance(c, PolyCollection)]
    labels = [c.get_label() for c in colls]
    assert labels == [
        "tensors, record 0",
        "tensors, record 1",
        "padding, all zero (1 gap)",
        "padding, non-zero bytes (1 gap)",
    ]
    assert _spans(colls[0]) == [(256.0, 12.0), (512.0, 1000.0)]
    assert _spans(colls[1]) == [(2048.0, 4.0)]
    assert _spans(colls[2]) == [(268.0, 244.0)]
    assert _spans(colls[3]) == [(1512.0, 536.0)]
    assert ax.get_xlabel() == "byte offset in file (B)"
    fmt = ax.xaxis.get_major_formatter()
    assert fmt(1.5e6, 0) == "1.5 MB" and fmt(512, 0) == "512 B"  # a unit, no "1e6" corner
    assert ax.get_title()


def test_slot_counts_bar_heights(ax):
    slots = pd.DataFrame(
        {
            "record": [0, 1],
            "flat_slots": [100, 50],
            "named_slots": [90, 50],
            "padding_slots": [10, 0],
            "nan": [2, 0],
        }
    )
    plot.slot_counts(slots, ax=ax)
    # bars are drawn column by column, record by record
    assert _bar_heights(ax) == [100, 50, 90, 50, 10, 0, 2, 0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "flat_slots",
        "named_slots",
        "padding_slots",
        "nan",
    ]
    assert ax.get_ylabel() == "4-byte slots (count)"


def test_ulp_histogram_bars_per_hue(ax):
    df = pd.DataFrame(
        {
            "pair": ["p1/p2"] * 3 + ["p1/seed8"] * 3,
            "bucket": ["0", "1", "2-3"] * 2,
            "count": [1000, 20, 3, 1, 2, 5000],
        }
    )
    plot.ulp_histogram(df, ax=ax)
    assert _bar_heights(ax) == [1000, 20, 3, 1, 2, 5000]
    assert ax.get_yscale() == "log"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2-3"]  # not ulp_*: as is
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["p1/p2", "p1/seed8"]
    assert "ULP" in ax.get_xlabel()


def test_first_column_histogram_counts(ax):
    df = pd.DataFrame(
        {"first_col": pd.array([0, 2, 2, None, 5, None, 2], dtype="Int64"), "n_cols": [8] * 7}
    )
    plot.first_column_histogram(df, ax=ax)
    # hand count: column 0 once, column 2 three times, column 5 once, over 8 columns; the
    # axis ends at column 5, the last where a pair first diverges, and says so
    assert _bar_heights(ax) == [1, 0, 3, 0, 0, 1]
    assert [t.get_text() for t in ax.texts] == ["1", "", "3", "", "", "1"]  # counts on bars
    assert 5 < ax.get_xlim()[1] < 6
    assert ax.get_xlabel().endswith("of 8 columns, none first diverges after column 5")
    assert "2 of 7" in ax.get_title()


def test_step_growth_lines_and_highlight(ax):
    df = pd.DataFrame(
        {
            "step": [0, 5, 20, 0, 5, 20],
            "name": ["norm.beta"] * 3 + ["fc.weight"] * 3,
            "rel_fro": [1e-8, 4.7e-8, 6.4e-3, 0.0, 1e-7, 2e-6],
        }
    )
    plot.step_growth(df, highlight=r"norm\.beta", ax=ax)
    lines = ax.get_lines()
    assert len(lines) == 2
    np.testing.assert_array_equal(lines[0].get_xdata(), [0, 5, 20])
    np.testing.assert_array_equal(lines[0].get_ydata(), [1e-8, 4.7e-8, 6.4e-3])
    # an exact zero cannot sit on a log axis: it is left out as a gap
    np.testing.assert_array_equal(lines[1].get_ydata(), [np.nan, 1e-7, 2e-6])
    assert lines[0].get_linewidth() > lines[1].get_linewidth()
    assert ax.get_yscale() == "log"
    assert ax.get_ylabel().startswith("rel_fro")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "norm.beta (highlighted)",
        "other parameters",
    ]


def test_growth_rate_bars(ax):
    rates = pd.DataFrame(
        {"pair": ["base/repeat"] * 2, "group": ["small-norm", "large"], "slope": [0.25, 0.05]}
    )
    plot.growth_rate_bars(rates, ax=ax)
    assert _bar_widths(ax) == [0.25, 0.05]


def test_growth_rate_bars_name_a_pair_without_a_rate(ax):
    rates = pd.DataFrame(
        {
            "pair": ["base/x", "base/x", "base/repeat", "base/repeat"],
            "group": ["bias", "weight", "bias", "weight"],
            "slope": [0.25, 0.05, np.nan, np.nan],  # the repeat: bit-identical, nothing to fit
        }
    )
    plot.growth_rate_bars(rates, ax=ax)
    assert _bar_widths(ax) == [0.25, 0.05]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["base/x"]
    assert [t.get_text() for t in ax.texts] == [
        "no rate (rel_fro > 0 at fewer than two steps): base/repeat"
    ]


def test_run_matrix_heatmap_array(ax):
    pairs = pd.DataFrame(
        {
            "a": ["p1", "p1", "p2", "p1", "p2"],
            "b": ["p2", "p3", "p3", "seed8", "seed8"],
            "rel_fro": [1.0e-6, 0.0, 9.1e-7, 1.415, 1.41],
        }
    )
    plot.run_matrix_heatmap(pairs, ax=ax, order=["p1", "p2", "p3", "seed8"])
    arr = np.ma.getdata(ax.images[0].get_array())
    nan = np.nan
    expected = np.array(
        [
            [nan, 1.0e-6, 0.0, 1.415],
            [1.0e-6, nan, 9.1e-7, 1.41],
            [0.0, 9.1e-7, nan, nan],
            [1.415, 1.41, nan, nan],
        ]
    )
    np.testing.assert_array_equal(arr, expected)
    texts = {(t.get_position()): t.get_text() for t in ax.texts}
    assert texts[(2, 0)] == "0"  # the bit-identical pair is printed as an exact zero
    assert texts[(1, 0)] == "1e-06"
    assert texts[(0, 0)] == "—" and (3, 2) not in texts  # diagonal marked, absent pair blank
    assert ax.get_title() == "rel_fro over all pairs of runs"


def test_boundary_profile_lines_and_marker(ax):
    df = pd.DataFrame(
        {
            "comparison": ["alone/packed"] * 4 + ["alone/alone_repeat"] * 4,
            "boundary": ["embed", "layer0", "layer1", "final"] * 2,
            # a boundary without element statistics is missing, not zero
            "rel_fro": pd.array([0.0, 0.0, 4.2e-3, None, 0.0, 0.0, 0.0, 0.0], dtype="Float64"),
        }
    )
    plot.boundary_profile(
        df, first_divergent={"alone/packed": "layer1", "alone/alone_repeat": None}, ax=ax
    )
    lines = ax.get_lines()
    np.testing.assert_array_equal(lines[0].get_xdata(), [0, 1, 2, 3])
    np.testing.assert_array_equal(lines[0].get_ydata(), [0.0, 0.0, 4.2e-3, np.nan])
    np.testing.assert_array_equal(lines[1].get_ydata(), [0.0] * 4)
    # the first divergent boundary, third in capture order (x = 2), is a vertical line
    vlines = [ln for ln in lines[2:] if ln.get_xdata()[0] == ln.get_xdata()[1]]
    assert len(vlines) == 1 and vlines[0].get_xdata()[0] == 2
    assert "layer1" in vlines[0].get_label()
    assert ax.get_ylabel().startswith("rel_fro")


def test_boundary_profile_labels_stay_readable_and_keep_the_marked_one(ax):
    names = [f"b{i}" for i in range(200)]
    df = pd.DataFrame({"boundary": names, "rel_fro": [0.0] * 137 + [1e-3] * 63, "comparison": "x"})
    plot.boundary_profile(df, first_divergent={"x": "b137"}, max_labels=20, ax=ax)
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert len(labels) <= 22 and "b137" in labels and "b0" in labels


def test_block_heatmap_array(ax):
    # the shape of compare_captures' output: differing blocks, and those new at the boundary
    df = pd.DataFrame(
        {
            "boundary": ["embed", "pos", "attn", "dense"],
            "identical": pd.array([True, None, False, False], dtype="boolean"),
            "diff_blocks": [[], [], [0, 2], [0, 1, 2]],
            "new_blocks": [[], [], [0, 2], [1]],
        }
    )
    plot.block_heatmap(
        df, n_blocks=4, block_labels=["[0,8)", "[8,16)", "[16,24)", "[24,30)"], ax=ax
    )
    expected = np.array([[0, 0, 0, 0], [np.nan] * 4, [2, 0, 2, 0], [1, 2, 1, 0]])
    np.testing.assert_array_equal(np.ma.getdata(ax.images[0].get_array()), expected)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["[0,8)", "[8,16)", "[16,24)", "[24,30)"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "same",
        "differs, inherited",
        "differs, new here",
        "not comparable",
    ]


def test_missing_column_is_a_dmlib_error(ax):
    with pytest.raises(DmlibError, match="missing column"):
        plot.run_matrix_heatmap(pd.DataFrame({"a": ["x"], "b": ["y"]}), ax=ax)


def test_plot_functions_do_not_save_or_show(monkeypatch, ax):
    def boom(*a, **k):  # pragma: no cover - fails the test if reached
        raise AssertionError("plot functions must not save or show")

    monkeypatch.setattr(plt, "show", boom)
    monkeypatch.setattr(plt.Figure, "savefig", boom)
    df = pd.DataFrame({"step": [0, 1], "name": ["w", "w"], "rel_fro": [1e-7, 1e-6]})
    plot.step_growth(df, ax=ax)


def test_ulp_buckets_labelled_in_words(ax):
    names = ["ulp_0", "ulp_1", "ulp_3_4", "ulp_32769_65536", "ulp_gt_65536", "ulp_nonfinite"]
    df = pd.DataFrame({"bucket": names, "count": [1, 2, 3, 4, 5, 6], "pair": "a/b"})
    plot.ulp_histogram(df, ax=ax)
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "0 ULP (+0 vs -0)",
        "1 ULP",
        "3-4 ULP",
        "32,769-65,536 ULP",
        "> 65,536 ULP",
        "NaN or inf",
    ]


def test_ulp_histogram_by_pair_keeps_a_bit_identical_pair_apart(ax):
    # three pairs: a/b and a/c differ, b/c is bit-identical (all counts 0); pooled, b/c
    # would vanish into the sum; here it draws no line and is named on the axes
    buckets = ["ulp_1", "ulp_2", "ulp_3_4"]
    df = pd.DataFrame(
        {
            "pair": ["a/b"] * 3 + ["b/c"] * 3 + ["a/c"] * 3,
            "group": ["same"] * 6 + ["control"] * 3,
            "bucket": buckets * 3,
            "count": [7, 0, 2, 0, 0, 0, 0, 0, 9],
        }
    )
    plot.ulp_histogram_by_pair(df, ax=ax)
    lines = ax.get_lines()
    assert len(lines) == 2  # one per differing pair
    np.testing.assert_array_equal(lines[0].get_ydata(), [7, np.nan, 2])  # a zero is a gap
    np.testing.assert_array_equal(lines[1].get_ydata(), [np.nan, np.nan, 9])
    assert lines[0].get_color() != lines[1].get_color()  # coloured by group
    assert [t.get_text() for t in ax.texts] == ["bit-identical (no line): b/c"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "same: 1 differing, one line each",
        "control: 1 differing, one line each",
    ]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["1 ULP", "2 ULP", "3-4 ULP"]


def test_run_matrix_heatmap_colour_scale_spans_decades_and_says_all_equal(ax):
    # no control, three pairs equal to display precision (the case of 1.21001e-6 vs
    # 1.21002e-6, drawn purple against yellow by a min-max scale)
    pairs = pd.DataFrame(
        {
            "a": ["p1", "p1", "p2"],
            "b": ["p2", "p3", "p3"],
            "rel_fro": [1.21001e-6, 1.21002e-6, 1.21001e-6],
        }
    )
    plot.run_matrix_heatmap(pairs, ax=ax)
    norm = ax.images[0].norm
    assert (norm.vmin, norm.vmax) == (1e-6, 1e-5)  # the whole decade holding the values
    assert abs(float(norm(1.21002e-6)) - float(norm(1.21001e-6))) < 1e-4  # the same colour
    assert ax.get_title().endswith("all 3 non-zero pairs equal at the precision shown (1.2e-06)")


def test_run_matrix_heatmap_decades_over_a_wide_range(ax):
    pairs = pd.DataFrame(
        {"a": ["p1", "p1", "p2"], "b": ["p2", "c", "c"], "rel_fro": [3e-7, 1.6, 1.5]}
    )
    plot.run_matrix_heatmap(pairs, ax=ax)
    norm = ax.images[0].norm
    assert (norm.vmin, norm.vmax) == (1e-7, 10.0)
    assert "equal" not in ax.get_title()


def test_run_matrix_heatmap_names_a_pair_that_compared_nothing(ax):
    # the control c shares no tensor name with the others: its pairs compared 0 elements
    pairs = pd.DataFrame(
        {
            "a": ["p1", "p1", "p2"],
            "b": ["p2", "c", "c"],
            "worst_rel_fro": [2e-7, np.nan, np.nan],
            "numel": [10, 0, 0],
        }
    )
    plot.run_matrix_heatmap(pairs, value="worst_rel_fro", compared="numel", ax=ax)
    arr = np.ma.getdata(ax.images[0].get_array())
    assert np.isnan(arr[2, 0]) and np.isnan(arr[0, 2]) and arr[1, 0] == 2e-7
    texts = {t.get_position(): t.get_text() for t in ax.texts}
    assert texts[(0, 2)] == texts[(2, 0)] == texts[(1, 2)] == "nothing\ncompared"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["p1", "p2", "c\n(nothing compared)"]


def test_step_growth_outlier_marked_not_stretching_the_axis(ax):
    # one 2-ULP point at 1e-38 among values from 1e-9 to 1e-3
    steps = list(range(8))
    rel = [1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 2e-3]
    df = pd.DataFrame(
        {
            "step": steps * 2 + [1],
            "name": ["w"] * 8 + ["b"] * 8 + ["tiny"],
            "rel_fro": rel + rel + [1.4e-38],
        }
    )
    plot.step_growth(df, ax=ax)
    lo, hi = ax.get_ylim()
    assert 1e-11 < lo < 1e-9 and 2e-3 < hi < 1e-1  # the bulk's decades, padded
    (mark,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("below the axis")]
    np.testing.assert_array_equal(mark.get_xdata(), [1])
    assert mark.get_ydata()[0] == lo and not mark.get_clip_on()
    assert [t.get_text() for t in ax.texts] == ["1.4e-38 at step 1, below the axis"]
    # the line keeps the value: only the axis leaves it out
    (tiny,) = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [1]][:1]
    assert list(tiny.get_ydata()) == [1.4e-38]


def test_step_growth_low_points_that_are_many_are_not_outliers(ax):
    # half the points near 1e-38: the data, not an outlier, so the axis reaches them
    df = pd.DataFrame(
        {"step": [0, 1, 2, 3], "name": ["w"] * 4, "rel_fro": [1e-38, 2e-38, 1e-6, 1e-5]}
    )
    plot.step_growth(df, ax=ax)
    assert ax.get_ylim()[0] < 1e-38
    assert not [ln for ln in ax.get_lines() if ln.get_label().startswith("below the axis")]


def test_step_growth_grid_panels_have_their_own_y_range():
    df = pd.DataFrame(
        {
            "pair": ["r/x"] * 2 + ["r/y"] * 2 + ["r/z"] * 2,
            "step": [1, 2] * 3,
            "name": ["w"] * 6,
            "rel_fro": [1e-8, 1e-7, 1e-3, 1e-2, 0.0, 0.0],
        }
    )
    fig = plot.step_growth_grid(df, "r", ncols=3)
    try:
        ax_x, ax_y, ax_z = fig.axes[:3]
        assert 1e-9 < ax_x.get_ylim()[0] < 1e-8 and 1e-7 < ax_x.get_ylim()[1] < 1e-6
        assert 1e-4 < ax_y.get_ylim()[0] < 1e-3 and 1e-2 < ax_y.get_ylim()[1] < 1e-1
        assert not ax_z.get_yticks().size  # bit-identical throughout: no scale to read
        assert "bit-identical" in ax_z.texts[0].get_text()
    finally:
        plt.close(fig)


def test_boundary_profile_hash_only_differences_are_unknown_not_zero(ax):
    # four boundaries; "b1" and "b3" differ by hash but their rows were not dumped: their
    # rel_fro is unknown (NaN), drawn in a band at the top, never at 0
    df = pd.DataFrame(
        {
            "comparison": ["ref vs x"] * 4 + ["ref vs rep"] * 4,
            "boundary": ["b0", "b1", "b2", "b3"] * 2,
            "identical": pd.array([True, False, False, False] + [True] * 4, dtype="boolean"),
            "rel_fro": pd.array([0.0, None, 3e-7, None, 0.0, 0.0, 0.0, 0.0], dtype="Float64"),
        }
    )
    plot.boundary_profile(df, ax=ax)
    lines = ax.get_lines()
    np.testing.assert_array_equal(lines[0].get_ydata(), [0.0, np.nan, 3e-7, np.nan])
    (band,) = [ln for ln in lines if "size unknown" in ln.get_label()]
    np.testing.assert_array_equal(band.get_xdata(), [1, 3])
    assert band.get_label().startswith("ref vs x: differs, size unknown (hash only, not dumped): 2")
    # y in axes coordinates: at the top of the axes whatever the data's scale
    assert all(0.9 < y <= 1.0 for y in band.get_ydata())
    assert band.get_transform().contains_branch_seperately(ax.transAxes)[1]
    assert band.get_color() == lines[0].get_color()
    # the repeat (identical everywhere) has no unknown boundary and no band row
    assert sum("size unknown" in ln.get_label() for ln in lines) == 1
