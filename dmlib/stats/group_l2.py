"""The global relative L2 of a group of tensors: ``||a - b||_2 / ||a||_2`` over the
concatenation of every tensor of the group (the figure gradient and packing-geometry
reports quote: one number over all of a model's or an adapter's gradients, not the worst
tensor's ``rel_fro``).

A group is named by a pattern over tensor names (:func:`dmlib.sources.select`'s rules: a
glob on the whole name, else a substring, or ``re:REGEX``), or by a word: ``all`` (every
float tensor both sides hold) and ``adapter`` (the tensors of a LoRA adapter: names holding
``lora_``). ``LABEL=PATTERN`` names a group.

Computed in float64: each side's elements are converted to float64 (exact for every float
dtype up to float64), the difference ``a - b`` formed in float64, each chunk's sum of
squares by numpy, and the chunks' partial sums added with :func:`math.fsum` (correctly
rounded), so the figure is the float64 evaluation of the formula, with no float32 step
and no dependence on the order tensors are visited. NaN or inf on either side propagate as
numpy's do. Only float (and complex, by component) tensors held by both sides with the
same shape enter; the others are counted in ``n_not_compared``.

Columns of :func:`group_l2`: ``group`` (its label), ``pattern``, ``n_tensors``, ``numel``,
``norm_a`` (``||a||_2``), ``norm_diff`` (``||a - b||_2``), ``rel_l2`` (their ratio: 0 when
both are 0, ``inf`` when only ``||a||`` is 0), ``n_not_compared``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from dmlib._blas import one_thread
from dmlib.errors import DmlibError
from dmlib.sources import Source, name_filter, open_source
from dmlib.tensor import Tensor, TensorSet

__all__ = ["GROUP_WORDS", "group_l2", "group_l2_records", "parse_groups"]

#: words that name a group instead of a pattern
GROUP_WORDS = {"all": None, "adapter": "lora_"}
_CHUNK = 1 << 20  # elements per side converted to float64 at once (8 MiB)
_COLUMNS = ["group", "pattern", "n_tensors", "numel", "norm_a", "norm_diff", "rel_l2",
            "n_not_compared"]  # fmt: skip


def parse_groups(
    groups: str | Iterable[str] | Mapping[str, str | None] | None,
) -> dict[str, str | None]:
    """``{label: pattern}`` from ``"all"``, ``"LABEL=PATTERN"`` items or a mapping
    (a pattern None: every tensor); None: ``{"all": None}``."""
    if groups is None:
        return {"all": None}
    if isinstance(groups, Mapping):
        return dict(groups)
    items = [groups] if isinstance(groups, str) else list(groups)
    out: dict[str, str | None] = {}
    for item in items:
        label, sep, pattern = item.partition("=")
        if not sep or item.startswith("re:"):
            label, pattern = item, item
        if not label or not pattern:
            raise DmlibError(f"group {item!r}: expected PATTERN or LABEL=PATTERN")
        out[label] = GROUP_WORDS.get(pattern, pattern)
    return out


def _floating(t: Tensor) -> bool:
    kind = np.dtype(t.dtype).kind
    return not t.quantized and (
        kind in "fc" or np.dtype(t.dtype).name.startswith(("bfloat", "float"))
    )


def _sums(ta: Tensor, tb: Tensor) -> tuple[float, float]:
    """``(sum a^2, sum (a - b)^2)`` of one pair, in float64 (module docstring)."""
    a, b = ta.load().reshape(-1), tb.load().reshape(-1)
    if np.iscomplexobj(a):
        a, b = a.view(a.real.dtype), b.view(b.real.dtype)
    sq_a: list[float] = []
    sq_d: list[float] = []
    with one_thread():  # a threaded dot splits the sum by the number of threads
        for start in range(0, a.size, _CHUNK):
            x = a[start : start + _CHUNK].astype(np.float64)
            d = x - b[start : start + _CHUNK].astype(np.float64)
            sq_a.append(float(np.dot(x, x)))
            sq_d.append(float(np.dot(d, d)))
    return math.fsum(sq_a), math.fsum(sq_d)


def _pairs(
    sa: TensorSet, sb: TensorSet, pattern: str | None
) -> tuple[list[tuple[Tensor, Tensor]], int]:
    """The group's comparable pairs, and how many of its names are not comparable."""
    keep = name_filter(pattern)
    pairs, skipped = [], 0
    for name in (n for n in sa if keep(n)):
        ta = sa[name]
        tb = sb[name] if name in sb else None
        ok = tb is not None and ta.shape == tb.shape and _floating(ta) and _floating(tb)
        if ok:
            assert tb is not None
            pairs.append((ta, tb))
        else:
            skipped += 1
    skipped += sum(1 for n in sb if keep(n) and n not in sa)
    return pairs, skipped


def group_l2_records(a: Source, b: Source, groups: Any = None) -> list[dict[str, Any]]:
    """:func:`group_l2` as plain dicts (no pandas: the command line's fast start)."""
    wanted = parse_groups(groups)
    with contextlib.ExitStack() as stack:
        sa, sb = open_source(a, stack), open_source(b, stack)
        cache: dict[str, tuple[float, float]] = {}
        rows = []
        for label, pattern in wanted.items():
            pairs, skipped = _pairs(sa, sb, pattern)
            sums = [cache.setdefault(ta.name, _sums(ta, tb)) for ta, tb in pairs]
            sq_a = math.fsum(s[0] for s in sums)
            sq_d = math.fsum(s[1] for s in sums)
            norm_a, norm_d = math.sqrt(sq_a), math.sqrt(sq_d)
            with np.errstate(all="ignore"):
                rel = norm_d / norm_a if norm_a else (0.0 if norm_d == 0 else math.inf)
            if math.isnan(norm_a) or math.isnan(norm_d):
                rel = math.nan
            rows.append({
                "group": label, "pattern": pattern, "n_tensors": len(pairs),
                "numel": int(sum(ta.numel for ta, _ in pairs)), "norm_a": norm_a,
                "norm_diff": norm_d, "rel_l2": rel, "n_not_compared": skipped,
            })  # fmt: skip
    return rows


def group_l2(a: Source, b: Source, groups: Any = None) -> Any:
    """The global relative L2 of each group of tensors (module docstring).

    Parameters
    ----------
    a, b
        Paths, TensorSets or mappings of arrays; ``a`` is the reference (denominator).
    groups
        ``"all"`` (the default), ``"adapter"``, a pattern, ``"LABEL=PATTERN"``, a list of
        them, or a mapping ``{label: pattern}``.

    Returns
    -------
    DataFrame
        One row per group, columns as the module docstring says.

    Examples
    --------
    >>> import numpy as np, dmlib
    >>> a = {"x": np.array([3.0, 0.0]), "y": np.array([4.0])}
    >>> b = {"x": np.array([3.0, 1.0]), "y": np.array([4.0])}
    >>> float(dmlib.group_l2(a, b)["rel_l2"][0])  # ||(0, -1, 0)|| / ||(3, 0, 4)||
    0.2
    """
    import pandas as pd

    return pd.DataFrame(group_l2_records(a, b, groups), columns=_COLUMNS)
