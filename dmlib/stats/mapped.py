"""Compare two checkpoints through a mapping: rows in target coordinates, traced to the source.

For each binding (:mod:`dmlib.mapping.resolve`) the source tensors are read, the rule's
chain lays them out as the targets, and each result is compared with its target by
dmlib's comparison kernels (:func:`dmlib.kernels.pair.compare_pair`, the same rows as
:func:`dmlib.compare`). A pair that differs is then traced back: the chain is run on
element indices, so each differing element is named both as ``target[k, l]`` and as
``source[i, j]``.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from dmlib import hashing
from dmlib.errors import DmlibError
from dmlib.kernels import stream as K
from dmlib.kernels.pair import DEFAULT_CHUNK
from dmlib.mapping.resolve import Binding, count_problem, describe, resolve, source_problem
from dmlib.mapping.sides import opened_side
from dmlib.mapping.spec import load_mapping
from dmlib.mapping.transforms import cast_dtype, describe_chain, run_chain, trace
from dmlib.sources import Patterns, patterns, select
from dmlib.tensor import Tensor, TensorSet

__all__ = ["compare_mapped", "is_per_run", "locate_rows", "map_runs", "MAPPED_COLUMNS", "LOCATED"]

#: columns a mapped comparison adds to :data:`dmlib.stats.compare.COLUMNS`
MAPPED_COLUMNS = ["source", "transform", "rule", "first_diff_source", "first_diff_target"]
#: differing elements traced per tensor (``attrs["located"]``)
LOCATED = 10


def compare_mapped(
    a: Any,
    b: Any,
    mapping: Any,
    *,
    include: Patterns = None,
    exclude: Patterns = None,
    cross_dtype: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK,
    progress: bool | None = None,
    hash_name: str | None = hashing.DEFAULT,
    frame: bool = True,
) -> Any:
    """:func:`dmlib.compare` with ``mapping=``: see that function and ``docs/mapping.md``."""
    m = load_mapping(mapping)
    with opened_side(a) as sa, opened_side(b) as sb:
        order_a = [t.name for t in sa.disk_order()]
        order_b = [t.name for t in sb.disk_order()]
        res = resolve(m, order_a, order_b)
        keep = set(select(order_b, include, exclude))
        if patterns(include) and not keep:
            raise DmlibError(
                f"--include {patterns(include)} selects no target tensor of {sb.path or 'B'}"
            )
        rows: list[dict[str, Any]] = []
        state = _State(chunk_bytes, progress, hash_name, sum(sb[t].nbytes for t in keep))
        try:
            for bnd in res.bindings:
                if any(t in keep for t in bnd.targets):
                    rows += _binding_rows(bnd, sa, sb, keep, cross_dtype, state)
        finally:
            state.close()
        attrs = _attrs(sa, sb, m, res, rows, state, include, exclude, keep)
    for r in rows:
        r.pop("_pair", None)
    from dmlib.kernels.pair import COLUMNS
    from dmlib.stats.rows import rows_out

    return rows_out(rows, attrs, COLUMNS + MAPPED_COLUMNS, frame=frame)


class _State:
    """What every pair of a mapped comparison shares: threads, progress, what was found."""

    def __init__(self, chunk_bytes: int, progress: bool | None, hash_name: str | None, total: int):
        self.chunk_bytes = chunk_bytes
        self.hash_name = hash_name
        self.pool = ThreadPoolExecutor(max_workers=2)
        self.prog = K.Progress(total, progress)
        self.mismatched: list[dict[str, Any]] = []
        self.rounded: list[dict[str, Any]] = []
        self.located: dict[str, list[dict[str, Any]]] = {}
        self.byte_order: list[str] = []
        K.prime_allocator(4 * chunk_bytes)

    def close(self) -> None:
        self.prog.finish()
        self.pool.shutdown(wait=True, cancel_futures=True)


def _derived(bnd: Binding, sa: TensorSet) -> list[Tensor]:
    """The sources laid out as the targets (the source tensor itself where nothing moves)."""
    srcs = [sa[s] for s in bnd.sources]
    moving = [op for op in bnd.rule.ops if op.name != "cast"]
    if not moving and len(srcs) == len(bnd.targets) == 1:
        return [_renamed(srcs[0], bnd.targets[0])]
    where = f"{bnd.rule.label()} on {', '.join(bnd.sources)}"
    problem = source_problem(srcs)
    if problem:
        raise DmlibError(f"{where}: {problem}")
    try:
        outs = run_chain(bnd.rule.ops, [t.load() for t in srcs])
    except DmlibError as err:
        raise DmlibError(f"{where}: {err.message}") from None
    problem = count_problem(bnd, len(outs))
    if problem:
        raise DmlibError(f"{where}: {problem}")
    res = []
    for name, arr in zip(bnd.targets, outs, strict=True):
        arr = np.ascontiguousarray(arr)
        arr.flags.writeable = False
        res.append(Tensor(name, arr.dtype, arr.shape, nbytes=arr.nbytes, source=arr))
    return res


def _renamed(t: Tensor, name: str) -> Tensor:
    import copy

    t2 = copy.copy(t)
    t2.name = name
    return t2


def _binding_rows(
    bnd: Binding, sa: TensorSet, sb: TensorSet, keep: set[str], cross_dtype: bool, st: _State
) -> list[dict[str, Any]]:
    from dmlib.kernels.pair import compare_pair, kind_of, same_layout
    from dmlib.stats.rows import collect_data_hashes, rounded_pair

    rows = []
    want = cast_dtype(bnd.rule.ops)
    for k, (td, tb) in enumerate(zip(_derived(bnd, sa), [sb[t] for t in bnd.targets], strict=True)):
        if tb.name not in keep:
            continue
        pair: tuple[Tensor, Tensor] | None = (td, tb) if same_layout(td, tb) else None
        if (
            pair is None
            and td.shape == tb.shape
            and (cross_dtype or want == tb.dtype.newbyteorder("="))
        ):
            r = rounded_pair(td, tb)
            if r is not None:
                pair = r[0], r[1]
                st.rounded.append({**r[2], "name": tb.name, "source": list(bnd.sources)})
        if pair is None:
            st.mismatched.append(_mismatch(bnd, td, tb, want))
            continue
        rel = K.PageReleaser()
        with np.errstate(over="ignore", invalid="ignore"):
            row = compare_pair(*pair, st.chunk_bytes, st.pool, st.prog, rel, None, st.hash_name)
        rel.flush()
        collect_data_hashes([row])
        row["name"] = tb.name
        row["source"] = ", ".join(bnd.sources)
        row["transform"] = describe_chain(bnd.rule.ops)
        row["rule"] = bnd.rule.number
        row["first_diff_source"] = row["first_diff_target"] = None
        if (
            kind_of(tb) != "bytes"
            and pair[0].dtype.itemsize > 1
            and (pair[0].dtype.isnative != pair[1].dtype.isnative)
        ):
            st.byte_order.append(tb.name)
        if row["n_diff"] and kind_of(tb) != "bytes":
            found = _locate(bnd, k, sa, pair[0], pair[1])
            st.located[tb.name] = found
            if found:
                row["first_diff_source"] = found[0]["source"]
                row["first_diff_target"] = found[0]["target"]
        rows.append(row)
    return rows


def _mismatch(bnd: Binding, td: Tensor, tb: Tensor, want: np.dtype | None) -> dict[str, Any]:
    why = "shape" if td.shape != tb.shape else "dtype"
    if why == "dtype" and want is not None:
        why = f"dtype (the rule casts to {want.name})"
    return {
        "name": tb.name,
        "source": list(bnd.sources),
        "transform": describe_chain(bnd.rule.ops),
        "dtype_a": td.dtype_label,
        "dtype_b": tb.dtype_label,
        "shape_a": list(td.shape),
        "shape_b": list(tb.shape),
        "differs": why,
    }


def _bits(t: Tensor) -> np.ndarray:
    """Element bit patterns in native byte order, flat (complex: the whole element)."""
    arr = t.load()
    arr = arr.astype(arr.dtype.newbyteorder("="), copy=False)
    if arr.dtype == np.bool_:
        return arr.reshape(-1)
    return arr.reshape(-1).view(f"u{arr.dtype.itemsize}" if arr.dtype.itemsize <= 8 else "V")


def _locate(bnd: Binding, k: int, sa: TensorSet, ta: Tensor, tb: Tensor) -> list[dict[str, Any]]:
    """The first differing elements, each as ``target[...]`` and ``source[...]``."""
    ba, bb = _bits(ta), _bits(tb)
    flat = np.flatnonzero(ba != bb)[:LOCATED]
    if not flat.size:
        return []
    shapes = [sa[s].shape for s in bnd.sources]
    moving = [op for op in bnd.rule.ops if op.name != "cast"]
    ids = trace(moving, shapes)[k].reshape(-1)[flat] if moving else flat
    starts = np.cumsum([0] + [int(np.prod(s, dtype=np.int64)) for s in shapes])
    va, vb = ta.load().reshape(-1), tb.load().reshape(-1)
    out = []
    for f, g in zip(flat.tolist(), np.asarray(ids).tolist(), strict=True):
        s = int(np.searchsorted(starts, g, side="right")) - 1
        src_idx = np.unravel_index(g - int(starts[s]), shapes[s]) if shapes[s] else ()
        tgt_idx = np.unravel_index(f, tb.shape) if tb.shape else ()
        out.append(
            {
                "target": _at(tb.name, tgt_idx),
                "source": _at(bnd.sources[s], src_idx),
                "target_index": [int(i) for i in tgt_idx],
                "source_tensor": bnd.sources[s],
                "source_index": [int(i) for i in src_idx],
                "a": _value(va[f]),
                "b": _value(vb[f]),
            }
        )
    return out


def _at(name: str, idx: tuple[Any, ...]) -> str:
    return f"{name}[{', '.join(str(int(i)) for i in idx)}]"


def _value(v: Any) -> Any:
    if isinstance(v, (np.bool_, bool)):
        return bool(v)
    if np.issubdtype(np.asarray(v).dtype, np.integer):
        return int(v)
    if np.iscomplexobj(v):
        return str(v)
    return float(v)


def _attrs(
    sa: TensorSet,
    sb: TensorSet,
    m: Any,
    res: Any,
    rows: list[dict[str, Any]],
    st: _State,
    include: Patterns,
    exclude: Patterns,
    keep: set[str],
) -> dict[str, Any]:
    from dmlib.stats.rows import dict_diff, scalar_attrs

    keep_a = set(select(list(res.ignored_a), include, exclude))
    return {
        "path_a": sa.path,
        "path_b": sb.path,
        "include": patterns(include),
        "exclude": patterns(exclude),
        "n_tensors_a": len(sa),
        "n_tensors_b": len(sb),
        "compared": [r["name"] for r in rows],
        "only_in_a": [n for n in res.ignored_a if n in keep_a],
        "only_in_b": [n for n in res.ignored_b if n in keep],
        "mismatched": st.mismatched,
        "rounded": st.rounded,
        "alignment_hint": None,
        "metadata_diff": dict_diff(sa.metadata, sb.metadata),
        # the same scalar rule as an unmapped comparison (selection, one side vs both)
        **scalar_attrs(sa.scalars, sb.scalars, include, exclude),
        "param_id_diff": {},
        "byte_order_diff": st.byte_order,
        "file_hash_a": None,
        "file_hash_b": None,
        "data_section_hash_a": None,
        "data_section_hash_b": None,
        "hash": st.hash_name,
        "rename": [],
        "mapping": m.path,
        "bindings": [describe(b) for b in res.bindings],
        "located": st.located,
    }


def map_runs(
    sets: dict[str, TensorSet], mapping: Any, reference: str | None = None
) -> tuple[dict[str, TensorSet], dict[str, dict[str, Any]]]:
    """Runs of a matrix or a ladder with the mapped ones seen through their mapping.

    ``mapping`` is a dict ``{run: mapping}`` (a path to a TOML file, its dict, or a
    :class:`~dmlib.mapping.Mapping`), or one mapping for every run that does not hold all
    of the reference's names. The reference (``reference``, else the first run without a
    mapping) gives the target names. Returns the sets (each mapped one a lazy view, see
    :func:`dmlib.mapping.view.mapped_set`) and, per mapped run, what the mapping did:
    ``{"mapping", "reference", "bindings", "ignored_a", "ignored_b"}``.
    """
    from dmlib.mapping.view import mapped_set

    if mapping is None:
        return sets, {}
    labels = list(sets)
    per_run = _mapped_runs(sets, mapping, reference)
    ref = reference if reference is not None else next(k for k in labels if k not in per_run)
    names_b = [t.name for t in sets[ref].disk_order()]
    out, info = dict(sets), {}
    for label, m in per_run.items():
        try:
            view = mapped_set(sets[label], m, names_b)
        except DmlibError as err:
            raise DmlibError(f"run {label!r}: {err.message}", path=err.path) from None
        out[label] = view
        info[label] = {"reference": ref, **view.layout["mapping"]}
    return out, info


def is_per_run(mapping: Any) -> bool:
    """Whether ``mapping`` is ``{run: mapping}`` rather than one mapping (its TOML dict)."""
    return isinstance(mapping, dict) and not {"rule", "same_names", "version"} & set(mapping)


def _mapped_runs(sets: dict[str, TensorSet], mapping: Any, reference: str | None) -> dict[str, Any]:
    """Run label -> its mapping, each checked; the reference never mapped."""
    labels = list(sets)
    if reference is not None and reference not in sets:
        raise DmlibError(f"reference {reference!r} is not one of the runs ({', '.join(labels)})")
    if is_per_run(mapping):
        unknown = [k for k in mapping if k not in sets]
        if unknown:
            raise DmlibError(
                f"mapping for {unknown[0]!r}, which is not one of the runs ({', '.join(labels)})"
            )
        if reference in mapping:
            raise DmlibError(f"run {reference!r} is the reference: its names are the targets")
        if not [k for k in labels if k not in mapping]:
            raise DmlibError("every run has a mapping: one run must keep its names (the reference)")
        chosen = dict(mapping)
    else:
        ref = reference if reference is not None else labels[0]
        want = set(sets[ref])
        chosen = {k: mapping for k in labels if k != ref and not want <= set(sets[k])}
    out = {}
    for k, m in chosen.items():
        try:
            out[k] = load_mapping(m)
        except DmlibError as err:
            raise DmlibError(f"run {k!r}: {err.message}", path=err.path) from None
    return out


def locate_rows(
    rows: list[dict[str, Any]], sa: TensorSet, sb: TensorSet
) -> dict[str, dict[str, str]]:
    """For each differing row of a pair with a mapped side: its first difference as
    ``target[k, l]`` and, on each mapped side, as ``source[i, j]``."""
    from dmlib.mapping.view import source_index

    out: dict[str, dict[str, str]] = {}
    sides = [(side, ts) for side, ts in (("a", sa), ("b", sb)) if "mapping" in ts.layout]
    if not sides:
        return out
    for r in rows:
        fd = r.get("first_diff")
        if not r.get("n_diff") or fd is None or r["name"] not in sa or r["name"] not in sb:
            continue
        if sa[r["name"]].quantized or len(fd) != len(sa[r["name"]].shape):
            continue  # a byte index: no element grid to trace
        found = {"target": _at(r["name"], tuple(fd))}
        for side, ts in sides:
            src, idx = source_index(ts, r["name"], fd)
            found[f"source_{side}"] = _at(src, idx)
        out[r["name"]] = found
    return out
