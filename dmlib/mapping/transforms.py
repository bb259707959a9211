"""The transforms of a mapping rule: layout changes from source tensors to target tensors.

A rule's chain works on a *list* of arrays: it starts with the rule's source tensors (in
order) and must end with one array per target. Element-wise ops (``transpose``,
``permute``, ``reshape``, ``rotary``) apply to every array of the list (``rotary`` with
``pieces``: to those positions only, the q and k pieces of a split QKV); ``split`` cuts
each array into pieces (the list grows), ``concat`` joins the whole list into one array,
``tie`` repeats a single array (one source standing for several targets), and ``cast``
changes nothing here: it declares the target's dtype, and the pair is then compared under
the cross-dtype rule (the wider side rounded to the narrower dtype).

Every op only moves elements. Applied to arrays of element *indices* instead of values,
the same chain says which source element each target element came from
(:func:`trace`), which is how differences are reported in both coordinate systems.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dmlib import _limits
from dmlib.errors import DmlibError

__all__ = ["OPS", "Op", "each", "parse_op", "run_chain", "describe_chain"]

#: op name -> (required keys, optional keys)
OPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "transpose": ((), ("axes",)),
    "permute": (("axes",), ()),
    "reshape": (("shape",), ()),
    "split": (("axis",), ("parts", "sizes")),
    "concat": (("axis",), ()),
    "rotary": (("to",), ("heads", "head_dim", "pieces")),
    "cast": (("dtype",), ()),
    "tie": (("copies",), ()),
}


@dataclass(frozen=True)
class Op:
    """One step of a chain: its name and its parameters (as written in the TOML)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """``split(axis=1, parts=3)``: the spelling reports use."""
        args = ", ".join(f"{k}={_show(v)}" for k, v in self.params.items())
        return f"{self.name}({args})"

    def as_toml(self) -> str:
        """The inline table of this op in a mapping file."""
        items = [f'op = "{self.name}"'] + [
            f"{k} = {_toml_value(v)}" for k, v in self.params.items()
        ]
        return "{ " + ", ".join(items) + " }"


def _show(v: Any) -> str:
    return "[" + ", ".join(map(str, v)) + "]" if isinstance(v, (list, tuple)) else str(v)


def _toml_value(v: Any) -> str:
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return str(int(v))


def parse_op(raw: Any, where: str) -> Op:
    """An op from its TOML table (``{op = "split", axis = 0, parts = 3}``); bad keys refused."""
    if not isinstance(raw, dict) or not isinstance(raw.get("op"), str):
        raise DmlibError(f"{where}: each transform is a table with an 'op' key, got {raw!r}")
    name = raw["op"]
    if name not in OPS:
        raise DmlibError(f"{where}: unknown transform {name!r}; expected one of {', '.join(OPS)}")
    need, opt = OPS[name]
    params = {k: v for k, v in raw.items() if k != "op"}
    missing = [k for k in need if k not in params]
    extra = [k for k in params if k not in need + opt]
    if missing or extra:
        raise DmlibError(
            f"{where}: transform {name!r} "
            + (f"needs {', '.join(missing)}" if missing else f"takes no {', '.join(extra)}")
        )
    if name == "split" and ("parts" in params) == ("sizes" in params):
        raise DmlibError(f"{where}: transform 'split' takes exactly one of parts or sizes")
    if name == "rotary" and ("heads" in params) == ("head_dim" in params):
        raise DmlibError(f"{where}: transform 'rotary' takes exactly one of heads or head_dim")
    _check_types(name, params, where)
    return Op(name, params)


def _check_types(name: str, p: dict[str, Any], where: str) -> None:
    def ints(key: str) -> None:
        v = p[key]
        if not isinstance(v, list) or not all(isinstance(x, int) for x in v):
            raise DmlibError(f"{where}: {name}.{key} must be a list of integers, got {v!r}")

    def one(key: str, lo: int) -> None:
        v = p[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise DmlibError(f"{where}: {name}.{key} must be an integer >= {lo}, got {v!r}")

    for key in ("axes", "shape", "sizes", "pieces"):
        if key in p:
            ints(key)
    if "pieces" in p and (
        not p["pieces"] or min(p["pieces"]) < 0 or len(set(p["pieces"])) != len(p["pieces"])
    ):
        raise DmlibError(
            f"{where}: {name}.pieces must list distinct positions >= 0, got {p['pieces']!r}"
        )
    for key, lo in (("axis", -64), ("parts", 1), ("heads", 1), ("head_dim", 2), ("copies", 1)):
        if key in p:
            one(key, lo)
    if name == "tie" and p["copies"] > _limits.max_entries():
        raise DmlibError(
            f"{where}: tie.copies is {p['copies']:,}, more than the {_limits.max_entries():,} "
            "tensors one checkpoint may hold (DMLIB_MAX_ENTRIES); refused before any copy is made"
        )
    if name == "rotary" and p["to"] not in ("hf", "meta"):
        raise DmlibError(f"{where}: rotary.to must be 'hf' or 'meta', got {p['to']!r}")
    if name == "cast":
        import ml_dtypes  # noqa: F401  (registers bfloat16, float8_* with numpy)

        try:
            np.dtype(p["dtype"])
        except TypeError:
            raise DmlibError(f"{where}: cast.dtype {p['dtype']!r} is not a dtype") from None


def describe_chain(ops: Sequence[Op]) -> str:
    """The chain as one string (``split(axis=1, parts=3) | transpose()``); ``identity`` if empty."""
    return " | ".join(op.describe() for op in ops) or "identity"


def rotary(w: np.ndarray, heads: int | None, to: str, head_dim: int | None = None) -> np.ndarray:
    """Reorder the rows of a query/key projection between the Meta and HF Llama layouts.

    Meta's checkpoints keep each head's rotary pairs interleaved (rows 2m, 2m+1 rotate
    together); Hugging Face's ``LlamaAttention`` rotates the first half of each head's rows
    with the second half (``rotate_half``). Within each head of ``d`` rows, Meta row
    ``2m + r`` (``r`` in {0, 1}) is HF row ``r * d/2 + m``; ``to="hf"`` goes from Meta to
    HF, ``to="meta"`` back. Works on weights (rows x inputs) and biases (rows). The heads
    are given by their number or by their size ``head_dim`` (the same for the query and
    the key of grouped-query attention, whose head counts differ).
    """
    rows = w.shape[0]
    if head_dim is not None:
        if rows % head_dim or head_dim % 2:
            raise DmlibError(
                f"rotary: {rows} rows do not split into heads of head_dim {head_dim} (even)"
            )
        heads = rows // head_dim
    assert heads is not None
    if rows % heads or (rows // heads) % 2:
        raise DmlibError(f"rotary: {rows} rows do not split into {heads} heads of an even size")
    half = rows // heads // 2
    rest = w.shape[1:]
    if to == "hf":  # (head, m, r) -> (head, r, m)
        return w.reshape(heads, half, 2, *rest).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(heads, 2, half, *rest).swapaxes(1, 2).reshape(w.shape)


def _split(a: np.ndarray, p: dict[str, Any]) -> list[np.ndarray]:
    axis = p["axis"]
    if not -a.ndim <= axis < a.ndim:
        raise DmlibError(f"split: axis {axis} out of range for shape {list(a.shape)}")
    n = a.shape[axis]
    if "parts" in p:
        if n % p["parts"]:
            raise DmlibError(
                f"split: axis {axis} of shape {list(a.shape)} does not divide into {p['parts']} parts"
            )
        return list(np.split(a, p["parts"], axis=axis))
    sizes = p["sizes"]
    if sum(sizes) != n or any(s < 0 for s in sizes):
        raise DmlibError(
            f"split: sizes {sizes} do not add up to {n} (axis {axis} of {list(a.shape)})"
        )
    return list(np.split(a, np.cumsum(sizes)[:-1], axis=axis))


def _one(op: Op, a: np.ndarray) -> np.ndarray:
    p = op.params
    if op.name == "transpose":
        if "axes" not in p and a.ndim != 2:
            raise DmlibError(
                f"transpose without axes needs a 2-D tensor, got shape {list(a.shape)}"
            )
        return a.T if "axes" not in p else _permute(a, p["axes"])
    if op.name == "permute":
        return _permute(a, p["axes"])
    if op.name == "reshape":
        try:
            return a.reshape(p["shape"])
        except ValueError:
            raise DmlibError(f"reshape: shape {list(a.shape)} cannot become {p['shape']}") from None
    if op.name == "rotary":
        return rotary(a, p.get("heads"), p["to"], p.get("head_dim"))
    return a  # cast: the dtype is settled when the pair is compared


def _permute(a: np.ndarray, axes: list[int]) -> np.ndarray:
    if sorted(axes) != list(range(a.ndim)):
        raise DmlibError(f"permute: axes {axes} are not a permutation of {a.ndim} axes")
    return a.transpose(axes)


def run_chain(ops: Sequence[Op], arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Apply ``ops`` to the list ``arrays``; returns the list of results (views where possible)."""
    out = list(arrays)
    for op in ops:
        if op.name == "split":
            out = [piece for a in out for piece in _split(a, op.params)]
        elif op.name == "concat":
            out = [_concat(out, op.params["axis"])]
        elif op.name == "tie":
            if len(out) != 1:
                raise DmlibError(f"tie repeats one tensor, the chain holds {len(out)} here")
            out = out * op.params["copies"]
        else:
            out = each(op, out)
    return out


def each(op: Op, arrays: list[np.ndarray]) -> list[np.ndarray]:
    """An element-wise op on the list: on every array, or on the positions ``pieces`` names.

    ``pieces`` (``rotary`` after a ``split``: the q and k pieces of a fused QKV, not v)
    counts from 0 in the list as it stands at this step of the chain.
    """
    pieces = op.params.get("pieces")
    if pieces is None:
        return [_one(op, a) for a in arrays]
    if max(pieces) >= len(arrays):
        raise DmlibError(
            f"{op.describe()}: piece {max(pieces)} does not exist, the chain holds "
            f"{len(arrays)} tensor(s) here (pieces count from 0)"
        )
    return [_one(op, a) if k in pieces else a for k, a in enumerate(arrays)]


def _concat(arrays: list[np.ndarray], axis: int) -> np.ndarray:
    try:
        return np.concatenate(arrays, axis=axis)
    except (ValueError, np.exceptions.AxisError):
        shapes = ", ".join(str(list(a.shape)) for a in arrays)
        raise DmlibError(f"concat: shapes {shapes} do not join along axis {axis}") from None


def cast_dtype(ops: Sequence[Op]) -> np.dtype | None:
    """The dtype the last ``cast`` of the chain declares, None without one."""
    casts = [op for op in ops if op.name == "cast"]
    return None if not casts else np.dtype(casts[-1].params["dtype"])


def trace(ops: Sequence[Op], shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """For every target element, the global index of the source element it holds.

    Source ``s`` element at flat index ``f`` has global index ``offset[s] + f`` (offsets:
    the sources' sizes summed in order). Costs eight bytes per element: called only for
    pairs that differ.
    """
    ids, start = [], 0
    for shape in shapes:
        n = int(np.prod(shape, dtype=np.int64))
        ids.append(np.arange(start, start + n, dtype=np.int64).reshape(shape))
        start += n
    return run_chain(ops, ids)
