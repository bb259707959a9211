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
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1", "2-3"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["p1/p2", "p1/seed8"]
    assert "ULP" in ax.get_xlabel()


def test_first_column_histogram_counts(ax):
    df = pd.DataFrame(
        {"first_col": pd.array([0, 2, 2, None, 5, None, 2], dtype="Int64"), "n_cols": [8] * 7}
    )
    plot.first_column_histogram(df, ax=ax)
    # hand count: column 0 once, column 2 three times, column 5 once, over 8 columns
    assert _bar_heights(ax) == [1, 0, 3, 0, 0, 1, 0, 0]
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
