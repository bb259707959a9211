"""Shared pieces of the plot modules: axis labels per statistic, argument checks, colours."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pandas as pd

from dmlib.errors import DmlibError

__all__ = [
    "LABELS",
    "axes_or_current",
    "floats",
    "label",
    "name_matcher",
    "need",
    "palette",
    "sparse_ticks",
    "ulp_bucket_label",
]


LABELS: dict[str, str] = {
    "rel_fro": "rel_fro = ‖a−b‖_F / ‖a‖_F (relative Frobenius norm)",
    "worst_rel_fro": "worst_rel_fro = largest rel_fro over tensors (relative Frobenius norm)",
    "max_ulp": "max_ulp (ULP)",
    "ulp": "distance (ULP)",
    "max_abs": "max_abs = max |a−b|",
    "first_col": "first_col: first divergent column (index)",
    "step": "step (training steps)",
    "slope": "slope of log10 rel_fro (decades per step)",
    "offset": "byte offset in file (B)",
    "nbytes": "size (B)",
    "count": "count",
    "boundary": "boundary (capture order)",
    "block": "block of positions (rows)",
    "mean_abs_dlogprob": "mean_abs_dlogprob = mean |log p_B − log p_A| (nats)",
    "max_abs_dlogprob": "max_abs_dlogprob = max |log p_B − log p_A| (nats)",
    "k1": "k1 = mean(−log r), r = p_B / p_A (nats)",
    "k2": "k2 = mean((log r)² / 2), r = p_B / p_A",
    "k3": "k3 = mean(r − 1 − log r), r = p_B / p_A (nats)",
    "chi2": "chi2 = mean((r − 1)²), r = p_B / p_A",
    "mean_abs_dp": "mean_abs_dp = mean |p_B − p_A|",
    "frac_over_ln2": "frac_over_ln2 = share of tokens with |log r| > ln 2",
    "delta_norm": "delta_norm = ‖scaling · B A‖_F (the weight a LoRA target adds)",
    "rel_l2": "rel_l2 = ‖a−b‖₂ / ‖a‖₂ over a group's tensors concatenated",
}


def label(column: str) -> str:
    """The axis label for a column (the column name itself when it has no entry)."""
    return LABELS.get(column, column)


def axes_or_current(ax: Any) -> Any:
    if ax is not None:
        return ax
    import matplotlib.pyplot as plt

    return plt.gca()


def need(df: pd.DataFrame, columns: Iterable[str], what: str) -> None:
    if not isinstance(df, pd.DataFrame):
        raise DmlibError(f"{what}: expected a pandas DataFrame, got {type(df).__name__}")
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise DmlibError(f"{what}: missing column(s) {missing}; the frame has {list(df.columns)}")


def palette(n: int) -> list[Any]:
    import seaborn as sns

    return list(sns.color_palette("colorblind", n)) if n > 0 else []


def floats(values: Any) -> np.ndarray:
    """float64 array with missing values (None, pd.NA) as NaN."""
    return (
        pd.to_numeric(pd.Series(values), errors="raise").astype("float64").to_numpy(na_value=np.nan)
    )


def name_matcher(highlight: Any) -> Callable[[str], bool]:
    if highlight is None:
        return lambda name: False
    if isinstance(highlight, (str, re.Pattern)):
        rx = re.compile(highlight)
        return lambda name: rx.search(name) is not None
    if callable(highlight):
        return lambda name: bool(highlight(name))
    names = set(highlight)
    return lambda name: name in names


def sparse_ticks(n: int, keep: Iterable[int] = (), max_labels: int = 30) -> list[int]:
    """About ``max_labels`` evenly spaced positions of ``n``, plus those in ``keep``.

    Regular positions closer than half a step to a kept one are dropped so that the kept
    labels stay legible.
    """
    step = max(1, -(-n // max_labels))
    kept = {k for k in keep if 0 <= k < n}
    regular = {i for i in range(0, n, step) if all(abs(i - k) * 2 >= step for k in kept)}
    return sorted(regular | kept)


_BUCKET = re.compile(r"ulp_(?:(gt_)?(\d+)(?:_(\d+))?|(nonfinite))")


def ulp_bucket_label(bucket: Any) -> str:
    """A ULP bucket's column name in words: ``ulp_3_4`` -> "3-4 ULP", ``ulp_gt_65536`` ->
    "> 65,536 ULP", ``ulp_0`` -> "0 ULP (+0 vs -0)", ``ulp_nonfinite`` -> "NaN or inf"; any
    other name as it is."""
    m = _BUCKET.fullmatch(str(bucket))
    if m is None:
        return str(bucket)
    gt, lo, hi, nonfinite = m.groups()
    if nonfinite:
        return "NaN or inf"
    if gt:
        return f"> {int(lo):,} ULP"
    if hi:
        return f"{int(lo):,}-{int(hi):,} ULP"
    return "0 ULP (+0 vs -0)" if lo == "0" else f"{int(lo):,} ULP"
