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
    found += _one_to_one(A, B, used_a, used_b)
    found += _ties(A, B, found, used_b)
    found += _splits(A, B, used_a, used_b)
    found += _concats(A, B, used_a, used_b)
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
            if len(f.sources) != 1 or A[f.sources[0]].size != t.size:
                continue
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
    for word in ("close", "ambiguous"):
        picked = [h for h in hows if h.startswith(word)]
        if picked:
            return picked[0]
    return "exact"


def _comment(how: str, n: int) -> str:
    times = f" ({n} tensors)" if n > 1 else ""
    if how == "exact":
        return f"confidence: exact - this chain reproduces the target bit for bit{times}"
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
