"""Step ladders: how two same-seed runs drift apart as training proceeds.

Input is a ladder ``{run_label: {step: path_or_TensorSet}}``: checkpoints of two or more
runs at the same claimed steps. Before anything is compared, every checkpoint's own
record of its step is checked against the claim, because a run that died before its
final save leaves a step-0 file where the step-50 one should be, and a ladder built on
it reports "no divergence at step 50" for a step that never ran.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from dmlib.errors import DmlibError
from dmlib.forensics.factors import FactorGroup, as_groups, layers_of
from dmlib.sources import Patterns, Source, name_filter, open_source, select
from dmlib.stats.matrix import pair_problem, renamed_runs, run_renames, single_arrays
from dmlib.tensor import ArrayTensorSet, TensorSet

__all__ = ["check_steps", "growth_rates", "ladder_summary", "small_norm", "step_ladder"]

Ladder = Mapping[str, Mapping[Any, Source]]
StepKey = str | Callable[[TensorSet], Any] | None

# statuses a ladder keeps; every other one is excluded and reported
USABLE = ("ok", "unverified")

CHECK_COLUMNS = ["run", "step", "path", "recorded_step", "status", "detail", "flagged"]
LADDER_COLUMNS = [
    "step",
    "pair",
    "a",
    "b",
    "name",
    "kind",
    "numel",
    "norm",
    "n_diff",
    "max_abs",
    "rel_fro",
    "rank",
]


# ---------------------------------------------------------------------------
# integrity of the claimed steps


def _claimed(step: Any, run: str) -> int:
    try:
        return int(step)
    except (TypeError, ValueError):
        raise DmlibError(f"run {run!r}: step {step!r} is not an integer") from None


def _recorded(ts: TensorSet, step_key: StepKey) -> tuple[Any, str]:
    """(value the checkpoint records as its step or None, where it was looked for)."""
    if callable(step_key):
        return step_key(ts), "step_key callable"
    if step_key is None or step_key == "auto":
        for where, table in (("scalars", ts.scalars), ("metadata", ts.metadata)):
            if "step" in table:
                return table["step"], f"{where}['step']"
        step = _optimizer_step(ts)
        if step is not None:
            return step, "the optimizer's state.*.step"
        return None, "scalars['step'], metadata['step'] or an optimizer's state.*.step"
    source, sep, key = str(step_key).partition(":")
    if not sep or source not in ("scalars", "metadata", "name", "path") or not key:
        raise DmlibError(
            f"invalid step key {step_key!r}; valid: 'auto', 'scalars:KEY', 'metadata:KEY', "
            "'name:REGEX', 'path:REGEX' (REGEX with one group capturing the step) or a callable"
        )
    if source in ("scalars", "metadata"):
        table = ts.scalars if source == "scalars" else ts.metadata
        return table.get(key), f"{source}[{key!r}]"
    try:
        rx = re.compile(key)
    except re.error as err:
        raise DmlibError(f"invalid step key regex {key!r}: {err}") from None
    texts = [ts.path or ""] if source == "path" else list(ts)
    for text in texts:
        m = rx.search(text)
        if m:
            return (m.group(1) if rx.groups else m.group(0)), f"{source} ~ {key!r}"
    return None, f"{source} ~ {key!r}"


_OPT_STEP = re.compile(r"(?:^|\.)state\.[^.]+(?:\.[^.]+)*\.step$")


def _optimizer_step(ts: TensorSet) -> int | None:
    """The step an optimizer's state records (``state.<param>.step``, 0-d, every one
    equal and integral, as Adam's), else None."""
    seen = set()
    for name, t in ts.items():
        if t.shape == () and _OPT_STEP.search(name) and t.dtype.kind in "fiu":
            v = float(t.load())
            if not v.is_integer():
                return None
            seen.add(int(v))
    return seen.pop() if len(seen) == 1 else None


def _check_one(
    run: str, step: int, src: Source, step_key: StepKey, stack: contextlib.ExitStack
) -> tuple[dict[str, Any], TensorSet | None]:
    row: dict[str, Any] = {"run": run, "step": step, "path": None, "recorded_step": None}
    if isinstance(src, (str, os.PathLike)):
        row["path"] = os.fspath(src)
        if not os.path.exists(src):
            row.update(status="missing", detail=f"no such file: {row['path']}", flagged=True)
            return row, None
    try:
        ts = open_source(src, stack)
    except (DmlibError, OSError) as err:
        row.update(status="unreadable", detail=str(err), flagged=True)
        return row, None
    row["path"] = row["path"] or ts.path
    value, where = _recorded(ts, step_key)
    if value is None:
        row.update(status="unverified", detail=f"no recorded step ({where} absent)", flagged=False)
        return row, ts
    try:
        recorded = int(value)
    except (TypeError, ValueError):
        row.update(
            status="unverified", detail=f"{where} = {value!r} is not an integer step", flagged=False
        )
        return row, ts
    row["recorded_step"] = recorded
    if recorded == step:
        row.update(status="ok", detail=f"{where} = {recorded}", flagged=False)
    else:
        detail = f"artifact: recorded step {recorded}, claimed {step}"
        if recorded == 0:
            detail += " — run died before its final save?"
        row.update(status="artifact", detail=detail, flagged=True)
    return row, ts


def _check_all(
    ladder: Ladder, step_key: StepKey, stack: contextlib.ExitStack
) -> tuple[pd.DataFrame, dict[tuple[str, int], TensorSet]]:
    if not isinstance(ladder, Mapping) or not ladder:
        raise DmlibError("a ladder is a non-empty mapping {run_label: {step: path_or_TensorSet}}")
    rows, sets = [], {}
    for run, steps in ladder.items():
        if not isinstance(steps, Mapping):
            raise DmlibError(
                f"run {run!r}: expected a mapping step -> checkpoint, got {type(steps).__name__}"
            )
        for step, src in steps.items():
            claimed = _claimed(step, run)
            row, ts = _check_one(str(run), claimed, src, step_key, stack)
            rows.append(row)
            if ts is not None:
                sets[(str(run), claimed)] = ts
    df = pd.DataFrame(rows, columns=CHECK_COLUMNS)
    df["recorded_step"] = df["recorded_step"].astype("Int64")
    return df, sets


def check_steps(ladder: Ladder, *, step_key: StepKey = "auto") -> pd.DataFrame:
    """Check the step each checkpoint records about itself against the step claimed.

    Parameters
    ----------
    ladder
        ``{run_label: {claimed_step: path_or_TensorSet}}``.
    step_key
        Where a checkpoint records its step: ``"auto"`` (``scalars['step']``, else
        ``metadata['step']``), ``"scalars:KEY"``, ``"metadata:KEY"``, ``"name:REGEX"``
        (a tensor name; group 1 captures the step), ``"path:REGEX"``, or a callable
        ``TensorSet -> step or None``.

    Returns
    -------
    DataFrame
        One row per checkpoint: ``run``, ``step`` (claimed), ``path``, ``recorded_step``,
        ``status`` ("ok", "unverified" [no recorded step found], "artifact" [recorded
        differs from claimed], "missing", "unreadable"), ``detail`` (the reason, or the
        reader's error text) and ``flagged`` (True for artifact/missing/unreadable).
        Never raises for a bad checkpoint: each is a row.
    """
    with contextlib.ExitStack() as stack:
        return _check_all(ladder, step_key, stack)[0]


# ---------------------------------------------------------------------------
# the ladder itself


NORM_CHUNK = 1 << 20  # elements per float64 partial sum of a norm


def _norm(arr: np.ndarray, chunk: int = NORM_CHUNK) -> float:
    """||a||_F in float64 over the finite elements, a chunk at a time."""
    from dmlib._blas import one_thread

    flat = np.asarray(arr).reshape(-1)
    total = 0.0
    with one_thread():  # a threaded dot splits the sum by the number of threads
        for i in range(0, flat.size, chunk):
            x = flat[i : i + chunk].astype(np.float64)
            x = x[np.isfinite(x)]
            total += float(np.dot(x, x))
    return float(np.sqrt(total))


def _numeric(t: Any) -> bool:
    return not t.quantized and t.dtype.kind in "fiub"


class _Shared:
    """What every pair of a ladder shares: each tensor sorted into distinct contents once
    (:func:`dmlib.engine.local.group_contents`), each distinct pair of contents compared
    once (as :func:`dmlib.matrix` does), each distinct content's norm taken once. With
    engine "dask" the hashes, the distinct pairs' pieces and the norms are tasks on Dask's
    current scheduler, read where they run."""

    def __init__(self, engine: str = "local") -> None:
        from dmlib import hashing
        from dmlib.kernels.pair import DEFAULT_CHUNK
        from dmlib.stats.matrix import distinct_rows

        self.contents: dict[int, Any] = {}  # id of a tensor -> its Content
        self.remote = None
        if engine == "dask":
            from dmlib.engine.dask import DaskPairs

            self.remote = DaskPairs(DEFAULT_CHUNK, hashing.DEFAULT)
        self.pair_row = distinct_rows(self.contents, self.remote)
        self.norms: dict[Any, float] = {}

    def hash(self, tensors: Iterable[Any]) -> None:
        """Sort ``tensors`` into contents (each content's BLAKE3 digest reported in the rows)."""
        from dmlib import hashing
        from dmlib.kernels.pair import DEFAULT_CHUNK

        todo = [t for t in tensors if id(t) not in self.contents]
        if self.remote is None:
            from dmlib.engine.local import group_contents
            from dmlib.stats.compare import pair_workers

            got = group_contents(todo, DEFAULT_CHUNK, hashing.DEFAULT, pair_workers())
        else:
            from dmlib.engine.dask import contents_from_digests

            got = contents_from_digests(todo, hashing.DEFAULT)
        self.contents.update(got)

    def _key(self, t: Any) -> Any:
        # one content: the same bytes, the same norm
        c = self.contents.get(id(t))
        return id(t) if c is None else ("content", c.key)

    def prefetch_norms(self, tensors: Iterable[Any]) -> None:
        """Norms of the numeric ``tensors`` in one Dask graph (engine "dask"; else nothing)."""
        if self.remote is None:
            return
        from dmlib.engine.dask_reads import norms

        todo: dict[Any, Any] = {}
        for t in tensors:
            k = self._key(t)
            if _numeric(t) and k not in self.norms:
                todo.setdefault(k, t)
        self.norms.update(zip(todo, norms(list(todo.values()), NORM_CHUNK), strict=True))

    def norm(self, t: Any) -> float:
        k = self._key(t)
        if k not in self.norms:
            if self.remote is not None:
                self.prefetch_norms([t])
            else:
                self.norms[k] = _norm(t.load(), NORM_CHUNK)
        return self.norms[k]


def _compare(
    sa: TensorSet, sb: TensorSet, kind: str, shared: _Shared | None = None
) -> list[dict[str, Any]]:
    """Rows of ``dmlib.compare`` for two sets, with each tensor's own norm."""
    from dmlib.stats.compare import compare_sets, compare_with
    from dmlib.stats.options import CompareOptions

    opts = CompareOptions(file_hashes=False, progress=False)
    if shared is None:
        df = compare_with(sa, sb, opts)
    else:
        df = compare_sets(
            sa, sb, opts,
            digests_known=True,  # each content's digest comes from shared.contents
            pair_row=shared.pair_row,
        )  # fmt: skip
    rows = []
    for r in df.itertuples(index=False):
        t = sa[r.name]
        numeric = _numeric(t)
        norm = (shared.norm(t) if shared is not None else _norm(t.load())) if numeric else None
        rows.append(
            {
                "name": r.name,
                "kind": kind,
                "numel": int(r.numel),
                "norm": float("nan") if norm is None else norm,
                "n_diff": int(r.n_diff),
                # compare leaves max_abs null when no finite pair differs
                "max_abs": float(r.max_abs)
                if pd.notna(r.max_abs)
                else (0.0 if numeric else float("nan")),
                "rel_fro": float(r.rel_fro) if pd.notna(r.rel_fro) else float("nan"),
                # kept for attrs["located"] (not a column)
                "first_diff": r.first_diff if r.n_diff else None,
            }
        )
    return rows


def _effective_rows(
    group: FactorGroup, prefix: str, factors_a: Iterable[Any], factors_b: Iterable[Any],
    load: Callable[[Any], np.ndarray],
) -> list[dict[str, Any]]:  # fmt: skip
    """The ladder row of one factorised layer (where the factors are: here or on a worker)."""
    ea = group.effective((load(x) for x in factors_a), where=repr(prefix))
    eb = group.effective((load(x) for x in factors_b), where=repr(prefix))
    return _compare(ArrayTensorSet({prefix: ea}), ArrayTensorSet({prefix: eb}), "effective")


def _effective_task(group: FactorGroup, prefix: str, refs_a: Any, refs_b: Any) -> Any:
    """:func:`_effective_rows` on a Dask worker, its factors read from their paths."""
    from dmlib.engine.refs import load

    try:
        return _effective_rows(group, prefix, refs_a, refs_b, load)
    except DmlibError as err:  # the message travels; the driver raises it
        return str(err)


def _plain(ts: TensorSet, keep: Callable[[str], bool], groups: list[FactorGroup] | None) -> list:
    """The tensors of ``ts`` compared as themselves (kept, not a factor of a layer)."""
    factors = {n for _, names in layers_of(ts, groups).values() for n in names} if groups else set()
    return [t for t in ts.disk_order() if keep(t.name) and t.name not in factors]


def _pair_rows(
    sa: TensorSet,
    sb: TensorSet,
    keep: Callable[[str], bool],
    groups: list[FactorGroup] | None,
    shared: _Shared | None = None,
) -> list[dict[str, Any]]:
    rows = []
    factor_names: set[str] = set()
    if groups:
        la, lb = layers_of(sa, groups), layers_of(sb, groups)
        eff_a, eff_b, tasks = {}, {}, []
        for prefix in sorted(set(la) & set(lb)):
            g, names = la[prefix]
            factor_names.update(names)
            if not keep(prefix):
                continue
            if shared is not None and shared.remote is not None:
                # a whole layer per task: the product needs every factor whole
                from dmlib.engine.refs import ref_of

                ra = tuple(ref_of(sa[n]) for n in names)
                tasks.append((g, prefix, ra, tuple(ref_of(sb[n]) for n in names)))
                continue
            eff_a[prefix] = g.effective((sa[n].load() for n in names), where=repr(prefix))
            eff_b[prefix] = g.effective((sb[n].load() for n in names), where=repr(prefix))
        if eff_a:
            rows += _compare(ArrayTensorSet(eff_a), ArrayTensorSet(eff_b), "effective")
        if tasks:
            from dmlib.engine.dask_reads import map_tasks

            for got in map_tasks(_effective_task, tasks):
                if isinstance(got, str):
                    raise DmlibError(got, path=sa.path)
                rows += got
    plain = [n for n in sa if n not in factor_names and n in sb and keep(n)]
    rows += _compare(
        TensorSet({n: sa[n] for n in plain}), TensorSet({n: sb[n] for n in plain}), "tensor",
        shared,
    )  # fmt: skip
    return rows


def step_ladder(
    ladder: Ladder,
    *,
    reference: str | None = None,
    include: Patterns = None,
    exclude: Patterns = None,
    groups: FactorGroup | list[FactorGroup] | None = None,
    step_key: StepKey = "auto",
    keep_flagged: bool = False,
    engine: str = "local",
    mapping: Any = None,
    rename: Any = None,
    group_l2: Any = None,
) -> pd.DataFrame:
    """Divergence of every tensor between runs, at every step of a ladder.

    Parameters
    ----------
    ladder
        ``{run_label: {claimed_step: path_or_TensorSet}}``, two runs or more.
    reference
        Compare every other run against this one; default: all pairs of runs.
    include, exclude
        Name patterns of tensors (or layers): globs, or ``"re:<regex>"``.
    groups
        Factor groups: their layers are compared by effective weight (``kind``
        "effective", named by prefix) instead of factor by factor.
    step_key
        See :func:`check_steps`.
    keep_flagged
        Compare flagged checkpoints too (artifacts). Default False: they are excluded,
        so no step is reported that was not really reached.
    engine
        ``"local"``: threads of this process; ``"dask"``: the hashes, the distinct pairs'
        pieces, the norms and one task per factorised layer on Dask's current scheduler,
        read by the workers from the checkpoints' paths. The same frame.
    mapping
        Runs converted to other names and layouts, seen at every step through a mapping
        onto the reference's names (``reference``, else the first run without a mapping):
        ``{run: MAP.toml}``, or one mapping for the runs lacking some of the reference's
        names (see :func:`dmlib.matrix`). ``attrs["mapped"]`` says what each did.
    rename
        Runs saved under other names, each checkpoint's names mapped first:
        ``{run: "OLD=NEW"}`` or ``["RUN:OLD=NEW", ...]`` (see :func:`dmlib.matrix`). Two
        checkpoints of a step that share no tensor name compare nothing: refused with the
        rename that would pair them; a pair sharing few names is listed in
        ``attrs["name_warnings"]``.
    group_l2
        Groups of tensors whose global relative L2 (:func:`dmlib.group_l2`: ``||a - b|| /
        ||a||`` over the concatenation of the group's tensors, in float64) is also given
        per step and pair: ``"all"``, ``"adapter"``, a pattern, ``"LABEL=PATTERN"``, a
        list of them or a mapping ``{label: pattern}``; the patterns match the names as
        compared (after ``rename`` and ``mapping``), whatever ``include`` and ``exclude``
        (a group is its own selection). Computed in this process whatever the ``engine``. A group that matches no float tensor held by both checkpoints of a
        step's pair is refused (a relative L2 over nothing is no figure).

    Returns
    -------
    DataFrame
        Long form, one row per (step, pair, name): ``step``, ``pair`` ("a/b"), ``a``,
        ``b``, ``name``, ``kind`` ("tensor", or "effective" for a factor group's layer),
        ``numel``, ``norm`` (||a||_F of the tensor itself, finite elements), ``n_diff``,
        ``max_abs``, ``rel_fro`` (as ``dmlib.compare`` computes them), ``rank`` (1 = the
        fastest mover by rel_fro within its step and pair). ``attrs["checks"]`` is :func:`check_steps` as records;
        ``attrs["excluded"]`` the checkpoints left out and why. With a ``mapping``,
        ``attrs["located"]`` lists each differing tensor's first difference per step and
        pair: ``step``, ``pair``, ``name``, ``target`` (``name[k, l]``) and, per mapped
        side, ``source_a``/``source_b`` (``source[i, j]`` in the source's coordinates).
        With ``group_l2``, ``attrs["group_l2"]`` holds one record per (step, pair, group):
        ``step``, ``pair``, ``a``, ``b``, the columns of :func:`dmlib.group_l2`
        (``group``, ``pattern``, ``n_tensors``, ``numel``, ``norm_a``, ``norm_diff``,
        ``rel_l2``, ``n_not_compared``) and ``growth`` (``rel_l2`` over the pair's
        ``rel_l2`` at its previous step compared; NaN at its first step or after a 0);
        ``attrs["group_l2_growth"]`` one per (pair, group): ``step_first``, ``step_last``,
        ``rel_l2_first``, ``rel_l2_last``, ``factor`` (last over first) and ``slope``
        (decades of ``rel_l2`` per step, least squares over the steps where it is > 0, as
        :func:`growth_rates`; NaN with fewer than two), ``n_steps``.
    """
    from dmlib.engine import check_engine

    check_engine(engine)
    if mapping is not None and engine != "local":  # workers read the files, not a chain
        raise DmlibError("a mapping is applied in this process: use engine='local'")
    renames = run_renames(rename, [str(r) for r in ladder])
    with contextlib.ExitStack() as stack:
        checks, sets = _check_all(ladder, step_key, stack)
        for (run, step), ts in list(sets.items()):
            sets[(run, step)] = renamed_runs({run: ts}, renames)[run]
        for step in {s for _, s in sets}:  # lone .npy files: one array each, as compare pairs them
            sets.update(single_arrays({k: v for k, v in sets.items() if k[1] == step}))
        sets, mapped = _map_steps(sets, mapping, reference, [str(r) for r in ladder])
        df = _ladder(
            ladder, checks, sets, reference, include, exclude, groups, keep_flagged, engine,
            group_l2,
        )  # fmt: skip
        df.attrs["mapped"] = mapped
        return df


def _map_steps(
    sets: dict[tuple[str, int], TensorSet], mapping: Any, reference: str | None, runs: list[str]
) -> tuple[dict[tuple[str, int], TensorSet], dict[str, Any]]:
    """Each mapped run's checkpoints seen through its mapping, step by step, onto the
    names of the reference's checkpoint at that step (or its first one)."""
    if mapping is None:
        return sets, {}
    from dmlib.stats.mapped import is_per_run, map_runs

    per_run = is_per_run(mapping)
    ref = reference or next((r for r in runs if not per_run or r not in mapping), runs[0])
    ref_sets = [ts for (r, _), ts in sorted(sets.items()) if r == ref]
    if not ref_sets:
        raise DmlibError(f"reference run {ref!r} has no usable checkpoint to map onto")
    out = dict(sets)
    info: dict[str, Any] = {}
    for step in sorted({s for _, s in sets}):
        group = {r: ts for (r, s), ts in sets.items() if s == step and r != ref}
        group = {ref: sets.get((ref, step), ref_sets[0]), **group}
        m = {r: v for r, v in mapping.items() if r in group} if per_run else mapping
        mapped, about = map_runs(group, m, ref)
        for r in about:
            out[(r, step)] = mapped[r]
            info.setdefault(r, about[r])
    return out, info


def _ladder(
    ladder: Ladder,
    checks: pd.DataFrame,
    sets: dict[tuple[str, int], TensorSet],
    reference: str | None,
    include: Patterns,
    exclude: Patterns,
    groups: FactorGroup | Iterable[FactorGroup] | None,
    keep_flagged: bool,
    engine: str = "local",
    group_l2: Any = None,
) -> pd.DataFrame:
    runs = list(dict.fromkeys(str(r) for r in ladder))
    if len(runs) < 2:
        raise DmlibError(f"a ladder needs two runs or more, got {runs}")
    if reference is not None and reference not in runs:
        raise DmlibError(f"reference run {reference!r} is not in the ladder; runs: {runs}")
    usable = checks["status"].isin(USABLE) | (keep_flagged & checks["status"].eq("artifact"))
    good = {(r, s) for r, s, u in zip(checks["run"], checks["step"], usable, strict=True) if u}
    pairs = (
        [(reference, r) for r in runs if r != reference]
        if reference is not None
        else list(itertools.combinations(runs, 2))
    )
    keep = name_filter(include, exclude)
    gs = as_groups(groups) if groups is not None else None
    steps = sorted({s for _, s in good})
    rows = []
    # every checkpoint's tensors sorted into contents up front: pairs of equal contents
    # (bit-identical runs) then cost no second read, and each distinct pair is compared once
    shared = _Shared(engine)
    shared.hash(t for key in sorted(good) for t in sets[key].disk_order() if keep(t.name))
    plan = [
        (step, ra, rb)
        for step in steps
        for ra, rb in pairs
        if (ra, step) in good and (rb, step) in good
    ]
    # the a side's norms (rows quote ||a||), each distinct content once, in one graph
    shared.prefetch_norms(
        t for key in dict.fromkeys((ra, step) for step, ra, _ in plan)
        for t in _plain(sets[key], keep, gs)
    )  # fmt: skip
    if shared.remote is not None:  # every distinct pair of contents in one graph
        together = []
        for step, ra, rb in plan:
            sa, sb = sets[(ra, step)], sets[(rb, step)]
            for ta in _plain(sa, keep, gs):
                tb = sb.get(ta.name)
                if tb is not None and (tb.dtype, tb.shape) == (ta.dtype, ta.shape):
                    together.append((ta, tb))
        shared.pair_row.prepare(together)  # type: ignore[attr-defined]
    warnings = _check_names(plan, sets, include, exclude)
    # before the comparisons: a group that matches nothing is refused at once
    by_group = None if group_l2 is None else _group_l2_rows(plan, sets, group_l2)
    located = []
    for step, ra, rb in plan:
        sa, sb = sets[(ra, step)], sets[(rb, step)]
        got = _pair_rows(sa, sb, keep, gs, shared)
        for row in got:
            rows.append({"step": step, "pair": f"{ra}/{rb}", "a": ra, "b": rb, **row})
        located += _located(step, f"{ra}/{rb}", got, sa, sb)
    df = pd.DataFrame(rows, columns=LADDER_COLUMNS)
    df.attrs["located"] = located
    df.attrs["name_warnings"] = warnings
    if len(df):
        df["rank"] = (
            df.groupby(["step", "pair"])["rel_fro"]
            .rank(ascending=False, method="min")
            .astype("Int64")
        )
    else:
        df["rank"] = df["rank"].astype("Int64")
    df.attrs["checks"] = checks.astype(object).where(checks.notna(), None).to_dict("records")
    df.attrs["excluded"] = [c for c, u in zip(df.attrs["checks"], usable, strict=True) if not u]
    if by_group is not None:
        df.attrs["group_l2"] = by_group
        df.attrs["group_l2_growth"] = _group_l2_growth(by_group)
    return df


def _group_l2_rows(
    plan: list[tuple[int, str, str]], sets: dict[tuple[str, int], TensorSet], groups: Any
) -> list[dict[str, Any]]:
    """The global relative L2 of each group per step and pair (``attrs["group_l2"]``),
    over the checkpoints as compared; a group of no comparable tensor refused."""
    from dmlib.stats.group_l2 import group_l2_records, parse_groups

    wanted = parse_groups(groups)
    rows: list[dict[str, Any]] = []
    before: dict[tuple[str, str], float] = {}
    for step, ra, rb in sorted(plan):
        sa, sb = sets[(ra, step)], sets[(rb, step)]
        for r in group_l2_records(sa, sb, wanted):
            if r["n_tensors"] == 0:
                raise DmlibError(_empty_group(r, f"{ra} and {rb} at step {step}"), path=sa.path)
            key = (f"{ra}/{rb}", r["group"])
            prev = before.get(key)
            before[key] = r["rel_l2"]
            growth = r["rel_l2"] / prev if prev else float("nan")  # prev 0: no ratio
            rows.append({"step": step, "pair": key[0], "a": ra, "b": rb, **r, "growth": growth})
    return rows


def _empty_group(row: dict[str, Any], where: str) -> str:
    """Why a group's relative L2 is refused: it matches no float tensor both sides hold."""
    pattern = "every tensor" if row["pattern"] is None else f"pattern {row['pattern']!r}"
    text = f"group {row['group']!r} ({pattern}) matches no float tensor held by both {where}"
    if row["n_not_compared"]:
        text += (
            f" ({row['n_not_compared']} of its names one side lacks, or not float tensors of "
            "the same shape)"
        )
    return text + ": a relative L2 over nothing is no figure"


def _group_l2_growth(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per pair and group: its relative L2 at the first and last step, their ratio and the
    slope of log10 rel_l2 per step (``attrs["group_l2_growth"]``)."""
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault((r["pair"], r["group"]), []).append(r)
    out = []
    for (pair, group), rs in series.items():
        first, last = rs[0]["rel_l2"], rs[-1]["rel_l2"]
        steps = np.array([r["step"] for r in rs])
        fit = _fit(steps, np.array([r["rel_l2"] for r in rs], dtype=np.float64))
        factor = last / first if first else float("nan")
        out.append({
            "pair": pair, "group": group, "step_first": int(steps[0]),
            "step_last": int(steps[-1]), "rel_l2_first": first, "rel_l2_last": last,
            "factor": factor, "slope": fit["slope"], "n_steps": fit["n_steps"],
        })  # fmt: skip
    return out


def _check_names(
    plan: list[tuple[int, str, str]],
    sets: dict[tuple[str, int], TensorSet],
    include: Patterns,
    exclude: Patterns,
) -> list[dict[str, Any]]:
    """Refuse a pair of checkpoints that would compare nothing (no shared name, or none of
    the same dtype and shape); the pairs sharing few names, one record per run pair."""
    warnings: dict[str, dict[str, Any]] = {}
    used = {key for step, ra, rb in plan for key in ((ra, step), (rb, step))}
    names = {id(sets[k]): select([t.name for t in sets[k].disk_order()], include, exclude)
             for k in used}  # fmt: skip
    for step, ra, rb in plan:
        sa, sb = sets[(ra, step)], sets[(rb, step)]
        p = pair_problem(ra, sa, rb, sb, include, exclude, names=names)
        if p is None:
            continue
        if p["kind"] != "few_shared":
            raise DmlibError(f"step {step}: {p['message']}")
        warnings.setdefault(f"{ra}/{rb}", {"pair": f"{ra}/{rb}", "step": step, **p})
    return list(warnings.values())


def _located(
    step: int, pair: str, rows: list[dict[str, Any]], sa: TensorSet, sb: TensorSet
) -> list[dict[str, Any]]:
    """The first difference of each differing tensor of a pair with a mapped side, as
    ``target`` (``name[k, l]``) and ``source_a``/``source_b`` (``source[i, j]`` on each
    mapped side, traced through its mapping): records for ``attrs["located"]``."""
    if "mapping" not in sa.layout and "mapping" not in sb.layout:
        return []
    from dmlib.stats.mapped import locate_rows

    plain = [r for r in rows if r["kind"] == "tensor"]
    found = locate_rows(plain, sa, sb)
    return [{"step": step, "pair": pair, "name": n, **where} for n, where in found.items()]


# ---------------------------------------------------------------------------
# growth per step


def _keys(df: pd.DataFrame, by: Any) -> tuple[str, pd.Series]:
    if isinstance(by, str):
        if by not in df.columns:
            raise DmlibError(
                f"growth_rates: by={by!r} is not a column of the ladder ({list(df.columns)}); "
                "pass a column name, a mapping name -> group, a compiled regex or a callable"
            )
        return by, df[by]
    names = df["name"]
    if isinstance(by, Mapping):
        return "group", names.map(lambda n: by.get(n))
    if isinstance(by, re.Pattern):

        def key(n: str) -> str | None:
            m = by.search(n)
            if m is None:
                return None
            return m.group(1) if by.groups else m.group(0)

        return "group", names.map(key)
    if callable(by):
        return "group", names.map(by)
    raise DmlibError(f"growth_rates: cannot group by a {type(by).__name__}")


def _fit(steps: np.ndarray, rel: np.ndarray) -> dict[str, Any]:
    ok = np.isfinite(rel) & (rel > 0)
    x, y = steps[ok].astype(np.float64), np.log10(rel[ok])
    out: dict[str, Any] = {"n_steps": int(ok.sum())}
    if ok.sum() >= 2 and np.ptp(x) > 0:
        xm, ym = x.mean(), y.mean()
        slope = float(((x - xm) * (y - ym)).sum() / ((x - xm) ** 2).sum())
        out.update(slope=slope, intercept=float(ym - slope * xm))
    else:
        out.update(slope=float("nan"), intercept=float("nan"))
    out.update(
        step_min=int(x.min()) if x.size else None,
        step_max=int(x.max()) if x.size else None,
    )
    return out


def growth_rates(df: pd.DataFrame, *, by: Any = "name") -> pd.DataFrame:
    """Growth of divergence per step: slope of log10(rel_fro) against step.

    Parameters
    ----------
    df
        A :func:`step_ladder` frame.
    by
        ``"name"`` (per tensor), another column name (e.g. ``"kind"``), a mapping
        name -> group, a compiled regex (group 1, else the whole match, is the group),
        or a callable name -> group; names mapped to None are left out. A group's
        rel_fro at a step is ``sqrt(sum (rel_fro*norm)^2) / sqrt(sum norm^2)`` over its
        members, i.e. the rel_fro of the members concatenated.

    Returns
    -------
    DataFrame
        One row per (pair, key): ``pair``, the key column, ``slope`` (decades per step;
        least squares over the steps where rel_fro > 0), ``intercept``, ``n_steps``,
        ``step_min``, ``step_max``. ``slope`` is NaN with fewer than two such steps.
    """
    key_col, keys = _keys(df, by)
    work = pd.DataFrame(
        {
            "pair": df["pair"],
            "step": df["step"],
            "key": keys,
            "d2": (df["rel_fro"].astype(float) * df["norm"].astype(float)) ** 2,
            "n2": df["norm"].astype(float) ** 2,
            "rel_fro": df["rel_fro"].astype(float),
        }
    ).dropna(subset=["key"])
    if key_col == "name":
        per_step = work[["pair", "key", "step", "rel_fro"]]
    else:
        agg = work.groupby(["pair", "key", "step"], sort=True)[["d2", "n2"]].sum().reset_index()
        with np.errstate(divide="ignore", invalid="ignore"):
            agg["rel_fro"] = np.sqrt(agg["d2"]) / np.sqrt(agg["n2"])
        per_step = agg[["pair", "key", "step", "rel_fro"]]
    rows = []
    for (pair, key), g in per_step.groupby(["pair", "key"], sort=True):
        fit = _fit(g["step"].to_numpy(), g["rel_fro"].to_numpy(dtype=np.float64))
        rows.append({"pair": pair, key_col: key, **fit})
    cols = ["pair", key_col, "slope", "intercept", "n_steps", "step_min", "step_max"]
    out = pd.DataFrame(rows, columns=cols)
    out["step_min"] = out["step_min"].astype("Int64")
    out["step_max"] = out["step_max"].astype("Int64")
    return out


# ---------------------------------------------------------------------------
# one line per pair


def ladder_summary(df: pd.DataFrame, *, top: int = 3) -> pd.DataFrame:
    """Per pair of runs: where it first diverges, the fastest movers, the growth rate.

    Parameters
    ----------
    df
        A :func:`step_ladder` frame.
    top
        Fastest movers (largest rel_fro at the last compared step, rel_fro > 0) listed.

    Returns
    -------
    DataFrame
        One row per pair: ``pair``, ``steps`` (compared steps), ``identical`` (every
        tensor bit-identical at every step), ``first_diff_step`` (first step at which
        any tensor differs, else None), ``last_step``, ``movers`` (``[(name, rel_fro)]``
        at the last step), ``slope`` (decades of rel_fro per step of all tensors taken
        together, least squares over the steps where it is > 0; NaN with fewer than two),
        ``n_steps_fit``.
    """
    rows = []
    whole = growth_rates(df, by=lambda _: "all") if len(df) else None
    for pair, g in df.groupby("pair", sort=False):
        steps = sorted(int(s) for s in g["step"].unique())
        per_step = g.groupby("step")["n_diff"].sum()
        differ = [int(s) for s, n in per_step.items() if n > 0]
        last = g[g["step"] == steps[-1]]
        movers = last[last["rel_fro"] > 0].sort_values("rel_fro", ascending=False).head(top)
        fit = whole[whole["pair"] == pair].iloc[0] if whole is not None else None
        rows.append(
            {
                "pair": pair,
                "steps": steps,
                "identical": not differ,
                "first_diff_step": differ[0] if differ else None,
                "last_step": steps[-1],
                "movers": [
                    (str(n), float(r))
                    for n, r in zip(movers["name"], movers["rel_fro"], strict=True)
                ],
                "slope": float("nan") if fit is None else float(fit["slope"]),
                "n_steps_fit": 0 if fit is None else int(fit["n_steps"]),
            }
        )
    out = pd.DataFrame(
        rows,
        columns=[
            "pair",
            "steps",
            "identical",
            "first_diff_step",
            "last_step",
            "movers",
            "slope",
            "n_steps_fit",
        ],
    )
    out["first_diff_step"] = out["first_diff_step"].astype("Int64")
    return out


def small_norm(df: pd.DataFrame, below: float) -> tuple[list[str], int]:
    """The parameters of a :func:`step_ladder` frame whose Frobenius norm in the reference
    run at the first step compared is below ``below``: ``(sorted names, that step)``.

    A parameter whose norm is not recorded (NaN) is not counted as small.
    """
    for col in ("step", "name", "norm"):
        if col not in df.columns:
            raise DmlibError(f"small_norm needs a step_ladder frame: no column {col!r}")
    if not len(df):
        raise DmlibError("small_norm: the step_ladder frame is empty")
    first_step = int(df["step"].min())
    ref_norm = df[df["step"].eq(first_step)].groupby("name")["norm"].first()
    return sorted(ref_norm[ref_norm < below].index), first_step
