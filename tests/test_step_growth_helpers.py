"""The step-growth notebook's selection (forensics.ladder.small_norm) and its panel grid
(plots.step_growth_grid), on frames written out by hand."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from dmlib import plots  # noqa: E402
from dmlib.errors import DmlibError  # noqa: E402
from dmlib.forensics.ladder import small_norm  # noqa: E402


def _frame() -> pd.DataFrame:
    rows = [
        # pair, step, name, norm, rel_fro
        ("r/a", 10, "w", 5.0, 0.0),
        ("r/a", 10, "b", 0.05, 0.0),
        ("r/a", 10, "g", np.nan, 0.0),
        ("r/a", 20, "w", 0.01, 1e-3),  # small later, not at the first step: not counted
        ("r/a", 20, "b", 0.05, 4e-2),
        ("r/b", 10, "w", 5.0, 0.0),
        ("r/b", 10, "e", 0.09, 0.0),
        ("r/b", 20, "w", 5.0, 0.0),
        ("r/c", 10, "w", 5.0, 0.0),
        ("r/c", 20, "w", 5.0, 2e-5),
    ]
    return pd.DataFrame(rows, columns=["pair", "step", "name", "norm", "rel_fro"])


def test_small_norm_reads_the_first_step_only() -> None:
    assert small_norm(_frame(), 0.1) == (["b", "e"], 10)
    assert small_norm(_frame(), 0.06) == (["b"], 10)
    assert small_norm(_frame(), 0.01) == ([], 10)


def test_small_norm_refuses_a_frame_that_is_not_a_ladder() -> None:
    with pytest.raises(DmlibError, match="no column 'norm'"):
        small_norm(pd.DataFrame({"step": [1], "name": ["w"]}), 0.1)
    with pytest.raises(DmlibError, match="empty"):
        small_norm(_frame().iloc[:0], 0.1)


def test_grid_has_one_titled_panel_per_pair_and_hides_the_rest() -> None:
    fig = plots.step_growth_grid(_frame(), "r", highlight=["b"], highlight_label="norm < 0.1")
    try:
        visible = [ax for ax in fig.axes if ax.get_visible()]
        assert len(fig.axes) == 4 and len(visible) == 3  # 2 x 2, the fourth hidden
        assert [ax.get_title() for ax in visible] == [
            "r/a: max 0.04 at step 20",
            "r/b: bit-identical at every step",
            "r/c: max 2e-05 at step 20",
        ]
        assert (
            fig._suptitle.get_text()
            == "rel_fro of each saved parameter against r, by step (each panel its own y range)"
        )
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert "b (norm < 0.1)" in labels and "other parameters" in labels
    finally:
        plt.close(fig)


def test_grid_of_one_pair_is_one_panel() -> None:
    df = _frame()
    fig = plots.step_growth_grid(df[df["pair"].eq("r/c")], "r")
    try:
        assert len(fig.axes) == 1 and fig.axes[0].get_title() == "r/c: max 2e-05 at step 20"
    finally:
        plt.close(fig)
