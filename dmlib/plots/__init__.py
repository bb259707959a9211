"""Report figures: a tidy DataFrame from dmlib in, a matplotlib ``Axes`` out.

The conventions are seaborn's: ``ax=None`` draws on the current axes, nothing here calls
``show()`` or ``savefig()`` (use :func:`dmlib.report.save_figure`), and nothing here
computes a statistic; every number drawn is a value of the frame passed in. Axis labels
use the statistic's column name, with its meaning and unit, so a figure, a table and the
JSON output all say the same thing.
"""

from __future__ import annotations

from dmlib.plots._base import LABELS, label, ulp_bucket_label
from dmlib.plots.anatomy import layout_map, slot_counts
from dmlib.plots.divergence import (
    first_column_histogram,
    run_matrix_heatmap,
    ulp_histogram,
    ulp_histogram_by_pair,
)
from dmlib.plots.growth import growth_rate_bars, step_growth, step_growth_grid
from dmlib.plots.localize import block_heatmap, boundary_profile
from dmlib.plots.logprobs import logprob_drift

__all__ = [
    "LABELS",
    "block_heatmap",
    "boundary_profile",
    "first_column_histogram",
    "growth_rate_bars",
    "label",
    "layout_map",
    "logprob_drift",
    "run_matrix_heatmap",
    "slot_counts",
    "step_growth",
    "step_growth_grid",
    "ulp_bucket_label",
    "ulp_histogram",
    "ulp_histogram_by_pair",
]
