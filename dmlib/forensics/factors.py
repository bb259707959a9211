"""Judge factorised layers by the weight they compute, not by their factors.

A layer stored as ``U diag(s) V^T`` (or ``A @ B`` for a low-rank adapter) can change its
factors without changing what it computes: negate a column of ``U`` and the matching
column of ``V`` and the product is the same. Comparing factors then reports a
difference that does not exist, and a small difference in factors says nothing
directly about the layer. The effective weight, formed in float64, is what counts.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from dmlib._blas import one_thread
from dmlib.errors import DmlibError, TensorNotFoundError
from dmlib.sources import Source, open_source
from dmlib.tensor import ArrayTensorSet, TensorSet

__all__ = ["FactorGroup", "compare_factors", "effective_weights"]

_PLACEHOLDER = "{prefix}"


@dataclass(frozen=True)
class FactorGroup:
    """A family of factorised layers, declared by name patterns holding ``{prefix}``.

    Build one with :meth:`svd` or :meth:`lowrank`; every prefix for which all the
    patterns name a tensor is one layer.

    Attributes
    ----------
    kind
        ``"svd"`` (``U @ diag(s) @ V.T``) or ``"lowrank"`` (``A @ B``).
    patterns
        One name pattern per factor, in the order of the formula.
    transpose
        Per factor: transpose the stored matrix before use.
    """

    kind: str
    patterns: tuple[str, ...]
    transpose: tuple[bool, ...]

    def __post_init__(self) -> None:
        arity = {"svd": 3, "lowrank": 2}
        if self.kind not in arity:
            raise DmlibError(f"unknown factor group kind {self.kind!r}; valid: 'svd', 'lowrank'")
        if len(self.patterns) != arity[self.kind] or len(self.transpose) != arity[self.kind]:
            raise DmlibError(
                f"a {self.kind} group takes {arity[self.kind]} patterns, got {list(self.patterns)}"
            )
        for p in self.patterns:
            if p.count(_PLACEHOLDER) != 1:
                raise DmlibError(f"factor pattern {p!r} must contain '{_PLACEHOLDER}' exactly once")

    @classmethod
    def svd(
        cls, u: str, s: str, v: str, *, transpose_u: bool = False, transpose_v: bool = False
    ) -> FactorGroup:
        """``W = U @ diag(s) @ V.T`` with U [m, k], s [k], V [n, k] (transposes configurable)."""
        return cls("svd", (u, s, v), (transpose_u, False, transpose_v))

    @classmethod
    def lowrank(
        cls, a: str, b: str, *, transpose_a: bool = False, transpose_b: bool = False
    ) -> FactorGroup:
        """``W = A @ B`` with A [m, r], B [r, n] (transposes configurable)."""
        return cls("lowrank", (a, b), (transpose_a, transpose_b))

    def _regex(self, i: int) -> re.Pattern[str]:
        head, tail = self.patterns[i].split(_PLACEHOLDER)
        return re.compile(re.escape(head) + "(?P<prefix>.+)" + re.escape(tail))

    def names(self, prefix: str) -> tuple[str, ...]:
        """The factor tensor names of one layer."""
        return tuple(p.replace(_PLACEHOLDER, prefix) for p in self.patterns)

    def prefixes(self, names: Iterable[str]) -> list[str]:
        """Prefixes (sorted) for which every factor is among ``names``."""
        have = set(names)
        rx = self._regex(0)
        found = {m["prefix"] for n in have if (m := rx.fullmatch(n))}
        return sorted(p for p in found if all(n in have for n in self.names(p)))

    def effective(self, factors: Iterable[np.ndarray], *, where: str = "") -> np.ndarray:
        """The effective weight of one layer, computed in float64."""
        mats = []
        for arr, t in zip(factors, self.transpose, strict=True):
            x = np.asarray(arr).astype(np.float64)
            mats.append(x.T if t and x.ndim == 2 else x)
        shapes = [list(m.shape) for m in mats]
        if self.kind == "svd":
            u, s, v = mats
            ok = (
                u.ndim == 2
                and s.ndim == 1
                and v.ndim == 2
                and u.shape[1] == s.shape[0] == v.shape[1]
            )
            if not ok:
                raise DmlibError(
                    f"svd group {where}: factor shapes {shapes} do not fit U[m,k] s[k] V[n,k] "
                    "(set transpose_u/transpose_v for stored transposes)"
                )
            with one_thread():
                return (u * s) @ v.T
        a, b = mats
        if not (a.ndim == 2 and b.ndim == 2 and a.shape[1] == b.shape[0]):
            raise DmlibError(
                f"lowrank group {where}: factor shapes {shapes} do not fit A[m,r] B[r,n] "
                "(set transpose_a/transpose_b for stored transposes)"
            )
        with one_thread():
            return a @ b


def as_groups(groups: FactorGroup | Iterable[FactorGroup]) -> list[FactorGroup]:
    """One group or several, as a non-empty list (the forensics modules take either)."""
    gs = [groups] if isinstance(groups, FactorGroup) else list(groups)
    if not gs:
        raise DmlibError("no factor groups given; declare them with FactorGroup.svd/.lowrank")
    return gs


def layers_of(
    ts: TensorSet, groups: list[FactorGroup]
) -> dict[str, tuple[FactorGroup, tuple[str, ...]]]:
    """prefix -> (group, factor names); the first group that claims a prefix wins."""
    out: dict[str, tuple[FactorGroup, tuple[str, ...]]] = {}
    for g in groups:
        for p in g.prefixes(ts):
            out.setdefault(p, (g, g.names(p)))
    return out


def effective_weights(ts: Source, groups: FactorGroup | Iterable[FactorGroup]) -> ArrayTensorSet:
    """The effective weight (float64) of every factorised layer, named by its prefix.

    The result is an ordinary tensor set, so it goes through ``dmlib.compare`` like
    any checkpoint.
    """
    with contextlib.ExitStack() as stack:
        tset = open_source(ts, stack)
        arrays = {}
        for prefix, (g, names) in layers_of(tset, as_groups(groups)).items():
            arrays[prefix] = g.effective((tset[n].load() for n in names), where=f"{prefix!r}")
        return ArrayTensorSet(arrays, path=tset.path)


def _stats(a: TensorSet, b: TensorSet, engine: str = "local") -> pd.DataFrame:
    """``dmlib.compare`` of two tensor sets, indexed by name."""
    from dmlib.stats.compare import compare_with
    from dmlib.stats.options import CompareOptions

    opts = CompareOptions(file_hashes=False, progress=False, engine=engine)
    return compare_with(a, b, opts).set_index("name")


def _fields(e: pd.Series, ea: np.ndarray) -> dict[str, Any]:
    """A layer's statistics from its effective weights' compare row (``ea``: W_a)."""
    return {
        "shape": list(ea.shape),
        "numel": int(e["numel"]),
        "norm": _fro(ea),
        "rel_fro": float(e["rel_fro"]),
        "max_abs": float(e["max_abs"]) if pd.notna(e["max_abs"]) else 0.0,
        "n_diff": int(e["n_diff"]),
        "cosine": float(e["cosine"]),
    }


def _fro(x: np.ndarray) -> float:
    with one_thread():
        return float(np.linalg.norm(x))


def _layer(g: FactorGroup, prefix: str, fa: Iterable[Any], fb: Iterable[Any],
           wa: str, wb: str, path_b: str | None) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    ea = g.effective(fa, where=f"{prefix!r} in {wa}")
    eb = g.effective(fb, where=f"{prefix!r} in {wb}")
    if ea.shape != eb.shape:
        raise DmlibError(
            f"layer {prefix!r}: effective weight is {list(ea.shape)} in a and "
            f"{list(eb.shape)} in b; the two checkpoints must hold the same model",
            path=path_b,
        )
    return ea, eb


def _layer_task(
    g: FactorGroup, prefix: str, refs_a: Any, refs_b: Any, wa: str, wb: str, path_b: str | None
) -> dict[str, Any] | str:
    """One layer's statistics on a Dask worker: its factors read whole from their paths,
    both effective weights formed and compared there; only the numbers come back."""
    from dmlib.engine.refs import load

    try:
        ea, eb = _layer(g, prefix, map(load, refs_a), map(load, refs_b), wa, wb, path_b)
    except DmlibError as err:  # the message travels; the driver raises it
        return str(err)
    e = _stats(ArrayTensorSet({prefix: ea}), ArrayTensorSet({prefix: eb})).loc[prefix]
    return _fields(e, ea)


_COLUMNS = [
    "group",
    "kind",
    "shape",
    "numel",
    "norm",
    "rel_fro",
    "max_abs",
    "n_diff",
    "cosine",
    "factor_n_diff",
    "factor_numel",
    "status",
]


def compare_factors(
    a: Source, b: Source, groups: FactorGroup | Iterable[FactorGroup], *, engine: str = "local"
) -> pd.DataFrame:
    """Compare two checkpoints' factorised layers by their effective weights.

    Parameters
    ----------
    a, b
        Paths, TensorSets or mappings of arrays.
    groups
        One or more :class:`FactorGroup`.
    engine
        ``"local"``: here; ``"dask"``: one task per layer on Dask's current scheduler
        (it reads the layer's factors whole from the checkpoints' paths and forms both
        effective weights there) and the factors' bitwise comparison as pieces (see
        :func:`dmlib.compare`). The same frame.

    Returns
    -------
    DataFrame
        One row per layer (``group`` = prefix): ``kind``, ``shape`` and ``numel`` of the
        effective weight, ``norm`` (||W_a||_F), ``rel_fro`` (||W_a - W_b||_F / ||W_a||_F),
        ``max_abs`` (max |W_a - W_b|), ``n_diff`` and ``cosine`` of the effective weights
        (float64), all as ``dmlib.compare`` computes them; ``factor_n_diff`` /
        ``factor_numel`` (the factors' own differing elements, bitwise), ``status``
        ("ok", or "only in a"/"only in b").
        ``attrs["worst_group"]`` and ``attrs["worst_rel_fro"]`` name the largest rel_fro.
    """
    from dmlib.engine import check_engine

    gs = as_groups(groups)
    check_engine(engine)
    with contextlib.ExitStack() as stack:
        sa, sb = open_source(a, stack), open_source(b, stack)
        df = _compare_layers(sa, sb, gs, engine)
    ok = df[df["status"] == "ok"]
    if len(ok):
        worst = ok.loc[ok["rel_fro"].astype(float).idxmax()]
        df.attrs["worst_group"] = worst["group"]
        df.attrs["worst_rel_fro"] = float(worst["rel_fro"])
    else:
        df.attrs["worst_group"] = None
        df.attrs["worst_rel_fro"] = None
    return df


def _compare_layers(
    sa: TensorSet, sb: TensorSet, gs: list[FactorGroup], engine: str = "local"
) -> pd.DataFrame:
    la, lb = layers_of(sa, gs), layers_of(sb, gs)
    both = sorted(set(la) & set(lb))
    wa, wb = sa.path or "a", sb.path or "b"
    stats: dict[str, dict[str, Any]] = {}
    if engine == "dask" and both:
        from dmlib.engine.dask_reads import map_tasks
        from dmlib.engine.refs import ref_of

        tasks = [
            (g, p, tuple(ref_of(sa[n]) for n in names), tuple(ref_of(sb[n]) for n in names),
             wa, wb, sb.path)
            for p in both
            for g, names in [la[p]]
        ]  # fmt: skip
        for p, got in zip(both, map_tasks(_layer_task, tasks), strict=True):
            if isinstance(got, str):
                raise DmlibError(got)
            stats[p] = got
    elif both:
        eff_a, eff_b = {}, {}
        for prefix in both:
            g, names = la[prefix]
            eff_a[prefix], eff_b[prefix] = _layer(
                g, prefix, (sa[n].load() for n in names), (sb[n].load() for n in names),
                wa, wb, sb.path,
            )  # fmt: skip
        # derived tensors go through the same statistics as stored ones
        eff = _stats(ArrayTensorSet(eff_a), ArrayTensorSet(eff_b))
        stats = {p: _fields(eff.loc[p], eff_a[p]) for p in both}
    factor_names = [n for p in both for n in la[p][1]]
    fac = (
        _stats(
            TensorSet({n: sa[n] for n in factor_names}),
            TensorSet({n: sb[n] for n in factor_names}),
            engine,
        )
        if both
        else None
    )
    rows = []
    for prefix in sorted(set(la) | set(lb)):
        g, names = la.get(prefix) or lb[prefix]
        row: dict[str, Any] = dict.fromkeys(_COLUMNS)
        row.update(group=prefix, kind=g.kind)
        if prefix not in la or prefix not in lb:
            row["status"] = "only in b" if prefix not in la else "only in a"
            rows.append(row)
            continue
        assert fac is not None  # the prefix is in both: both were computed
        row.update(
            **stats[prefix],
            factor_n_diff=int(fac.loc[list(names), "n_diff"].sum()),
            factor_numel=int(fac.loc[list(names), "numel"].sum()),
            status="ok",
        )
        rows.append(row)
    if not rows:
        pats = [list(g.patterns) for g in gs]
        raise TensorNotFoundError(
            f"no factorised layer matches the patterns {pats} "
            f"({len(sa)} tensors, e.g. {next(iter(sa), None)!r})",
            path=sa.path,
        )
    return pd.DataFrame(rows, columns=_COLUMNS)


def factor_matrix(
    runs: Mapping[str, Source], groups: FactorGroup | Iterable[FactorGroup]
) -> pd.DataFrame:
    """:func:`compare_factors` for every pair of runs, in long form.

    Returns one row per (pair, layer) with columns ``a``, ``b`` (run labels) and those of
    :func:`compare_factors`; ``attrs["pairs"]`` is one row per pair with ``a``, ``b``,
    ``rel_fro`` (the worst layer's) and ``worst_group``, ready for a run-matrix heatmap.
    """
    labels = list(runs)
    frames, pairs = [], []
    for i, a in enumerate(labels):
        for b in labels[i + 1 :]:
            df = compare_factors(runs[a], runs[b], groups)
            frames.append(df.assign(a=a, b=b))
            pairs.append(
                {
                    "a": a,
                    "b": b,
                    "rel_fro": df.attrs["worst_rel_fro"],
                    "worst_group": df.attrs["worst_group"],
                }
            )
    out = (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=["a", "b", *_COLUMNS])
    )
    out = out[["a", "b", *[c for c in out.columns if c not in ("a", "b")]]]
    out.attrs["pairs"] = pd.DataFrame(pairs, columns=["a", "b", "rel_fro", "worst_group"])
    return out
