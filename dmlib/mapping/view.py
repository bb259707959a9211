"""A mapped side as a lazy TensorSet: the source's tensors under the reference's names.

:func:`mapped_set` expands a mapping over a source set and the reference's names and
returns a :class:`~dmlib.tensor.TensorSet` holding one tensor per target, each with the
target's name, dtype and shape. Nothing is read until a tensor is loaded: then its
sources are read and the rule's chain lays them out. A rule that moves no element (a
rename) hands on the source tensor itself (same bytes, same file offset). Any analysis
that takes a TensorSet (a matrix, a ladder) therefore takes a converted run unchanged.

The view keeps what the mapping says in ``layout["mapping"]`` (the bindings, what it
leaves out); :func:`source_index` turns an element index of a target back into the
source tensor and element it came from. Tensors the mapping ignores (``ignore_a``) stay
in the view under their own names, so that a comparison lists them as present on one
side only; reference tensors it ignores (``ignore_b``) are absent from it, and so listed
as missing on this side.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np

from dmlib.errors import DmlibError
from dmlib.mapping.resolve import Binding, count_problem, describe, resolve, source_problem
from dmlib.mapping.spec import Mapping, load_mapping
from dmlib.mapping.transforms import Op, _concat, _split, each, run_chain, trace
from dmlib.tensor import Tensor, TensorSet

__all__ = ["mapped_set", "source_index"]


def mapped_set(ts: TensorSet, mapping: Any, names_b: Sequence[str]) -> TensorSet:
    """``ts`` seen through ``mapping`` onto the names ``names_b`` (lazy; see the module).

    Raises :class:`DmlibError` naming the rule and tensors for anything the mapping
    cannot do without reading a value: a name left out, two sources onto one target, a
    chain that does not fit the shapes, a quantized source whose layout would move.
    """
    m: Mapping = load_mapping(mapping)
    order_a = [t.name for t in ts.disk_order()]
    res = resolve(m, order_a, list(names_b))
    tensors: dict[str, Tensor] = {}
    for bnd in res.bindings:
        for t in _targets(bnd, ts):
            tensors[t.name] = t
    clash = [n for n in res.ignored_a if n in set(names_b) or n in tensors]
    if clash:
        raise DmlibError(
            f"ignore_a leaves {clash[0]!r} out, but the reference holds a tensor of that name: "
            "map it with a rule, or leave it out of ignore_a",
            path=m.path,
        )
    for n in res.ignored_a:
        tensors[n] = ts[n]
    view = TensorSet(
        tensors,
        path=ts.path,
        format=ts.format,
        metadata=ts.metadata,
        scalars=ts.scalars,
        layout={
            **ts.layout,
            "mapping": {
                "path": m.path,
                "bindings": [describe(b) for b in res.bindings],
                "ignored_a": list(res.ignored_a),
                "ignored_b": list(res.ignored_b),
            },
        },
        closer=ts.close,
    )
    view.layout["_bindings"] = {t: (b, k) for b in res.bindings for k, t in enumerate(b.targets)}
    view.layout["_source_shapes"] = {s: ts[s].shape for b in res.bindings for s in b.sources}
    return view


def _moving(ops: Sequence[Op]) -> list[Op]:
    return [op for op in ops if op.name != "cast"]


def _targets(bnd: Binding, ts: TensorSet) -> list[Tensor]:
    """The binding's target tensors: metadata now, values when loaded."""
    srcs = [ts[s] for s in bnd.sources]
    where = f"{bnd.rule.label()} on {', '.join(bnd.sources)}"
    if not _moving(bnd.rule.ops) and len(srcs) == len(bnd.targets) == 1:
        t = copy.copy(srcs[0])
        t.name = bnd.targets[0]
        return [t]
    problem = source_problem(srcs)
    if problem:
        raise DmlibError(f"{where}: {problem}")
    try:
        shapes = _shapes_after(bnd.rule.ops, [t.shape for t in srcs])
    except DmlibError as err:
        raise DmlibError(f"{where}: {err.message}") from None
    problem = count_problem(bnd, len(shapes))
    if problem:
        raise DmlibError(f"{where}: {problem}")
    dtype = srcs[0].dtype
    out = []
    for k, (name, shape) in enumerate(zip(bnd.targets, shapes, strict=True)):
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        out.append(Tensor(name, dtype, shape, nbytes=nbytes, source=_loader(bnd, srcs, k)))
    return out


def _loader(bnd: Binding, srcs: list[Tensor], k: int) -> Any:
    """The ``source`` callable of target ``k``: the chain run on the sources' values."""

    def raw() -> np.ndarray:
        outs = run_chain(bnd.rule.ops, [t.load() for t in srcs])
        return np.ascontiguousarray(outs[k]).reshape(-1).view(np.uint8)

    return raw


def _shapes_after(ops: Sequence[Op], shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """The shapes a chain gives, found without reading or allocating the tensors.

    Every op but ``concat`` is a view, so it runs on zero-strided stand-ins (one byte
    whatever the shape); ``concat`` checks the shapes and makes a stand-in of the result.
    """
    arrs = [np.broadcast_to(np.zeros((), np.int8), s) for s in shapes]
    for op in ops:
        if op.name == "split":
            arrs = [p for a in arrs for p in _split(a, op.params)]
        elif op.name == "concat":
            arrs = [np.broadcast_to(np.zeros((), np.int8), _concat_shape(arrs, op.params["axis"]))]
        elif op.name == "tie":
            arrs = run_chain([op], arrs)
        else:
            arrs = each(op, arrs)
    return [tuple(int(x) for x in a.shape) for a in arrs]


def _concat_shape(arrs: list[np.ndarray], axis: int) -> tuple[int, ...]:
    """The shape ``np.concatenate(arrs, axis)`` would have (its own check on empty slices)."""
    shapes = ", ".join(str(list(x.shape)) for x in arrs)
    refused = DmlibError(f"concat: shapes {shapes} do not join along axis {axis}")
    sliced = []
    for a in arrs:
        if not -a.ndim <= axis < a.ndim:
            raise refused
        sliced.append(a[(slice(None),) * (axis % a.ndim) + (slice(0, 0),)])
    try:
        probe = _concat([np.ascontiguousarray(s) for s in sliced], axis)
    except DmlibError:
        raise refused from None
    ax = axis % probe.ndim
    total = sum(a.shape[ax] for a in arrs)
    return tuple(total if i == ax else n for i, n in enumerate(probe.shape))


def source_index(view: TensorSet, name: str, index: Sequence[int]) -> tuple[str, tuple[int, ...]]:
    """The source tensor and element that target ``name`` holds at ``index``.

    For a tensor the mapping did not move (a rename, an ignored tensor) the index is the
    same; otherwise the rule's chain is run on element numbers (eight bytes per element
    of the rule's sources).
    """
    bindings = view.layout.get("_bindings", {})
    if name not in bindings:
        return name, tuple(int(i) for i in index)
    bnd, k = bindings[name]
    shapes = [view.layout["_source_shapes"][s] for s in bnd.sources]
    moving = _moving(bnd.rule.ops)
    if not moving:
        return bnd.sources[k if len(bnd.sources) > 1 else 0], tuple(int(i) for i in index)
    g = int(trace(moving, shapes)[k][tuple(index)])
    start = 0
    for s, shape in zip(bnd.sources, shapes, strict=True):
        n = int(np.prod(shape, dtype=np.int64))
        if g < start + n:
            return s, tuple(int(i) for i in np.unravel_index(g - start, shape))
        start += n
    raise AssertionError("a traced index lies outside every source")  # pragma: no cover
