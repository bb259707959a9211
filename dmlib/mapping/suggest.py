"""Propose a mapping from the values alone: ``dmlib map suggest A B``.

Names are not trusted (a converted checkpoint shares almost none); values are. Each
tensor gets fingerprints that a layout change preserves: its size and the hash of its
*sorted* values (equal for a tensor and any transpose, permutation or reshape of it), and
the set of its values (a piece of a split holds a subset of the fused tensor's values).
Candidates are then confirmed element by element: a rule is proposed only when its chain,
applied to the source, reproduces the target exactly (or, for a pair whose values differ
slightly, as closely as the best chain can; such a rule says so in its comment).

What is searched, in order: one source to one target (identity, a permutation of axes, the
rotary head permutation, a reshape, a reshape and a transpose together); one source split into several targets (along any
axis, after an optional transpose, or per group as Megatron's fused ``linear_qkv``; a
piece that holds its target's rows in the other rotary order gets a ``rotary`` on it);
several sources concatenated into one target (tensor-parallel shards); then approximate
one-to-one matches. Ties between tensors holding the same values (LayerNorm weights of
ones) are broken by the numbers in the names and then by order, and the comment says so.
"""

from __future__ import annotations

import hashlib
import itertools
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dmlib.mapping.sides import opened_side
from dmlib.mapping.spec import Mapping, Rule
from dmlib.mapping.transforms import Op, run_chain

__all__ = ["Suggestion", "suggest"]

APPROX = 1e-2  # relative Frobenius distance under which a pair is proposed as "close"


@dataclass
class Suggestion:
    """What :func:`suggest` found: the mapping, and what it could not place."""

    mapping: Mapping
    unplaced_a: list[str]
    unplaced_b: list[str]
    confidence: dict[int, str] = field(default_factory=dict)


@dataclass
class _Found:
    sources: list[str]
    targets: list[str]
    ops: list[Op]
    how: str  # "exact", "ambiguous" or "close ..."
    tied: bool = False


def _digest(arr: np.ndarray) -> str:
    flat = np.sort(np.ascontiguousarray(arr).reshape(-1), kind="stable")
    return hashlib.blake2b(flat.tobytes(), digest_size=16).hexdigest()


def _numbers(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"[0-9]+", name))


def _load(ts: Any) -> tuple[dict[str, np.ndarray], list[str]]:
    arrays, skipped = {}, []
    for t in ts.disk_order():
        if t.quantized or t.packing is not None or t.dtype.kind not in "fiub" or t.numel == 0:
            skipped.append(t.name)
            continue
        a = t.load()
        arrays[t.name] = a.astype(a.dtype.newbyteorder("="), copy=False)
    return arrays, skipped


def _layouts(s: np.ndarray, t: np.ndarray) -> list[list[Op]]:
    """Candidate chains taking an array shaped like ``s`` to one shaped like ``t``."""
    out: list[list[Op]] = []
    if s.shape == t.shape:
        out.append([])
    if s.ndim == 2 and s.shape[::-1] == t.shape:
        out.append([Op("transpose")])
    elif 2 < s.ndim <= 4:
        for axes in itertools.permutations(range(s.ndim)):
            if list(axes) != list(range(s.ndim)) and tuple(s.shape[i] for i in axes) == t.shape:
                out.append([Op("permute", {"axes": list(axes)})])
    if s.shape == t.shape and s.ndim in (1, 2) and s.shape[0] >= 4:
        rows = s.shape[0]
        for heads in range(1, min(rows // 4, 512) + 1):
            if rows % heads == 0 and (rows // heads) % 2 == 0:
                for to in ("hf", "meta"):
                    out.append([Op("rotary", {"heads": heads, "to": to})])
    if s.shape != t.shape and s.size == t.size:
        out.append([Op("reshape", {"shape": list(t.shape)})])
        out += _reshaped_transposes(s, t)
    return out


def _reshaped_transposes(s: np.ndarray, t: np.ndarray) -> list[list[Op]]:
    """A reshape and a transpose together: a Flax ``DenseGeneral`` kernel (attention's
    ``[embed, heads, head_dim]`` or ``[heads, head_dim, embed]``) against a torch Linear
    weight ``[out, in]``, and back."""
    out: list[list[Op]] = []
    if t.ndim == 2 and s.shape != t.shape[::-1]:
        out.append([Op("reshape", {"shape": list(t.shape[::-1])}), Op("transpose")])
    if s.ndim == 2 and s.shape[::-1] != t.shape:
        out.append([Op("transpose"), Op("reshape", {"shape": list(t.shape)})])
    return out


def _exact_layout(s: np.ndarray, t: np.ndarray) -> list[Op] | None:
    for ops in _layouts(s, t):
        (got,) = run_chain(ops, [s])
        if got.shape == t.shape and np.array_equal(got, t, equal_nan=_nan_ok(t)):
            return ops
    return None


def _nan_ok(t: np.ndarray) -> bool:
    return t.dtype.kind == "f"


def _rel(got: np.ndarray, t: np.ndarray) -> float:
    g, tt = got.astype(np.float64), t.astype(np.float64)
    den = float(np.linalg.norm(tt))
    num = float(np.linalg.norm(g - tt))
    return num / den if den else (0.0 if num == 0 else float("inf"))


def suggest(a: Any, b: Any) -> Suggestion:
    """A mapping from ``a`` (source) to ``b`` (target), found from the values."""
    with opened_side(a) as sa, opened_side(b) as sb:
        A, skip_a = _load(sa)
        B, skip_b = _load(sb)
    found: list[_Found] = []
    used_a: set[str] = set()
    used_b: set[str] = set()
    # tensors whose elements are all equal (biases and norms at init) cannot be told
    # apart by their values: first what the values place, then those by their sibling
    # weight's rule, then what is left of them by value as before
    IA = {n: x for n, x in A.items() if not _constant(x)}
    IB = {n: x for n, x in B.items() if not _constant(x)}
    for AA, BB in ((IA, IB), (A, B)):
        found += _one_to_one(AA, BB, used_a, used_b)
        found += _ties(AA, BB, found, used_b)
        found += _splits(AA, BB, used_a, used_b)
        found += _concats(AA, BB, used_a, used_b)
        if AA is IA:
            found += _by_layout(A, B, found, used_a, used_b)
    found += _close(A, B, used_a, used_b)
    order = {n: i for i, n in enumerate(A)}
    found.sort(key=lambda f: min(order[s] for s in f.sources))
    rules, conf = _compress(found, list(A), list(B))
    un_a = [n for n in A if n not in used_a] + skip_a
    un_b = [n for n in B if n not in used_b] + skip_b
    return Suggestion(Mapping(tuple(rules), comments=conf), un_a, un_b, conf)


def _one_to_one(A: dict, B: dict, used_a: set, used_b: set) -> list[_Found]:
    by_a: dict[tuple, list[str]] = {}
    for n, arr in A.items():
        by_a.setdefault((arr.size, arr.dtype.str, _digest(arr)), []).append(n)
    out = []
    for tn, t in B.items():
        if tn in used_b:  # placed by an earlier pass
            continue
        key = (t.size, t.dtype.str, _digest(t))
        cands = [s for s in by_a.get(key, []) if s not in used_a]
        if not cands:
            continue
        shared = len(by_a[key]) > 1
        # ties (equal values): the same numbers in the names first, then the order
        cands.sort(key=lambda s: (_numbers(s) != _numbers(tn), 0))
        for s in cands:
            ops = _exact_layout(A[s], t)
            if ops is not None:
                used_a.add(s)
                used_b.add(tn)
                how = (
                    f"ambiguous: {len(by_a[key])} source tensors hold these values"
                    if shared
                    else "exact"
                )
                out.append(_Found([s], [tn], ops, how))
                break
    return out


def _ties(A: dict, B: dict, found: list[_Found], used_b: set) -> list[_Found]:
    """Targets holding a copy of a source already placed (tied embeddings and output)."""
    out = []
    for tn, t in B.items():
        if tn in used_b:
            continue
        for f in found:
            if len(f.sources) != 1 or A[f.sources[0]].size != t.size or f.how.startswith("layout"):
                continue  # a tensor placed by its layout has no value to be copied by
            s = A[f.sources[0]]
            ops = _exact_layout(s, t)
            if ops is None:
                continue
            used_b.add(tn)
            if not ops and all(op.name == "tie" for op in f.ops):  # one more copy of the same
                f.targets.append(tn)
                f.ops = [Op("tie", {"copies": len(f.targets)})]
            else:
                out.append(_Found([f.sources[0]], [tn], ops, f.how, tied=True))
            break
    return out


def _subset(part: np.ndarray, whole_values: np.ndarray) -> bool:
    return bool(np.isin(part.reshape(-1), whole_values, assume_unique=False).all())


def _splits(A: dict, B: dict, used_a: set, used_b: set) -> list[_Found]:
    out = []
    for sn, s in A.items():
        if sn in used_a:
            continue
        values = np.unique(s)
        cands = [
            tn for tn, t in B.items()
            if tn not in used_b and t.dtype == s.dtype and t.size < s.size and _subset(t, values)
        ]  # fmt: skip
        if len(cands) < 2 or sum(B[t].size for t in cands) != s.size:
            continue
        chain = _split_chain(s, [B[t] for t in cands], cands)
        if chain is not None:
            ops, names = chain
            used_a.add(sn)
            used_b.update(names)
            out.append(_Found([sn], names, ops, "exact"))
    return out


def _split_chain(s: np.ndarray, parts: list[np.ndarray], names: list[str]) -> Any:
    """The chain splitting ``s`` into ``parts`` (in some order), or None."""
    pres: list[list[Op]] = [[]] + ([[Op("transpose")]] if s.ndim == 2 else [])
    for pre in pres:
        (w,) = run_chain(pre, [s])
        for axis in range(w.ndim):
            for perm in itertools.permutations(range(len(parts))):
                sizes = [parts[i].shape[axis] if parts[i].ndim == w.ndim else -1 for i in perm]
                if -1 in sizes or sum(sizes) != w.shape[axis]:
                    continue
                equal = len(set(sizes)) == 1
                split = Op(
                    "split",
                    {"axis": axis, "parts": len(sizes)}
                    if equal
                    else {"axis": axis, "sizes": sizes},
                )
                ops = _pieces_match(pre + [split], s, [parts[i] for i in perm])
                if ops is not None:
                    return ops, [names[i] for i in perm]
            if w.ndim == 2 and axis == 0:
                got = _grouped(w, parts, names)
                if got is not None:
                    return pre + got[0], got[1]
    return None


def _grouped(w: np.ndarray, parts: list[np.ndarray], names: list[str]) -> Any:
    """Rows interleaved per group (Megatron ``linear_qkv``: per group q rows, k, v)."""
    n, d = w.shape
    if any(p.ndim != 2 or p.shape[1] != d for p in parts):
        return None
    rows = [p.shape[0] for p in parts]
    g_max = int(np.gcd.reduce(rows))
    for groups in range(2, g_max + 1):
        if g_max % groups:
            continue
        for perm in itertools.permutations(range(len(parts))):
            sizes = [rows[i] // groups for i in perm]
            ops = [
                Op("reshape", {"shape": [groups, n // groups, d]}),
                Op("split", {"axis": 1, "sizes": sizes}),
                Op("reshape", {"shape": [-1, d]}),
            ]
            found = _pieces_match(ops, w, [parts[i] for i in perm])
            if found is not None:
                return found, [names[i] for i in perm]
    return None


def _pieces_match(ops: list[Op], s: np.ndarray, parts: list[np.ndarray]) -> list[Op] | None:
    """``ops`` if it cuts ``s`` into ``parts`` exactly; ``ops`` and a ``rotary`` on some
    pieces if those need the rotary permutation too (a fused Meta QKV: q and k, not v);
    else None."""
    try:
        got = run_chain(ops, [s])
    except Exception:
        return None
    if len(got) != len(parts) or any(g.shape != p.shape for g, p in zip(got, parts)):
        return None
    fixes: dict[tuple[int, str], list[int]] = {}
    for k, (g, p) in enumerate(zip(got, parts)):
        if np.array_equal(g, p, equal_nan=_nan_ok(p)):
            continue
        fix = _rotary_fix(g, p)
        if fix is None:
            return None
        fixes.setdefault(fix, []).append(k)
    extra = [
        Op("rotary", {"head_dim": hd, "to": to, "pieces": ks}) for (hd, to), ks in fixes.items()
    ]
    return ops + extra


def _rotary_fix(g: np.ndarray, p: np.ndarray) -> tuple[int, str] | None:
    """The (head_dim, direction) of the rotary permutation taking piece ``g`` to ``p``.

    The permutation keeps the first row of every head in place, so ``g[0] == p[0]`` is
    checked before any permutation is tried (a cheap refusal for a piece that differs).
    """
    if g.ndim not in (1, 2) or g.shape[0] < 4:
        return None
    if not np.array_equal(g[0], p[0], equal_nan=_nan_ok(p)) or _digest(g) != _digest(p):
        return None
    rows = g.shape[0]
    for heads in range(1, min(rows // 2, 512) + 1):
        if rows % heads or (rows // heads) % 2:
            continue
        for to in ("hf", "meta"):
            op = Op("rotary", {"head_dim": rows // heads, "to": to})
            (got,) = run_chain([op], [g])
            if np.array_equal(got, p, equal_nan=_nan_ok(p)):
                return rows // heads, to
    return None


def _concats(A: dict, B: dict, used_a: set, used_b: set) -> list[_Found]:
    out = []
    for tn, t in B.items():
        if tn in used_b:
            continue
        values = np.unique(t)
        cands = [
            sn for sn, s in A.items()
            if sn not in used_a and s.dtype == t.dtype and s.size < t.size and _subset(s, values)
        ]  # fmt: skip
        if len(cands) < 2 or sum(A[s].size for s in cands) != t.size or len(cands) > 16:
            continue
        cands.sort(key=_numbers)
        for axis in range(t.ndim):
            ops = [Op("concat", {"axis": axis})]
            try:
                (got,) = run_chain(ops, [A[s] for s in cands])
            except Exception:
                continue
            if got.shape == t.shape and np.array_equal(got, t, equal_nan=_nan_ok(t)):
                used_a.update(cands)
                used_b.add(tn)
                out.append(_Found(cands, [tn], ops, "exact"))
                break
    return out


def _close(A: dict, B: dict, used_a: set, used_b: set) -> list[_Found]:
    """One-to-one pairs whose values differ a little: the chain that brings them closest."""
    out = []
    for tn, t in B.items():
        if tn in used_b or t.dtype.kind != "f":
            continue
        st = np.sort(t.reshape(-1)).astype(np.float64)
        best: tuple[float, str, list[Op]] | None = None
        for sn, s in A.items():
            if sn in used_a or s.size != t.size or s.dtype.kind != "f":
                continue
            if _rel(np.sort(s.reshape(-1)).astype(np.float64), st) > APPROX:
                continue
            for ops in _layouts(s, t):
                (got,) = run_chain(ops, [s])
                r = _rel(got, t)
                if r <= APPROX and (best is None or r < best[0]):
                    best = (r, sn, ops)
        if best is not None:
            used_a.add(best[1])
            used_b.add(tn)
            out.append(
                _Found([best[1]], [tn], best[2], f"close: values differ (rel_fro {best[0]:.2e})")
            )
    return out


# -- tensors the values cannot place: by their sibling weight's rule ----------------------


def _constant(x: np.ndarray) -> bool:
    """Every element equal (zeros, ones: biases and norms at init), more than one element."""
    flat = x.reshape(-1)
    return flat.size > 1 and bool(np.all(flat == flat[0]))


def _sibling(name: str) -> str | None:
    """The bias beside a weight (``...fc1.weight`` -> ``...fc1.bias``, a Flax ``kernel`` too)."""
    for word in ("weight", "kernel"):
        head, sep, tail = name.rpartition(word)
        if sep and "." not in tail and "/" not in tail:
            return head + "bias" + tail
    return None


def _by_layout(A: dict, B: dict, found: list[_Found], used_a: set, used_b: set) -> list[_Found]:
    """Constant tensors placed as their sibling weights are: for a weight finding whose
    sources' and targets' biases are unplaced and constant (the same value), the chain
    that takes the source biases to the target biases as the weight chain takes the
    weights' output rows, checked on element positions (each weight's output index run
    through the weight chain against each bias's index run through the bias chain)."""
    out = []
    for f in list(found):
        maybe = [_sibling(n) for n in f.sources]
        srcs = [s for s in maybe if s is not None and s in A and s not in used_a]
        tgts = [t for t in map(_sibling, f.targets) if t is not None and t in B and t not in used_b]
        if not tgts or len(srcs) != len(f.sources):
            continue
        arrays = [A[s] for s in srcs] + [B[t] for t in tgts]
        if not all(_constant(x) and x.ndim == 1 for x in arrays):
            continue
        if len({(x.dtype.str, x.reshape(-1)[0].tobytes()) for x in arrays}) != 1:
            continue
        ops = _bias_chain(f, A, B, [A[s] for s in srcs], tgts)
        if ops is None:
            continue
        used_a.update(srcs)
        used_b.update(tgts)
        value = arrays[0].reshape(-1)[0].item()
        how = f"layout: every element {value!r}, as {f.targets[0]!r} is placed"
        out.append(_Found(srcs, tgts, ops, how, f.tied))
    return out


def _bias_chain(
    f: _Found, A: dict, B: dict, src_bias: list[np.ndarray], tgts: list[str]
) -> list[Op] | None:
    """The bias chain for weight finding ``f``, or None: for each reading of which weight
    axis is the input (the one the bias does not run along), the expected positions of
    the target biases, then the candidate chains, the first that gives them."""
    weights = [A[s] for s in f.sources]
    if any(w.ndim != 2 for w in weights):
        return None
    for in_axis in (1, 0):  # a Linear's [out, in] first, then a Conv1D's [in, out]
        if any(w.shape[1 - in_axis] != b.size for w, b in zip(weights, src_bias, strict=True)):
            continue
        want = _expected(f, weights, in_axis, tgts, B)
        if want is None:
            continue
        offsets = np.cumsum([0] + [b.size for b in src_bias])
        idx = [np.arange(b.size, dtype=np.float64) + o for b, o in zip(src_bias, offsets)]
        for ops in _bias_candidates(f.ops, in_axis, weights[0].shape[in_axis], len(want)):
            try:
                got = run_chain(ops, idx)
            except Exception:
                continue
            if len(got) == len(want) and all(
                g.shape == w.shape and np.array_equal(g, w) for g, w in zip(got, want)
            ):
                return ops
    return None


def _expected(
    f: _Found, weights: list[np.ndarray], in_axis: int, tgts: list[str], B: dict
) -> list[np.ndarray] | None:
    """Each target bias's source-bias positions: the weights' output index (numbered
    across the sources) run through the weight chain, read along each target weight's
    output axis; None when a target weight does not hold one index per output row."""
    idx, base = [], 0
    for w in weights:
        n = w.shape[1 - in_axis]
        row = (np.arange(n, dtype=np.float64) + base).reshape((1, n) if in_axis == 0 else (n, 1))
        idx.append(np.ascontiguousarray(np.broadcast_to(row, w.shape)))
        base += n
    try:
        pieces = run_chain(f.ops, idx)
    except Exception:
        return None
    by_target = dict(zip(f.targets, pieces))
    want = []
    for t in tgts:
        weight = _weight_of(t, f.targets)
        p = by_target.get(weight) if weight is not None else None
        if p is None or p.ndim != 2:
            return None
        size = B[t].size
        if p.shape[0] == size and np.all(p == p[:, :1]):
            want.append(np.ascontiguousarray(p[:, 0]))
        elif p.shape[1] == size and np.all(p == p[:1, :]):
            want.append(np.ascontiguousarray(p[0, :]))
        else:
            return None
    return want


def _weight_of(bias: str, weights: list[str]) -> str | None:
    return next((w for w in weights if _sibling(w) == bias), None)


def _bias_candidates(ops: list[Op], in_axis: int, in_len: int, n_out: int) -> list[list[Op]]:
    """Chains that may take the biases where the weight chain takes the weights: the
    weight chain translated to one dimension less, then the plain ones (as they are, one
    repeated, split or joined along their one axis)."""
    out = []
    translated = _translated(ops, in_axis, in_len)
    if translated is not None:
        out.append(translated)
    out += [[], [Op("tie", {"copies": n_out})], [Op("split", {"axis": 0, "parts": n_out})]]
    out += [[Op("concat", {"axis": 0})], [Op("concat", {"axis": 0}), Op("split", {"axis": 0, "parts": n_out})]]  # fmt: skip
    return [c for c in out if not (c and c[0].name == "tie" and n_out < 2)]


def _translated(ops: list[Op], in_axis: int, in_len: int) -> list[Op] | None:
    """The weight chain with the input axis (of length ``in_len``) taken out: transposes
    dropped, a split, join or reshape along the other axes kept on them, a rotary on the
    rows kept; None where the chain moves or cuts the input axis in a way a bias cannot
    follow."""
    out: list[Op] = []
    ax, nd = in_axis, 2
    for op in ops:
        if op.name == "transpose" and nd == 2:
            ax = 1 - ax
        elif op.name == "reshape":
            shape = list(op.params["shape"])
            if ax == nd - 1 and shape[-1] == in_len:
                out.append(Op("reshape", {"shape": shape[:-1] or [-1]}))
                nd, ax = len(shape), len(shape) - 1
            elif ax == 0 and shape[0] == in_len:
                out.append(Op("reshape", {"shape": shape[1:] or [-1]}))
                nd, ax = len(shape), 0
            else:
                return None
        elif op.name in ("split", "concat") and op.params["axis"] != ax:
            a = op.params["axis"]
            out.append(Op(op.name, {**op.params, "axis": a if a < ax else a - 1}))
        elif op.name == "rotary" and ax != 0:
            out.append(op)
        elif op.name in ("tie", "cast"):
            out.append(op)
        else:
            return None
    return out


# -- concrete findings -> rules with captures -----------------------------------------------

_DIGITS = re.compile(r"[0-9]+")


def _skeleton(name: str) -> str:
    return _DIGITS.sub("#", name).replace("{", "{{").replace("}", "}}")


def _template(name: str, caps: dict[int, str]) -> str:
    """``name`` with digit run ``k`` replaced by ``{caps[k]}`` where given (others literal)."""
    pieces, pos = [], 0
    for k, m in enumerate(_DIGITS.finditer(name)):
        pieces.append(name[pos : m.start()])
        pieces.append("{" + caps[k] + "}" if k in caps else m.group())
        pos = m.end()
    pieces.append(name[pos:])
    return "".join(pieces)


def _compress(found: list[_Found], names_a: list[str], names_b: list[str]) -> Any:
    """Group findings that differ only in the numbers of their names into pattern rules."""
    groups: dict[tuple, list[_Found]] = {}
    for f in found:
        key = (
            tuple(_skeleton(s) for s in f.sources)
            if len(f.sources) < 2 or len({_skeleton(s) for s in f.sources}) > 1
            else ("*" + _skeleton(f.sources[0]),),
            tuple(_skeleton(t) for t in f.targets),
            tuple(op.describe() for op in f.ops),
            f.how.split(":")[0],
            f.tied,
        )
        groups.setdefault(key, []).append(f)
    rules: list[Rule] = []
    conf: dict[int, str] = {}
    for members in groups.values():
        one = _pattern_rule(members, names_a, names_b, len(rules) + 1)
        if one is None:
            made = [
                Rule(tuple(f.sources), tuple(f.targets), tuple(f.ops), f.tied, len(rules) + 1 + k)
                for k, f in enumerate(members)
            ]
            hows = [f.how for f in members]
        else:
            made, hows = [one], [_worst([f.how for f in members])]
        for r, how in zip(made, hows, strict=True):
            conf[r.number] = _comment(how, len(members) if len(made) == 1 else 1)
            rules.append(r)
    return rules, conf


def _worst(hows: list[str]) -> str:
    for word in ("close", "ambiguous", "layout"):
        picked = [h for h in hows if h.startswith(word)]
        if picked:
            return picked[0]
    return "exact"


def _comment(how: str, n: int) -> str:
    times = f" ({n} tensors)" if n > 1 else ""
    if how == "exact":
        return f"confidence: exact - this chain reproduces the target bit for bit{times}"
    if how.startswith("layout"):
        return (
            f"confidence: by name and layout{times} - {how.split(': ', 1)[1]}: the values "
            "cannot tell these tensors apart; placed as their weights are, the layout "
            "checked on element positions"
        )
    if how.startswith("ambiguous"):
        return (
            f"confidence: medium - values equal bit for bit{times}, but {how.split(': ', 1)[1]}; "
            "paired by the numbers in the names and their order"
        )
    return f"confidence: low - {how.split(': ', 1)[1]}{times}; nearest chain, not an exact match"


def _pattern_rule(
    members: list[_Found], names_a: list[str], names_b: list[str], number: int
) -> Rule | None:
    """One rule with captures covering every member, verified by expanding it; else None."""
    from dmlib.errors import DmlibError
    from dmlib.mapping.resolve import _expand

    first = members[0]
    gathered = len(first.sources) > 1 and len({_skeleton(s) for s in first.sources}) == 1
    src_names = [f.sources[0] for f in members]
    tgt_names = [f.targets[0] for f in members]
    src_nums = [_numbers(n) for n in src_names]
    tgt_nums = [_numbers(n) for n in tgt_names]
    caps_s: dict[int, str] = {}
    caps_t: dict[int, str] = {}
    letters = iter("ijklmnpq")
    for ks in range(len(src_nums[0])):
        col = [x[ks] for x in src_nums]
        if gathered and len({_numbers(s)[ks] for s in first.sources}) > 1:
            caps_s[ks] = "r"
            continue
        if len(members) == 1 or len(set(col)) == 1:  # one finding, or a constant: literal
            continue
        for kt in range(len(tgt_nums[0])):
            if kt not in caps_t and [x[kt] for x in tgt_nums] == col:
                caps_s[ks] = caps_t[kt] = next(letters)
                break
        else:
            if len(set(col)) > 1:
                return None
    if len(members) == 1 and not gathered:
        return Rule(
            tuple(first.sources), tuple(first.targets), tuple(first.ops), first.tied, number
        )
    srcs = (
        (_template(first.sources[0], caps_s),)
        if gathered
        else tuple(_template(s, caps_s) for s in first.sources)
    )
    tgts = tuple(_template(t, {k: v for k, v in caps_t.items()}) for t in first.targets)
    rule = Rule(srcs, tgts, tuple(first.ops), first.tied, number)
    try:
        got = _expand(rule, names_a, set(names_b))
    except DmlibError:
        return None
    want = {(tuple(f.sources), tuple(f.targets)) for f in members}
    if {(b.sources, b.targets) for b in got} != want:
        return None
    return rule
