"""plots.logprob_drift draws exactly the frame's values: a line per run, the control's band."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PolyCollection

from dmlib import plots
from dmlib.errors import DmlibError


@pytest.fixture
def ax():
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def frame() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "run": ["policy"] * 3 + ["lr0"] * 3,
            "step": [0, 5, 10, 0, 5, 10],
            "is_control": [False] * 3 + [True] * 3,
            "k3": [1e-6, 4e-6, np.nan, 1e-6, 1.5e-6, 1e-6],
        }
    )


def test_lines_and_the_control_band(ax) -> None:
    plots.logprob_drift(frame(), ax=ax)
    (line,) = [ln for ln in ax.get_lines() if ln.get_label() == "policy"]
    assert list(line.get_xdata()) == [0, 5, 10]
    got = np.asarray(line.get_ydata(), dtype=float)
    assert got[:2].tolist() == [1e-6, 4e-6] and np.isnan(got[2])  # a gap, not a zero
    (band,) = [c for c in ax.collections if isinstance(c, PolyCollection)]
    assert band.get_label() == "control lr0"
    verts = band.get_paths()[0].vertices
    top = {(float(x), float(y)) for x, y in verts if y > 0}
    assert top == {(0.0, 1e-6), (5.0, 1.5e-6), (10.0, 1e-6)}
    assert ax.get_ylabel().startswith("k3 = mean(r − 1 − log r)")


def test_missing_column_is_refused(ax) -> None:
    with pytest.raises(DmlibError, match="missing column"):
        plots.logprob_drift(frame().drop(columns="is_control"), ax=ax)
