"""Every pair of several runs, compared at once, and the verdict a reproducibility study needs.

Same-seed runs should differ far less than a different-seed control. :func:`matrix`
compares all pairs into one long-form DataFrame and :func:`verdict` reads it: the worst
same-seed divergence against the control's, their separation in orders of magnitude,
which pairs are bit-identical, and which tensors never differ.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pandas as pd

from dmlib.errors import DmlibError
from dmlib.sources import Patterns, Source, check_selection, opened
from dmlib.stats.compare import COLUMNS, _compare_sets, summarize


def matrix(
    runs: Mapping[str, Source],
    *,
    control: str | None = None,
    include: Patterns = None,
    exclude: Patterns = None,
    file_hashes: bool = False,
    chunk_bytes: int = 4 << 20,
    progress: bool | None = None,
) -> pd.DataFrame:
    """Compare every pair of runs (``n (n-1) / 2`` pairs) into one long-form DataFrame.

    Parameters
    ----------
    runs
        Label -> path or TensorSet, in the order pairs are formed (``a`` before ``b``).
    control
        Label of the run expected to differ (e.g. another seed); its pairs are the
        yardstick the others are measured against.
    include, exclude, chunk_bytes, progress
        As for :func:`dmlib.compare`; patterns apply to every run.
    file_hashes
        Hash whole files too (off by default: each file would be read once per pair).

    Returns
    -------
    pandas.DataFrame
        Columns ``a``, ``b`` (labels) then every :func:`dmlib.compare` column.
        ``attrs["verdict"]`` is :func:`verdict` of it, ``attrs["pairs"]`` maps
        ``"a/b"`` to that pair's compare attrs.
    """
    labels = list(runs)
    if len(labels) < 2:
        raise DmlibError(f"matrix needs at least two runs, got {len(labels)}")
    if control is not None and control not in runs:
        raise DmlibError(f"control {control!r} is not one of the runs ({', '.join(labels)})")
    frames, pair_attrs = [], {}
    # one hashing pool and cache for all pairs: each run's tensors are hashed once
    hash_pool = ThreadPoolExecutor(max_workers=2)
    hash_cache: dict[int, Any] = {}
    with contextlib.ExitStack() as stack:
        sets = {label: stack.enter_context(opened(src)) for label, src in runs.items()}
        stack.callback(hash_pool.shutdown, wait=True, cancel_futures=True)  # before closing
        every = list(dict.fromkeys(n for ts in sets.values() for n in ts))
        check_selection(every, [], include, exclude, f"any of the runs {labels}")
        for la, lb in itertools.combinations(labels, 2):
            df = _compare_sets(
                sets[la],
                sets[lb],
                include,
                exclude,
                file_hashes,
                chunk_bytes,
                progress,
                hash_pool=hash_pool,
                hash_cache=hash_cache,
            )
            pair_attrs[f"{la}/{lb}"] = dict(df.attrs)
            pair_attrs[f"{la}/{lb}"]["summary"] = summarize(df)
            df.attrs = {}
            df.insert(0, "b", lb)
            df.insert(0, "a", la)
            frames.append(df)
    out = (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=["a", "b", *COLUMNS])
    )
    out.attrs = {"runs": labels, "control": control, "pairs": pair_attrs}
    out.attrs["verdict"] = verdict(out, control=control)
    return out


def _worst(values: pd.Series) -> float | None:
    v = values.astype("float64").dropna()
    return float(v.max()) if len(v) else None


def verdict(df: pd.DataFrame, *, control: str | None = None) -> dict[str, Any]:
    """Same-seed pairs against the control, from a :func:`matrix` result.

    Returns
    -------
    dict
        ``pairs``: one dict per pair (``a``, ``b``, ``control`` [involves the control],
        ``identical``, ``numel``, ``n_diff``, ``frac_diff``, ``worst_rel_fro``,
        ``max_ulp``, ``worst_median_ulp`` [the largest per-tensor ``median_ulp``],
        ``max_abs``); ``same_worst_rel_fro``, ``same_max_ulp``, ``same_worst_median_ulp``,
        ``same_max_abs`` (worst over pairs without the control); ``control_rel_fro``,
        ``control_max_ulp`` (the control pairs' worst tensor, least over control pairs,
        so the separation is the conservative one); ``separation_orders`` =
        ``log10(control_rel_fro / same_worst_rel_fro)`` (inf when the same-seed pairs are
        exact, None without a control); ``identical_pairs`` (``"a/b"``);
        ``never_differ``: tensors with ``n_diff == 0`` in every same-seed pair;
        ``always_identical``: True when every same-seed pair is bit-identical.
    """
    if control is None:
        control = df.attrs.get("control")
    pair_attrs = df.attrs.get("pairs", {})
    pairs = [
        _pair_verdict(df, la, lb, control, pair_attrs.get(f"{la}/{lb}", {}))
        for la, lb in _pair_keys(df)
    ]
    same = [p for p in pairs if not p["control"]]
    ctrl = [p for p in pairs if p["control"]]
    same_rel = _worst_of(same, "worst_rel_fro")
    ctrl_rel = _worst_of(ctrl, "worst_rel_fro", min)
    return {
        "control": control,
        "pairs": pairs,
        "same_worst_rel_fro": same_rel,
        "same_max_ulp": _worst_of(same, "max_ulp"),
        "same_worst_median_ulp": _worst_of(same, "worst_median_ulp"),
        "same_max_abs": _worst_of(same, "max_abs"),
        "control_rel_fro": ctrl_rel,
        "control_max_ulp": _worst_of(ctrl, "max_ulp", min),
        "separation_orders": _separation(same_rel, ctrl_rel),
        "identical_pairs": [f"{p['a']}/{p['b']}" for p in pairs if p["identical"]],
        "never_differ": _never_differ(df, control),
        "always_identical": bool(same) and all(p["identical"] for p in same),
    }


def _pair_keys(df: pd.DataFrame) -> list[tuple[str, str]]:
    """The (a, b) pairs of a matrix frame, in the order matrix formed them."""
    if "runs" in df.attrs:
        return list(itertools.combinations(df.attrs["runs"], 2))
    return list(dict.fromkeys(zip(df["a"], df["b"], strict=True)))


def _pair_verdict(
    df: pd.DataFrame, la: str, lb: str, control: str | None, attrs: dict[str, Any]
) -> dict[str, Any]:
    """One pair's line of the verdict, from its rows and its compare attrs."""
    g = df[df["a"].eq(la) & df["b"].eq(lb)]
    mism = bool(attrs.get("only_in_a") or attrs.get("only_in_b") or attrs.get("mismatched"))
    numel, n_diff = int(g["numel"].sum()), int(g["n_diff"].sum())
    return {
        "a": la,
        "b": lb,
        "control": control in (la, lb),
        "identical": n_diff == 0
        and bool((g["data_hash_a"] == g["data_hash_b"]).all())
        and not mism,
        "numel": numel,
        "n_diff": n_diff,
        "frac_diff": n_diff / numel if numel else 0.0,
        "worst_rel_fro": _worst(g["rel_fro"]),
        "max_ulp": None if g["max_ulp"].isna().all() else int(g["max_ulp"].max()),
        # max_ulp is set by the few elements nearest zero, where one ULP is tiny;
        # the worst tensor's median says how far a typical differing element moved
        "worst_median_ulp": None
        if g["median_ulp"].isna().all()
        else float(g["median_ulp"].max()),
        "max_abs": _worst(g["max_abs"]),
    }


def _worst_of(pairs: list[dict[str, Any]], key: str, agg: Any = max) -> Any:
    """``agg`` of one statistic over pairs, None when no pair has it."""
    vals = [p[key] for p in pairs if p[key] is not None]
    return agg(vals) if vals else None


def _separation(same_rel: float | None, ctrl_rel: float | None) -> float | None:
    """``log10(control / same-seed)`` worst rel_fro: inf when the same-seed pairs are exact."""
    if ctrl_rel is None or same_rel is None:
        return None
    if same_rel == 0:
        return math.inf if ctrl_rel > 0 else None
    return math.log10(ctrl_rel / same_rel) if ctrl_rel > 0 else -math.inf


def _never_differ(df: pd.DataFrame, control: str | None) -> list[str]:
    """Tensors with ``n_diff == 0`` in every pair without the control."""
    same_rows = df[~(df["a"].eq(control) | df["b"].eq(control))] if control is not None else df
    if not len(same_rows):
        return []
    per_name = same_rows.groupby("name", sort=False)["n_diff"].max()
    return [str(n) for n, v in per_name.items() if v == 0]
