"""Two sets of per-token log-probs of the same tokens (a trainer's and a sampler's): are they
comparable, and how far apart are they, in the figures RL post-training reads.

:func:`compare_logprobs` first runs the identity gate (:func:`identity_gate`): the number
of sequences, the counted tokens per sequence, the token ids, the positions, the masks
and the metadata of :data:`~dmlib.stats.logprob_sides.IDENTITY_KEYS` (weights' hash,
sampling settings) are checked where both sides give them. A mismatch there is "not
comparable: tokens differ at sequence s, position p": no figure is computed, and the
verdict's status (and the command line's exit status 5) say so. Otherwise it returns a
tidy frame, one row per sequence (``role`` "pair": A against B; "control": A against
the control):

``role``, ``sequence``, ``n_tokens``, ``n_diff``
    Counted tokens, and those whose log-probs differ (bits where both sides hold one
    dtype, values otherwise).
``mean_abs_dlogprob``, ``max_abs_dlogprob``, ``worst_position``
    Mean and max ``|log p_B - log p_A|`` and the position of the max (-1: none differs).
``k1``, ``k2``, ``k3``, ``chi2``, ``mean_abs_dp``, ``pearson_r``, ``frac_over_ln2``
    See :mod:`dmlib.stats.logprob_figures` (and ``docs/logprobs.md``): direction A -> B,
    ``r = p_B / p_A``, tokens taken as sampled by A.
``max_ulp``
    Largest ULP distance (both sides one float dtype; null otherwise).
``n_nonfinite``
    Tokens where either log-prob is not finite: they enter no figure.
``kl_ab``, ``kl_ba``, ``max_kl_ab``, ``topk_overlap``
    Where both sides give ``logits``: the whole distributions' KL per position (mean per
    sequence, and the max), and the share of A's top-``top_k`` ids in B's.
``kl_topk_ab``, ``kl_topk_ba``, ``topk_overlap``
    Where both give ``top_logprobs`` and ``top_ids`` (and not logits): the KL of the
    distributions coarsened to the ids both lists hold plus the rest (a lower bound).

``df.attrs["verdict"]`` is the :class:`LogprobVerdict` (overall figures over every token,
the worst positions, the control's figures beside), also :func:`logprob_verdict`.
:func:`logprob_ladder` does the same for pairs of files along training steps.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dmlib.errors import DmlibError
from dmlib.kernels.verdict import Verdict
from dmlib.kernels.verdict import cell as fmt
from dmlib.numfmt import sci
from dmlib.stats import logprob_figures as figs
from dmlib.stats.logprob_sides import IDENTITY_KEYS, LogprobSide, read_side
from dmlib.textsafe import shown

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "FIGURES",
    "LogprobVerdict",
    "compare_logprobs",
    "identity_gate",
    "logprob_comparison",
    "logprob_ladder",
    "logprob_verdict",
]

#: The overall figures a verdict, a ladder row and the command line show, in this order.
FIGURES = (
    "mean_abs_dlogprob",
    "max_abs_dlogprob",
    "k1",
    "k2",
    "k3",
    "chi2",
    "mean_abs_dp",
    "pearson_r",
    "frac_over_ln2",
    "max_ulp",
)
_OPTIONAL = ("kl_ab", "kl_ba", "max_kl_ab", "kl_topk_ab", "kl_topk_ba", "topk_overlap")
#: The columns a ladder's table shows, in order (the command line and the report alike; the
#: rest of each row is in its JSON and recorded numbers).
LADDER_SHOWN = (
    "run",
    "step",
    "status",
    "n_tokens",
    "n_diff",
    "mean_abs_dlogprob",
    "max_abs_dlogprob",
    "k3",
    "chi2",
    "frac_over_ln2",
    "max_ulp",
)

BLOCK_TOKENS = 1 << 18  # counted tokens per block of sequences (bounds the temporaries)
BLOCK_BYTES = 1 << 26  # where whole distributions are given: their bytes per block
BLOCK_THREADS = 8  # blocks computed at once (at most the machine's cores)


@dataclass(frozen=True, eq=False)
class LogprobVerdict(Verdict):
    """The verdict of :func:`compare_logprobs`.

    ``status``: ``identical`` (every counted token's log-prob equal, and at least one
    compared), ``differs``, ``inconclusive`` (no token counted: nothing was compared) or
    ``not comparable`` (the identity gate failed: ``reason`` says where). ``bool()`` is
    True only for ``identical``.
    """

    status: str
    reason: str | None
    label_a: str
    label_b: str
    dtype_a: str | None
    dtype_b: str | None
    n_sequences: int
    n_tokens: int
    n_diff: int
    n_nonfinite: int
    figures: dict[str, Any]
    worst: list[dict[str, Any]]
    unchecked: list[str]
    control: dict[str, Any] | None
    control_label: str | None
    ratio_to_control: float | None

    def __bool__(self) -> bool:
        return self.status == "identical"

    @property
    def word(self) -> str:
        return self.status.upper()

    def __str__(self) -> str:
        a, b = shown(self.label_a), shown(self.label_b)
        if self.status == "not comparable":
            return f"NOT COMPARABLE: {self.reason} ({a} vs {b}); no figure computed"
        if self.status == "inconclusive":
            return f"INCONCLUSIVE: no token counted in {a} vs {b}: nothing was compared"
        f = self.figures
        lines = [
            f"{self.word}: {self.n_diff} of {self.n_tokens} tokens differ in "
            f"{self.n_sequences} sequences ({a} vs {b}"
            f"{'' if self.dtype_a == self.dtype_b else f'; dtypes {self.dtype_a} vs {self.dtype_b}'})",
            f"mean |dlogprob| {fmt(f.get('mean_abs_dlogprob'))}, max {fmt(f.get('max_abs_dlogprob'))}; "
            f"k3 {fmt(f.get('k3'))}; max_ulp {fmt(f.get('max_ulp'))}",
        ]
        if self.n_nonfinite:
            lines.append(f"{self.n_nonfinite} tokens with a non-finite log-prob (in no figure)")
        if self.worst:
            w = self.worst[0]
            lines.append(
                f"worst: sequence {w['sequence']}, position {w['position']} "
                f"(|dlogprob| {fmt(w['abs_dlogprob'])})"
            )
        if self.control is not None:
            ratio, theirs = self.ratio_to_control, self.control.get("mean_abs_dlogprob")
            lines.append(
                f"control {shown(self.control_label)}: mean |dlogprob| {fmt(theirs)}; "
                + (
                    "the control pair shows no mismatch"
                    if theirs == 0
                    else f"the pair's is {'-' if ratio is None else sci(ratio)} times the control's"
                )
            )
        for u in self.unchecked:
            lines.append(f"not checked: {u}")
        return "\n".join(lines)


# -- the identity gate -------------------------------------------------------------------


def identity_gate(a: LogprobSide, b: LogprobSide) -> tuple[str | None, list[str]]:
    """``(reason, unchecked)``: the first way the two sides do not score the same tokens
    (None when they pass), and what could not be checked (given by neither or one side)."""
    if a.n_seq != b.n_seq:
        return f"{a.n_seq} sequences in A, {b.n_seq} in B", []
    la, lb = a.lengths, b.lengths
    bad = np.flatnonzero(la != lb)
    if len(bad):
        s = int(bad[0])
        return f"sequence {s} has {la[s]} counted tokens in A, {lb[s]} in B", []
    unchecked: list[str] = []
    for kind, what in (("tokens", "tokens"), ("positions", "positions")):
        if not (a.has(kind) and b.has(kind)):
            unchecked.append(f"{what} (given by {_givers(a, b, kind)})")
            continue
        da, db = a.dense.get(kind), b.dense.get(kind)
        if da is not None and db is not None and da.shape == db.shape:  # padded, all counted
            where = _first_difference([da.reshape(-1)], [db.reshape(-1)])
            if where is not None:
                s, p = divmod(where[1], da.shape[1])
                where = (s, p, where[2], where[3])
        else:
            where = _first_difference(a.arrays[kind], b.arrays[kind])
        if where is not None:
            s, p, va, vb = where
            return f"{what} differ at sequence {s}, position {p} (A {va}, B {vb})", unchecked
    reason = _mask_difference(a, b) or _metadata_difference(a, b, unchecked)
    return reason, unchecked


def _givers(a: LogprobSide, b: LogprobSide, kind: str) -> str:
    who = [s for s, side in (("A", a), ("B", b)) if side.has(kind)]
    return " and ".join(who) if who else "neither side"


def _first_difference(
    xs: list[np.ndarray], ys: list[np.ndarray]
) -> tuple[int, int, Any, Any] | None:
    flat_x = np.concatenate(xs) if xs else np.zeros(0)
    flat_y = np.concatenate(ys) if ys else np.zeros(0)
    bad = np.flatnonzero(flat_x != flat_y)
    if not len(bad):
        return None
    i = int(bad[0])
    starts = np.cumsum([0] + [len(x) for x in xs])
    s = int(np.searchsorted(starts, i, side="right") - 1)
    return s, i - int(starts[s]), flat_x[i].item(), flat_y[i].item()


def _mask_difference(a: LogprobSide, b: LogprobSide) -> str | None:
    if a.raw_mask is None or b.raw_mask is None:
        return None
    for s, (ma, mb) in enumerate(zip(a.raw_mask, b.raw_mask, strict=True)):
        if ma.shape == mb.shape and (ma != mb).any():
            col = int(np.flatnonzero(ma != mb)[0])
            return f"masks differ at sequence {s}, stored column {col}"
    return None


def _metadata_difference(a: LogprobSide, b: LogprobSide, unchecked: list[str]) -> str | None:
    for key in IDENTITY_KEYS:
        va, vb = a.metadata.get(key), b.metadata.get(key)
        if va is None or vb is None:
            if va is not None or vb is not None:
                unchecked.append(
                    f"metadata {key!r} (given by {'A' if va is not None else 'B'} only)"
                )
            continue
        if not _same_setting(va, vb):
            return f"metadata {key!r} differs (A {shown(va)!r}, B {shown(vb)!r})"
    return None


def _same_setting(va: str, vb: str) -> bool:
    if va == vb:
        return True
    try:
        return float(va) == float(vb)
    except ValueError:
        return False


# -- the comparison ----------------------------------------------------------------------


def compare_logprobs(
    a: Any,
    b: Any,
    *,
    control: Any = None,
    mask: Any = None,
    top_k: int = 20,
    n_worst: int = 5,
    labels: tuple[str, str, str] = ("A", "B", "control"),
    distributions: bool = True,
) -> pd.DataFrame:
    """Compare the log-probs two runs give the same tokens (see the module docstring).

    Parameters
    ----------
    a, b
        Each a path (safetensors, npz, torch, any format dmlib reads, or JSONL), a
        TensorSet, a mapping name -> array, a list of per-sequence arrays or an
        ``[S, T]`` array (layouts: :mod:`dmlib.stats.logprob_sides`). Tokens are taken
        as sampled by ``a``: pass the sampler as ``a`` and the trainer as ``b`` for the
        KL estimators to estimate ``KL(sampler || trainer)``.
    control
        A third run (an lr=0 or a repeat run) compared with ``a`` the same way; its rows
        have ``role`` "control" and its overall figures sit beside the pair's in the
        verdict. It must pass the identity gate against ``a`` (else bad input).
    mask
        Applied to every side on top of its own: an ``[S, T]`` array, a list of
        per-sequence arrays, or a file holding ``mask``.
    top_k
        The ids compared by ``topk_overlap`` where full logits are given.
    n_worst
        How many worst positions the verdict lists.
    labels
        The names the verdict gives A, B and the control.
    distributions
        False: leave out the whole-distribution figures (KL from logits or top-k lists,
        top-k overlap) even where the inputs give them (the sampled tokens' figures only).

    Returns
    -------
    pandas.DataFrame
        One row per sequence and role; ``attrs["verdict"]`` is the :class:`LogprobVerdict`.

    Example
    -------
    >>> import numpy as np
    >>> df = compare_logprobs([np.array([-0.5, -1.0])], [np.array([-0.5, -1.25])])
    >>> df["max_abs_dlogprob"].item(), df.attrs["verdict"].status
    (0.25, 'differs')
    """
    rows, verdict = logprob_comparison(
        a,
        b,
        control=control,
        mask=mask,
        top_k=top_k,
        n_worst=n_worst,
        labels=labels,
        distributions=distributions,
    )
    return _frame(rows, verdict)


def logprob_comparison(
    a: Any,
    b: Any,
    *,
    control: Any = None,
    mask: Any = None,
    top_k: int = 20,
    n_worst: int = 5,
    labels: tuple[str, str, str] = ("A", "B", "control"),
    distributions: bool = True,
) -> tuple[list[dict[str, Any]], LogprobVerdict]:
    """:func:`compare_logprobs` as its rows (one dict per sequence and role) and its
    verdict, without building a DataFrame (the command line's path: no pandas import)."""
    sa = read_side(a, labels[0], mask=mask)
    sb = read_side(b, labels[1], mask=mask)
    reason, unchecked = identity_gate(sa, sb)
    if reason is not None:
        return [], _verdict(sa, sb, None, reason=reason, unchecked=unchecked, n_worst=n_worst)
    if distributions:
        unchecked += _one_sided(sa, sb)
    opts: dict[str, Any] = {"top_k": top_k, "n_worst": n_worst, "distributions": distributions}
    rows, overall = _pair_rows(sa, sb, "pair", **opts)
    control_overall = None
    if control is not None:
        sc = read_side(control, labels[2], mask=mask)
        c_reason, _ = identity_gate(sa, sc)
        if c_reason is not None:
            raise DmlibError(f"the control is not comparable with {labels[0]}: {c_reason}")
        c_rows, control_overall = _pair_rows(sa, sc, "control", **opts)
        rows += c_rows
    verdict = _verdict(
        sa,
        sb,
        overall,
        unchecked=unchecked,
        control=control_overall,
        control_label=labels[2] if control is not None else None,
        n_worst=n_worst,
    )
    return rows, verdict


def _one_sided(sa: LogprobSide, sb: LogprobSide) -> list[str]:
    """Whole distributions one side gives and the other does not: no figure from them."""
    out = []
    for what, kinds in (("logits", ("logits",)), ("top-k", ("top_logprobs", "top_ids"))):
        a, b = (all(side.has(k) for k in kinds) for side in (sa, sb))
        if a != b:
            out.append(f"{what} figures ({' and '.join(kinds)} given by {'A' if a else 'B'} only)")
    return out


def _blocks(lengths: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Consecutive sequence ranges of about ``limit`` counted tokens each."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        acc += n
        if acc >= limit:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < len(lengths):
        out.append((start, len(lengths)))
    return out


def _pair_rows(
    sa: LogprobSide, sb: LogprobSide, role: str, *, top_k: int, n_worst: int, distributions: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The per-sequence rows and the overall figures of one pair that passed the gate."""
    lengths = sa.lengths
    limit = BLOCK_TOKENS
    logits = distributions and sa.has("logits") and sb.has("logits") and sa.n_seq > 0
    if logits:
        # a block's logits are gathered from its sequences: about 64 MiB of float32 at once
        limit = max(1, (BLOCK_BYTES // 4) // max(1, sa.arrays["logits"][0].shape[-1]))
    spans = _blocks(lengths, limit)
    # whole logits take the block's memory bound once: one block at a time there
    workers = max(1, min(len(spans), 1 if logits else BLOCK_THREADS, os.cpu_count() or 1))

    def one(span: tuple[int, int]) -> figs.Sums:
        s0, s1 = span
        s = figs.block_sums(
            sa.flat("logprobs", s0, s1),
            sb.flat("logprobs", s0, s1),
            lengths[s0:s1],
            first_seq=s0,
            n_worst=n_worst,
        )
        if distributions:
            # the top-k pass on threads of its own only where the blocks are not
            _distributions(sa, sb, s, span, top_k, threads=None if workers == 1 else 1)
        return s

    # a block's sampled-token figures and top-k pass on one thread (numpy's loops and the
    # compiled pass release the interpreter lock): two blocks' reading and passes overlap
    blocks = figs.on_threads(one, spans, workers)
    rows: list[dict[str, Any]] = []
    for (s0, s1), s in zip(spans, blocks, strict=True):
        cols = {k: (None if v is None else v.tolist()) for k, v in figs.per_sequence(s).items()}
        for i in range(s1 - s0):
            rows.append(
                {
                    "role": role,
                    "sequence": s0 + i,
                    **{k: (None if v is None else v[i]) for k, v in cols.items()},
                }
            )
    overall = figs.combine(blocks)
    top = sorted((t for b in blocks for t in b.top), key=lambda t: (-t[0], t[1], t[2]))[:n_worst]
    overall["worst"] = [
        {"sequence": s, "position": p, "abs_dlogprob": r, "logprob_a": x, "logprob_b": y}
        for r, s, p, x, y in top
    ]
    return rows, overall


def _distributions(
    sa: LogprobSide,
    sb: LogprobSide,
    s: figs.Sums,
    span: tuple[int, int],
    top_k: int,
    *,
    threads: int | None = None,
) -> None:
    """Add the whole-distribution figures of one block to its sums, where given (the top-k
    pass on at most ``threads`` threads; None: the machine's cores)."""
    s0, s1 = span
    if sa.has("logits") and sb.has("logits"):
        za, zb = sa.flat("logits", s0, s1), sb.flat("logits", s0, s1)
        if za.shape[1:] != zb.shape[1:]:
            raise DmlibError(f"logits over {za.shape[1:]} ids in A, {zb.shape[1:]} in B")
        per_token = figs.full_kl(za, zb, top_k)
        maxed: tuple[str, ...] = ("kl_ab",)
    elif all(side.has(k) for side in (sa, sb) for k in ("top_logprobs", "top_ids")):
        ia, ib = sa.flat("top_ids", s0, s1), sb.flat("top_ids", s0, s1)
        _check_ids(ia, ib)
        per_token = figs.topk_kl(
            sa.flat("top_logprobs", s0, s1),
            ia,
            sb.flat("top_logprobs", s0, s1),
            ib,
            threads=threads,
        )
        maxed = ()
    else:
        return
    seg = figs.Segments(s.n)
    for k, v in per_token.items():
        ok = ~np.isnan(v)
        every = bool(ok.all())  # the common case: no masked copies
        s.extra[k] = seg.sum(v if every else np.where(ok, v, 0.0))
        s.extra_n[k] = seg.count(ok)
        if k in maxed:
            s.extra_max[k] = seg.max(v if every else np.where(ok, v, -np.inf), -np.inf)


def _check_ids(ia: np.ndarray, ib: np.ndarray) -> None:
    for side, ids in (("A", ia), ("B", ib)):
        # a pass over the ids each: unsigned ids are not negative, 32-bit ones below 2**46
        low = ids.size and ids.dtype.kind != "u" and ids.min() < 0
        if low or (ids.size and ids.dtype.itemsize > 4 and ids.max() >= 1 << 46):
            raise DmlibError(f"top_ids of {side} hold ids outside 0 .. 2**46")
        if ids.shape[1] >= 1 << 16:
            raise DmlibError(f"top_ids of {side} list {ids.shape[1]} ids per token (at most 65535)")


def _verdict(
    sa: LogprobSide,
    sb: LogprobSide,
    overall: dict[str, Any] | None,
    *,
    reason: str | None = None,
    unchecked: list[str],
    control: dict[str, Any] | None = None,
    control_label: str | None = None,
    n_worst: int,
) -> LogprobVerdict:
    o = overall or {}
    n_tokens = int(o.get("n_tokens", 0))
    if reason is not None:
        status = "not comparable"
    elif n_tokens == 0:
        status = "inconclusive"
    else:
        status = "differs" if o["n_diff"] else "identical"
    fig = {k: o[k] for k in (*FIGURES, *_OPTIONAL) if k in o}
    ratio = None
    if control is not None:
        mine, theirs = o.get("mean_abs_dlogprob"), control.get("mean_abs_dlogprob")
        if mine is not None and theirs:
            ratio = mine / theirs
        control = {k: v for k, v in control.items() if k != "worst"}
    return LogprobVerdict(
        status=status,
        reason=reason,
        label_a=sa.label,
        label_b=sb.label,
        dtype_a=sa.dtype().name,
        dtype_b=sb.dtype().name,
        n_sequences=sa.n_seq,
        n_tokens=n_tokens,
        n_diff=int(o.get("n_diff", 0)),
        n_nonfinite=int(o.get("n_nonfinite", 0)),
        figures=fig,
        worst=list(o.get("worst", []))[:n_worst],
        unchecked=unchecked,
        control=control,
        control_label=control_label,
        ratio_to_control=ratio,
    )


def _frame(rows: list[dict[str, Any]], verdict: LogprobVerdict) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame(rows)
    if not len(df):
        df = pd.DataFrame(columns=["role", "sequence", "n_tokens", "n_diff", *FIGURES])
    df.attrs["verdict"] = verdict
    return df


def logprob_verdict(df: pd.DataFrame) -> LogprobVerdict:
    """The verdict of a :func:`compare_logprobs` frame."""
    v = df.attrs.get("verdict")
    if not isinstance(v, LogprobVerdict):
        raise DmlibError("not a compare_logprobs frame (its attrs hold no verdict)")
    return v


# -- along training steps ---------------------------------------------------------------


def logprob_ladder(
    runs: Mapping[str, Mapping[int, tuple[Any, Any]]],
    *,
    control: str | None = None,
    mask: Any = None,
    top_k: int = 20,
) -> pd.DataFrame:
    """The mismatch figures of each run at each training step.

    ``runs``: ``{label: {step: (a, b)}}``: at each step, the two sides' log-probs of the
    same tokens (the sampler's and the trainer's, say); ``control``: the label of a run
    whose mismatch is the reference level (an lr=0 run: weights that never move).
    One row per run and step: ``run``, ``step``, ``is_control``, ``status``, ``reason``,
    ``n_tokens``, ``n_diff`` and the overall figures (:data:`FIGURES` and, where given,
    the whole-distribution ones); a step that is not comparable has its reason and no
    figures. ``attrs["control"]`` is the control's label.
    """
    import pandas as pd

    if control is not None and control not in runs:
        raise DmlibError(f"control run {control!r} is not among the runs {sorted(runs)}")
    rows = []
    for label, steps in runs.items():
        for step in sorted(steps):
            pa, pb = steps[step]
            v = logprob_verdict(compare_logprobs(pa, pb, mask=mask, top_k=top_k))
            rows.append(
                {
                    "run": label,
                    "step": int(step),
                    "is_control": label == control,
                    "status": v.status,
                    "reason": v.reason,
                    "n_tokens": v.n_tokens,
                    "n_diff": v.n_diff,
                    **{k: v.figures.get(k, math.nan) for k in FIGURES},
                    **{k: v.figures[k] for k in _OPTIONAL if k in v.figures},
                }
            )
    df = pd.DataFrame(rows)
    df.attrs["control"] = control
    return df
