"""Every pair of several runs, compared at once, and the verdict a reproducibility study needs.

Same-seed runs should differ far less than a different-seed control. :func:`matrix`
compares all pairs into one long-form DataFrame and :func:`verdict` reads it: the worst
same-seed divergence against the control's, their separation in orders of magnitude,
which pairs are bit-identical, and which tensors never differ.

Cost is proportional to the distinct contents, not to the number of pairs: every tensor
of every run is sorted into distinct contents once (:func:`dmlib.engine.local.group_contents`:
compared byte by byte with the first run's tensor, hashed only where it differs from it),
a pair of one content gets the identical row without being read again, and the full
statistics are computed once per distinct (name, content a, content b) and reused by
every pair that holds the same two contents. Fifty runs of which 45 are bit-identical
cost about fifty reads, not 1,225 comparisons. Hashes (``data_hash_a``/``_b``) are
computed once per distinct content, or not at all with ``hash="none"``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from dmlib.engine.local import Content, group_contents
from dmlib.errors import DmlibError
from dmlib.kernels.pair import DEFAULT_CHUNK, NULLABLE_INT, identical_row, same_layout
from dmlib.sources import Patterns, Source, check_selection, opened, select
from dmlib.stats.compare import (
    COLUMNS,
    _num,
    compare_sets,
    pair_workers,
    summarize_records,
)
from dmlib.stats.mapped import locate_rows, map_runs
from dmlib.stats.options import CompareOptions
from dmlib.stats.verdicts import MatrixVerdict
from dmlib.tensor import Tensor

if TYPE_CHECKING:  # imported where the frame is built: the command line starts without it
    import pandas as pd


def matrix(
    runs: Mapping[str, Source],
    *,
    control: str | None = None,
    include: Patterns = None,
    exclude: Patterns = None,
    file_hashes: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK,
    progress: bool | None = None,
    hash: str | None = None,
    engine: str = "local",
    mapping: Any = None,
    rename: Any = None,
) -> pd.DataFrame:
    """Compare every pair of runs (``n (n-1) / 2`` pairs) into one long-form DataFrame.

    Parameters
    ----------
    runs
        Label -> path or TensorSet, in the order pairs are formed (``a`` before ``b``).
    control
        Label of the run expected to differ (e.g. another seed); its pairs are the
        yardstick the others are measured against.
    include, exclude, chunk_bytes, progress, hash
        As for :func:`dmlib.compare`; patterns apply to every run.
    file_hashes
        Hash whole files too (off by default: each file would be read once per pair).
    engine
        ``"local"``: threads of this process; ``"dask"``: the hashes and the distinct
        pairs' pieces as tasks on Dask's current scheduler (see :func:`dmlib.compare`).
    mapping
        Runs converted to other names and layouts, seen through a mapping onto the
        reference's names (the first run without one): ``{run: MAP.toml}``, or one mapping
        for every run that lacks some of the first run's names (``docs/mapping.md``).
        ``attrs["mapped"]`` says what each mapping did (what it leaves out included) and
        ``attrs["pairs"][...]["located"]`` gives each first difference in the sources'
        coordinates too.
    rename
        Runs saved under other names, mapped first (as study.toml's ``[names]``):
        ``{run: "OLD=NEW"}`` (or a list of rules) or ``["RUN:OLD=NEW", ...]``; OLD is a
        prefix replaced by NEW, ``RUN:re:REGEX=REPL`` a regular expression
        (:class:`dmlib.names.Rename`).

    Two runs that share no tensor name, or whose shared tensors all differ in dtype or
    shape, compare nothing: that is refused (:class:`DmlibError`, naming the ``rename``
    that would pair them), never reported as a pair without differences.

    Returns
    -------
    pandas.DataFrame
        Columns ``a``, ``b`` (labels) then every :func:`dmlib.compare` column.
        ``attrs["verdict"]`` is :func:`verdict` of it, ``attrs["pairs"]`` maps
        ``"a/b"`` to that pair's compare attrs.
    """
    opts = CompareOptions(
        include=include, exclude=exclude, file_hashes=file_hashes, chunk_bytes=chunk_bytes,
        progress=progress, hash=hash, engine=engine,
    )  # fmt: skip
    return _frame(*_matrix_rows(runs, control, opts, mapping, rename))


def matrix_records(
    runs: Mapping[str, Source],
    *,
    control: str | None = None,
    mapping: Any = None,
    rename: Any = None,
    **kwargs: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """:func:`matrix` as ``(rows, attrs)``: plain dicts (every column, None where null) and
    the attrs, verdict included, without importing pandas (the command line's path).
    ``kwargs``: :func:`matrix`'s comparison settings (:class:`CompareOptions`' fields)."""
    return _matrix_rows(runs, control, CompareOptions(**kwargs), mapping, rename)


def _matrix_rows(
    runs: Mapping[str, Source],
    control: str | None,
    opts: CompareOptions,
    mapping: Any = None,
    rename: Any = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The matrix's rows and attrs; ``mapping``: :func:`matrix`'s (runs seen through a
    mapping), apart from ``opts.mapping``, compare's single-pair mapping, refused here."""
    labels = list(runs)
    if len(labels) < 2:
        raise DmlibError(f"matrix needs at least two runs, got {len(labels)}")
    if control is not None and control not in runs:
        raise DmlibError(f"control {control!r} is not one of the runs ({', '.join(labels)})")
    renames = run_renames(rename, labels)
    for key, off in (("rename", None), ("cross_dtype", False), ("mapping", None)):
        if getattr(opts, key) != off:  # settings of compare that matrix does not apply
            raise DmlibError(f"matrix does not take {key}= (a setting of dmlib.compare only)")
    if opts.engine == "dask" and mapping is not None:  # workers read files, not a chain
        raise DmlibError("a mapping is applied in this process: use engine='local'")
    include, exclude, chunk_bytes = opts.include, opts.exclude, opts.chunk_bytes
    hash_name = opts.hash_name
    remote = None
    if opts.engine == "dask":
        from dmlib.engine.dask import DaskPairs

        remote = DaskPairs(chunk_bytes, None)
    all_rows: list[dict[str, Any]] = []
    pair_attrs: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        sets = {label: stack.enter_context(opened(src)) for label, src in runs.items()}
        sets = single_arrays(renamed_runs(sets, renames))
        sets, mapped = map_runs(sets, mapping)
        every = list(dict.fromkeys(n for ts in sets.values() for n in ts))
        check_selection(every, [], include, exclude, f"any of the runs {labels}")
        hints = check_pairs(sets, include, exclude, control=control)
        selected = []
        for ts in sets.values():
            names = set(select([t.name for t in ts.disk_order()], include, exclude))
            selected += [t for t in ts.disk_order() if t.name in names]
        if remote is None:
            contents = group_contents(selected, chunk_bytes, hash_name, pair_workers())
        else:  # one hashing graph for every tensor of every run; contents by digest
            from dmlib.engine.dask import contents_from_digests

            contents = contents_from_digests(selected, hash_name)
        pair_row = distinct_rows(contents, remote)
        for la, lb in itertools.combinations(labels, 2):
            rows, attrs = compare_sets(
                sets[la],
                sets[lb],
                opts,
                digests_known=True,  # each content's digest comes from the grouping
                pair_row=pair_row,
                frame=False,
            )
            attrs["hash"] = hash_name
            attrs["summary"] = summarize_records(rows, attrs)
            if mapped:
                attrs["located"] = locate_rows(rows, sets[la], sets[lb])
            if (la, lb) in hints:
                attrs["alignment_hint"] = hints[(la, lb)]
            pair_attrs[f"{la}/{lb}"] = attrs
            all_rows += [{"a": la, "b": lb, **r} for r in rows]
    attrs = {"runs": labels, "control": control, "pairs": pair_attrs, "mapped": mapped}
    attrs["verdict"] = _verdict(all_rows, attrs, control)
    return all_rows, attrs


def _frame(rows: list[dict[str, Any]], attrs: dict[str, Any]) -> pd.DataFrame:
    import pandas as pd

    # one DataFrame for all pairs (one per pair cost more than the comparisons)
    out = pd.DataFrame(rows, columns=["a", "b", *COLUMNS])
    for col in NULLABLE_INT:
        out[col] = out[col].astype("UInt64" if col == "max_ulp" else "Int64")
    out.attrs = attrs
    return out


def distinct_rows(
    contents: dict[int, Content], remote: Any = None
) -> Callable[..., dict[str, Any]]:
    """A ``pair_row`` hook: rows from contents when they are known, computed once otherwise."""
    memo: dict[tuple, dict[str, Any]] = {}
    prepared: dict[tuple, tuple[Tensor, Tensor]] = {}  # content key -> the pair computed

    def pair_row(ta: Tensor, tb: Tensor, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        ca, cb = contents.get(id(ta)), contents.get(id(tb))
        if ca is None or cb is None:  # not grouped up front: compare in full
            return compute()
        if ca is cb:
            # one content: equal bytes of equal-layout tensors
            row = identical_row(ta)
        else:
            key = (ta.name, ca.key, cb.key)
            if key not in memo:
                # a pair prepared earlier holds the same two contents: its pieces' results
                ra, rb = prepared.get(key, (ta, tb)) if remote is not None else (ta, tb)
                memo[key] = compute() if remote is None else remote.row(ra, rb)
                memo[key].pop("_hashes", None)
            row = dict(memo[key])  # values are numbers, strings, tuples; shape is a list
            row["shape"] = list(row["shape"])
        row["_hashes"] = (ca.digest, cb.digest if cb is not ca else None)
        return row

    if remote is not None:

        def prepare(pairs: list[tuple[Tensor, Tensor]]) -> None:
            # the pieces of every distinct pair of contents of these pairs, in one graph
            todo: dict[tuple, tuple[Tensor, Tensor]] = {}
            for ta, tb in pairs:
                ca, cb = contents.get(id(ta)), contents.get(id(tb))
                if ca is None or cb is None or ca is cb:
                    continue
                key = (ta.name, ca.key, cb.key)
                if key not in memo and key not in prepared:
                    todo.setdefault(key, (ta, tb))
            remote.prepare(list(todo.values()))
            prepared.update(todo)

        pair_row.prepare = prepare  # type: ignore[attr-defined]
    return pair_row


def verdict(df: pd.DataFrame, *, control: str | None = None) -> MatrixVerdict:
    """Same-seed pairs against the control, from a :func:`matrix` result.

    Returns
    -------
    MatrixVerdict
        A frozen verdict, True only when every pair is bit-identical, printed as the
        command line's lines under the pair table, read like a dict with the keys:
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
    attrs = df.attrs
    # pandas deep-copies attrs (here every pair's compare attrs) into each derived frame:
    # read them once and work on the rows alone
    df.attrs = {}
    try:
        rows = df.to_dict("records")
    finally:
        df.attrs = attrs
    return _verdict(rows, attrs, control)


def _verdict(
    rows: list[dict[str, Any]], attrs: dict[str, Any], control: str | None
) -> MatrixVerdict:
    if control is None:
        control = attrs.get("control")
    pair_attrs = attrs.get("pairs", {})
    by_pair: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        by_pair.setdefault((r["a"], r["b"]), []).append(r)
    pairs = [
        _pair_verdict(by_pair.get((la, lb), []), la, lb, control, pair_attrs.get(f"{la}/{lb}", {}))
        for la, lb in _pair_keys(rows, attrs)
    ]
    same = [p for p in pairs if not p["control"]]
    ctrl = [p for p in pairs if p["control"]]
    same_rel = _worst_of(same, "worst_rel_fro")
    ctrl_rel = _worst_of(ctrl, "worst_rel_fro", min)
    return MatrixVerdict(
        control=control,
        pairs=pairs,
        same_worst_rel_fro=same_rel,
        same_max_ulp=_worst_of(same, "max_ulp"),
        same_worst_median_ulp=_worst_of(same, "worst_median_ulp"),
        same_max_abs=_worst_of(same, "max_abs"),
        control_rel_fro=ctrl_rel,
        control_max_ulp=_worst_of(ctrl, "max_ulp", min),
        separation_orders=_separation(same_rel, ctrl_rel),
        identical_pairs=[f"{p['a']}/{p['b']}" for p in pairs if p["identical"]],
        never_differ=_never_differ(rows, control),
        always_identical=bool(same) and all(p["identical"] for p in same),
    )


def _pair_keys(rows: list[dict[str, Any]], attrs: dict[str, Any]) -> list[tuple[str, str]]:
    """The (a, b) pairs of a matrix's rows, in the order matrix formed them."""
    if "runs" in attrs:
        return list(itertools.combinations(attrs["runs"], 2))
    return list(dict.fromkeys((r["a"], r["b"]) for r in rows))


def _worst(rows: list[dict[str, Any]], col: str) -> float | None:
    vals = [v for v in (_num(r.get(col)) for r in rows) if v is not None]
    return max(vals) if vals else None


def _pair_verdict(
    g: list[dict[str, Any]], la: str, lb: str, control: str | None, attrs: dict[str, Any]
) -> dict[str, Any]:
    """One pair's line of the verdict, from its rows and its compare attrs."""
    mism = bool(attrs.get("only_in_a") or attrs.get("only_in_b") or attrs.get("mismatched"))
    numel, n_diff = sum(int(r["numel"]) for r in g), sum(int(r["n_diff"]) for r in g)
    max_ulp = _worst(g, "max_ulp")
    return {
        "a": la,
        "b": lb,
        "control": control in (la, lb),
        "identical": n_diff == 0
        # (equal when both are None: no hash asked for)
        and all(_same(r.get("data_hash_a"), r.get("data_hash_b")) for r in g)
        and not attrs.get("byte_order_diff")  # equal values, different bytes
        and not attrs.get("scalars_diff")  # a differing scalar is a difference
        and not attrs.get("scalars_only_in_a")  # a value one run holds: not compared
        and not attrs.get("scalars_only_in_b")
        and not attrs.get("not_read_a")  # a file of a checkpoint folder was not read
        and not attrs.get("not_read_b")
        and not mism,
        "numel": numel,
        "n_diff": n_diff,
        "frac_diff": n_diff / numel if numel else 0.0,
        "worst_rel_fro": _worst(g, "rel_fro"),
        "max_ulp": None if max_ulp is None else int(max_ulp),
        # max_ulp is set by the few elements nearest zero, where one ULP is tiny;
        # the worst tensor's median says how far a typical differing element moved
        "worst_median_ulp": _worst(g, "median_ulp"),
        "max_abs": _worst(g, "max_abs"),
    }


def _same(x: Any, y: Any) -> bool:
    """Two hash cells hold the same digest (both null counts as the same: none computed)."""
    return (None if _null(x) else x) == (None if _null(y) else y)


def _null(v: Any) -> bool:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return True
    pd = sys.modules.get("pandas")  # pandas.NA, in a frame's cells
    return pd is not None and v is pd.NA


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


def _never_differ(rows: list[dict[str, Any]], control: str | None) -> list[str]:
    """Tensors with ``n_diff == 0`` in every pair without the control, in order of first row."""
    worst: dict[str, int] = {}
    for r in rows:
        if control is not None and control in (r["a"], r["b"]):
            continue
        name = str(r["name"])
        worst[name] = max(worst.get(name, 0), int(r["n_diff"]))
    return [n for n, v in worst.items() if v == 0]


# -- names: runs saved under other names, and pairs that would compare nothing ----------


def run_renames(spec: Any, labels: list[str]) -> dict[str, list[Any]]:
    """``{run: [Rename...]}`` (each a side-``"a"`` :class:`dmlib.names.Rename`) from
    ``{run: "OLD=NEW" or [rules]}`` (study.toml's ``[names]``) or ``["RUN:OLD=NEW", ...]``
    (the command line's ``--rename``); a run that is not one of ``labels`` is refused."""
    from dmlib.names import Rename

    if spec is None:
        return {}
    items: list[tuple[str, str]] = []
    if isinstance(spec, Mapping):
        for label, rules in spec.items():
            items += [(str(label), str(r)) for r in ([rules] if isinstance(rules, str) else rules)]
    else:
        for text in [spec] if isinstance(spec, str) else spec:
            label, colon, rule = str(text).partition(":")
            if not colon or not label or "=" not in rule:
                raise DmlibError(
                    f"--rename {text!r}: expected RUN:OLD=NEW (e.g. seed1:model.= strips "
                    "'model.' from run seed1's names) or RUN:re:REGEX=REPL"
                )
            items.append((label, rule))
    out: dict[str, list[Any]] = {}
    for label, rule in items:
        if label not in labels:
            raise DmlibError(
                f"rename {label}:{rule}: no run is labelled {label!r} ({', '.join(labels)})"
            )
        try:
            out.setdefault(label, []).append(Rename.parse(f"a:{rule}"))
        except DmlibError:
            raise DmlibError(
                f"rename {label}:{rule}: expected RUN:OLD=NEW (OLD a prefix, NEW its "
                "replacement, one may be empty) or RUN:re:REGEX=REPL"
            ) from None
    return out


def single_arrays(sets: Mapping[Any, Any]) -> dict[Any, Any]:
    """Runs that are each one ``.npy`` file hold one array, named after its file: seen under
    the first run's name, so that they are compared (as :func:`dmlib.compare` pairs two)."""
    out = dict(sets)
    lone = [ts for ts in out.values() if ts.format == "npy" and len(ts) == 1]
    if len(lone) != len(out) or len(out) < 2:
        return out
    (first,) = list(lone[0])
    for key, ts in out.items():
        (name,) = list(ts)
        if name != first:
            out[key] = ts.renamed({name: first})
    return out


def renamed_runs(sets: Mapping[str, Any], renames: Mapping[str, list[Any]]) -> dict[str, Any]:
    """Each run's open set with its names mapped by its rules (the others as they are)."""
    from dmlib.names import apply_renames

    out = dict(sets)
    for label, rules in renames.items():
        if label not in out:
            continue
        try:
            out[label] = apply_renames(out[label], rules, "a")
        except DmlibError as err:
            raise DmlibError(f"run {label!r}: {err.message}", path=err.path) from None
    return out


def pair_problem(
    la: str,
    sa: Any,
    lb: str,
    sb: Any,
    include: Patterns = None,
    exclude: Patterns = None,
    *,
    names: Mapping[int, list[str]] | None = None,
) -> dict[str, Any] | None:
    """What two runs' names leave uncompared: None when they pair well, else a dict with
    ``kind`` (``"no_shared_name"``: nothing compared; ``"nothing_comparable"``: every
    shared name differs in dtype or shape; ``"few_shared"``: a rename pairs at least twice
    as many), ``message`` (one line, the fix included), ``rename`` (``["RUN:OLD=NEW"]``
    rules that pair more names, or []), ``shared_before`` and ``shared_after``.
    ``names``: each set's selected names by ``id()``, when a caller checks many pairs."""
    names_a = _selected(sa, include, exclude, names)
    names_b = _selected(sb, include, exclude, names)
    patterns = bool(include or exclude)
    if names_a == names_b and names_a and any(same_layout(sa[n], sb[n]) for n in names_a):
        return None  # the common case, at no cost: the same names, some comparable
    return _problem(la, sa, lb, sb, names_a, names_b, patterns)


def _selected(ts: Any, include: Patterns, exclude: Patterns, names: Any) -> list[str]:
    if names is not None and id(ts) in names:
        return names[id(ts)]
    return select([t.name for t in ts.disk_order()], include, exclude)


def _problem(
    la: str, sa: Any, lb: str, sb: Any, names_a: list[str], names_b: list[str], patterns: Any
) -> dict[str, Any] | None:
    """:func:`pair_problem` of two name lists that differ (or pair nothing); ``patterns``:
    whether --include/--exclude chose the names (said when a run keeps none)."""
    from dmlib.names import detect_mapping, suggest_alignment

    in_b = set(names_b)
    common = [n for n in names_a if n in in_b]
    found = suggest_alignment(names_a, names_b) or detect_mapping(names_a, names_b)
    rules = [_run_rule(str(r), la, lb) for r in found["renames"]] if found else []
    after = found["shared_after"] if found else len(common)
    fix = (f"--rename {' --rename '.join(rules)} (study.toml: {_as_names(rules)}) pairs "
           f"{after} of them" if rules else "no prefix rename pairs them (--rename RUN:OLD=NEW)")  # fmt: skip
    what = f"runs {la!r} ({sa.path or 'in memory'}) and {lb!r} ({sb.path or 'in memory'})"
    base = {"rename": rules, "shared_before": len(common), "shared_after": after}
    if not names_a or not names_b:
        empty = [la] if not names_a else []
        empty += [lb] if not names_b else []
        return {**base, "kind": "no_shared_name", "message": f"{what}: nothing would be "
                f"compared: {' and '.join(map(repr, empty))} holds no tensor"
                + (" the --include/--exclude patterns keep" if patterns else "")}  # fmt: skip
    if not common:
        example = f"e.g. {names_a[0]!r} vs {names_b[0]!r}"
        return {**base, "kind": "no_shared_name", "message": f"{what} share no tensor name "
                f"({len(names_a)} vs {len(names_b)} names, {example}): nothing would be "
                f"compared; {fix}"}  # fmt: skip
    if common and not any(same_layout(sa[n], sb[n]) for n in common):
        n = common[0]
        return {**base, "kind": "nothing_comparable", "message": f"{what} compare no tensor: "
                f"each of the {len(common)} shared names differs in dtype or shape (e.g. "
                f"{n!r}: {sa[n].dtype_label}{list(sa[n].shape)} vs "
                f"{sb[n].dtype_label}{list(sb[n].shape)})"}  # fmt: skip
    if rules and after >= 2 * len(common):
        return {**base, "kind": "few_shared", "message": f"{what} share only {len(common)} "
                f"tensor name{'s' * (len(common) != 1)}; {fix}"}  # fmt: skip
    return None


def _run_rule(rule: str, la: str, lb: str) -> str:
    """A side rule of :mod:`dmlib.names` (``b:model.=``) as a run's (``seed1:model.=``)."""
    side, _, rest = rule.partition(":")
    return f"{la if side == 'a' else lb}:{rest}"


def _as_names(rules: list[str]) -> str:
    """Per-run rules as study.toml's ``[names]`` lines, joined by '; '."""
    return "; ".join(f'[names] {r.partition(":")[0]} = "{r.partition(":")[2]}"' for r in rules)


def check_pairs(
    sets: Mapping[str, Any], include: Patterns, exclude: Patterns, *, control: str | None = None
) -> dict[tuple[str, str], dict[str, Any]]:
    """Refuse the first pair of runs (the control's first) that would compare nothing;
    return the pairs that share few names (``{(a, b): pair_problem}``), to be said aloud."""
    labels = list(sets)
    pairs = list(itertools.combinations(labels, 2))
    pairs.sort(key=lambda p: control not in p)  # the control's pairs first
    names = {id(ts): _selected(ts, include, exclude, None) for ts in sets.values()}
    hints = {}
    for la, lb in pairs:
        problem = pair_problem(la, sets[la], lb, sets[lb], include, exclude, names=names)
        if problem is None:
            continue
        if problem["kind"] != "few_shared":
            raise DmlibError(problem["message"])
        hints[(la, lb)] = problem
    return hints
