"""A mapping applied to two name lists: which source tensors feed which target tensors.

:func:`resolve` expands every rule over the names of both sides and accounts for every
name: each source and each target must be claimed by exactly one rule (a ``tied`` rule
may share its sources), or be listed by ``ignore_a`` / ``ignore_b``. Anything else is
refused with the names concerned, before a byte is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dmlib.errors import DmlibError
from dmlib.mapping.spec import Mapping, Rule, compile_pattern, fill, literal_ends
from dmlib.names import regex_budget
from dmlib.sources import select

__all__ = ["Binding", "Resolved", "count_problem", "resolve"]


@dataclass(frozen=True)
class Binding:
    """One expansion of a rule: concrete source names -> concrete target names."""

    rule: Rule
    sources: tuple[str, ...]
    targets: tuple[str, ...]
    captures: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Resolved:
    """What :func:`resolve` returns: every binding, and the names each side declares unmapped."""

    bindings: list[Binding]
    ignored_a: list[str]  # names of A the mapping declares unmapped, in A's order
    ignored_b: list[str]


def _few(names: Sequence[str], n: int = 5) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _expand(rule: Rule, names_a: Sequence[str], names_b: set[str]) -> list[Binding]:
    gathered = rule.gathered
    label = rule.label()
    groups: dict[tuple, list[list[tuple[tuple[int, ...], str]]]] = {}
    with regex_budget(label) as budget:
        for k, pattern in enumerate(rule.sources):
            rx, (start, end) = compile_pattern(pattern), literal_ends(pattern)
            # the literal ends first (a C call per name); the match only where they fit
            near = [n for n in names_a if n.startswith(start) and n.endswith(end)]
            for name in near:
                m = budget.fullmatch(rx, name)
                if m is None:
                    continue
                caps = m.groupdict()
                key = tuple(sorted((c, v) for c, v in caps.items() if c not in gathered))
                slots = groups.setdefault(key, [[] for _ in rule.sources])
                slots[k].append((tuple(int(caps[g]) for g in gathered if g in caps), name))
    if not groups:
        raise DmlibError(f"{label} matches no tensor of A")
    out = []
    for key, slots in groups.items():
        where = label + (f" with {', '.join(f'{c}={v}' for c, v in key)}" if key else "")
        sources: list[str] = []
        for pattern, found in zip(rule.sources, slots, strict=True):
            if not found:
                raise DmlibError(f"{where}: source {pattern!r} matches no tensor of A")
            found.sort()
            _check_consecutive(found, gathered, where, pattern)
            sources += [n for _, n in found]
        caps = dict(key)
        targets = tuple(fill(p, caps) for p in rule.targets)
        missing = [t for t in targets if t not in names_b]
        if missing:
            raise DmlibError(f"{where}: target {_few(missing)} is not a tensor of B")
        out.append(Binding(rule, tuple(sources), targets, key))
    return out


def _check_consecutive(
    found: list[tuple[tuple[int, ...], str]], gathered: list[str], where: str, pattern: str
) -> None:
    """Gathered shards must be numbered without a gap (a missing rank is refused)."""
    if not gathered:
        return
    values = [v[-1] for v, _ in found if v]
    if values and values != list(range(values[0], values[0] + len(values))):
        raise DmlibError(
            f"{where}: the shards of {pattern!r} are numbered {values}: one is missing or doubled"
        )


def resolve(mapping: Mapping, names_a: Sequence[str], names_b: Sequence[str]) -> Resolved:
    """Every rule expanded, every name of both sides accounted for (or DmlibError)."""
    set_b = set(names_b)
    bindings = [b for rule in mapping.rules for b in _expand(rule, names_a, set_b)]
    _refuse_shared(bindings)
    claimed_a = {s for b in bindings for s in b.sources}
    claimed_b = {t for b in bindings for t in b.targets}
    if mapping.same_names:
        same = Rule(("{name:*}",), ("{name:*}",), number=0)
        in_a = set(names_a)
        for n in names_b:
            if n in in_a and n not in claimed_a and n not in claimed_b:
                bindings.append(Binding(same, (n,), (n,), ()))
                claimed_a.add(n)
                claimed_b.add(n)
    left_a = [n for n in names_a if n not in claimed_a]
    left_b = [n for n in names_b if n not in claimed_b]
    ignored_a = select(left_a, list(mapping.ignore_a)) if mapping.ignore_a else []
    ignored_b = select(left_b, list(mapping.ignore_b)) if mapping.ignore_b else []
    for side, left, ignored in (("A", left_a, ignored_a), ("B", left_b, ignored_b)):
        listed = set(ignored)
        rest = [n for n in left if n not in listed]
        if rest:
            raise DmlibError(
                f"the mapping leaves {len(rest)} tensor(s) of {side} out: {_few(rest)}; map "
                f"them with a rule or list them in ignore_{side.lower()} (then they are "
                "reported as not compared)"
            )
    order = {n: i for i, n in enumerate(names_a)}
    bindings.sort(key=lambda b: min(order[s] for s in b.sources))
    return Resolved(bindings, ignored_a, ignored_b)


def _refuse_shared(bindings: list[Binding]) -> None:
    """Two bindings onto one target, or one source used twice without ``tied``: refused."""
    by_target: dict[str, list[Binding]] = {}
    by_source: dict[str, list[Binding]] = {}
    for b in bindings:
        if len(set(b.targets)) != len(b.targets):
            raise DmlibError(
                f"{b.rule.label()}: the same target is named twice in {list(b.targets)}"
            )
        for t in b.targets:
            by_target.setdefault(t, []).append(b)
        twice = [s for s in dict.fromkeys(b.sources) if b.sources.count(s) > 1]
        if twice and not b.rule.tied:
            raise DmlibError(
                f"{b.rule.label()}: source {twice[0]!r} is taken {b.sources.count(twice[0])} "
                "times without tied = true: is one tensor really standing for several?"
            )
        for s in dict.fromkeys(b.sources):
            by_source.setdefault(s, []).append(b)
    for t, bs in by_target.items():
        if len(bs) > 1:
            srcs = [s for b in bs for s in b.sources]
            raise DmlibError(
                f"two sources onto one target: {_few(srcs)} all map to {t!r} "
                f"({', '.join(b.rule.label() for b in bs)}); one rule with all of them and a "
                "concat says how they combine"
            )
    for s, bs in by_source.items():
        # one of the rules may use the tensor as itself; every other one says it is a tie
        untied = [b for b in bs if not b.rule.tied]
        if len(bs) > 1 and len(untied) > 1:
            raise DmlibError(
                f"source {s!r} feeds {len(bs)} rules ({', '.join(b.rule.label() for b in bs)}) "
                f"and {len(untied)} of them lack tied = true: is one tensor really standing "
                "for several? (one rule with a tie transform, or tied = true on the others)"
            )


def source_problem(srcs: Sequence[Any]) -> str | None:
    """Why these source tensors cannot be transformed together, or None: a quantized or
    packed one (no element layout to move), or sources of different dtypes."""
    bad = [t.name for t in srcs if t.quantized or t.packing is not None]
    if bad:
        return f"{bad[0]!r} is quantized or packed; its layout cannot be transformed"
    dtypes = {t.dtype.newbyteorder("=") for t in srcs}
    if len(dtypes) > 1:
        return f"the sources hold different dtypes ({', '.join(sorted(map(str, dtypes)))})"
    return None


def count_problem(b: Binding, produced: int) -> str | None:
    """Why a chain giving ``produced`` arrays does not fit the binding's targets, or None.

    One source for several targets must say it is a tie (a ``tie`` transform); several
    sources for fewer targets must say how they combine (``concat``).
    """
    n_t = len(b.targets)
    if produced == n_t:
        return None
    names = {op.name for op in b.rule.ops}
    if produced < n_t and "tie" not in names and len(b.sources) < n_t:
        return (
            f"the transforms give {produced} tensor(s) for {n_t} targets "
            f"({', '.join(b.targets)}): one source standing for several targets needs a "
            'tie transform ({ op = "tie", copies = N })'
        )
    if produced > n_t and "concat" not in names and len(b.sources) > n_t:
        return (
            f"the transforms give {produced} tensor(s) for {n_t} target(s) "
            f"({', '.join(b.targets)}): {len(b.sources)} sources onto fewer targets need a "
            "concat saying how they join"
        )
    return f"the transforms give {produced} tensor(s) for {n_t} target(s)"


def describe(b: Binding) -> dict[str, Any]:
    """A binding as JSON-ready facts."""
    from dmlib.mapping.transforms import describe_chain

    return {
        "rule": b.rule.number,
        "sources": list(b.sources),
        "targets": list(b.targets),
        "transform": describe_chain(b.rule.ops),
        "tied": b.rule.tied,
    }
