"""Tensor names across two sets: prefix mapping, and the obvious alignments when names differ.

The same weights often carry different names in two files: a training wrapper saves them
under ``model.``, ``torch.nn.parallel.DistributedDataParallel`` under ``module.``,
``torch.compile`` under ``_orig_mod.``. :class:`Rename` maps one side's names
(``"a:model.="`` strips ``model.`` from the first set's names, ``"b:=model."`` adds it to
the second's) and :func:`suggest_alignment` finds the mapping that pairs the most names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dmlib.errors import DmlibError
from dmlib.tensor import TensorSet

__all__ = [
    "KNOWN_PREFIXES",
    "Rename",
    "apply_renames",
    "closest",
    "parse_renames",
    "suggest_alignment",
]

#: Prefixes that wrappers add to every parameter name (checked first when aligning).
KNOWN_PREFIXES = ("model.", "module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module.")


@dataclass(frozen=True)
class Rename:
    """Replace the prefix ``old`` by ``new`` in the names of one side (``"a"`` or ``"b"``).

    Names that do not start with ``old`` keep their name.

    Examples
    --------
    >>> Rename.parse("a:model.=").apply("model.fc.weight")
    'fc.weight'
    """

    side: str
    old: str
    new: str

    @classmethod
    def parse(cls, text: str) -> Rename:
        """From ``SIDE:OLD=NEW`` (SIDE ``a`` or ``b``; OLD or NEW may be empty, not both)."""
        side, colon, rest = str(text).partition(":")
        old, eq, new = rest.partition("=")
        if not colon or not eq or side not in ("a", "b") or (not old and not new):
            raise DmlibError(
                f"invalid name mapping {text!r}; expected SIDE:OLD=NEW with SIDE a or b, e.g. "
                "'a:model.=' (strip 'model.' from A's names) or 'b:=module.' (add it to B's)"
            )
        return cls(side, old, new)

    def apply(self, name: str) -> str:
        return self.new + name[len(self.old) :] if name.startswith(self.old) else name

    def __str__(self) -> str:
        return f"{self.side}:{self.old}={self.new}"


def parse_renames(specs: Any) -> list[Rename]:
    """Renames from None, a spec string, a :class:`Rename`, a ``(side, old, new)`` tuple or a list."""
    if specs is None:
        return []
    if isinstance(specs, (str, Rename)) or (
        isinstance(specs, tuple) and len(specs) == 3 and all(isinstance(x, str) for x in specs)
    ):
        specs = [specs]
    out = []
    for s in specs:
        if isinstance(s, Rename):
            out.append(s)
        elif isinstance(s, str):
            out.append(Rename.parse(s))
        elif isinstance(s, tuple) and len(s) == 3:
            out.append(Rename.parse(f"{s[0]}:{s[1]}={s[2]}"))
        else:
            raise DmlibError(f"invalid name mapping {s!r}; expected 'SIDE:OLD=NEW'")
    return out


def mapped_names(names: Iterable[str], renames: Sequence[Rename], side: str) -> dict[str, str]:
    """``{new name: original name}`` for one side; refuses two names mapped onto one."""
    out: dict[str, str] = {}
    for n in names:
        m = n
        for r in renames:
            if r.side == side:
                m = r.apply(m)
        if m in out:
            raise DmlibError(
                f"name mapping {', '.join(str(r) for r in renames if r.side == side)} maps both "
                f"{out[m]!r} and {n!r} of side {side.upper()} to {m!r}"
            )
        out[m] = n
    return out


def apply_renames(ts: TensorSet, renames: Sequence[Rename], side: str) -> TensorSet:
    """``ts`` with one side's names mapped (the same tensors, the same file; ``ts`` untouched)."""
    if not any(r.side == side for r in renames):
        return ts
    return ts.renamed({old: new for new, old in mapped_names(ts, renames, side).items()})


def _candidates(names: Sequence[str]) -> list[str]:
    counts = Counter(n.split(".", 1)[0] + "." for n in names if "." in n)
    return list(dict.fromkeys([*KNOWN_PREFIXES, *(p for p, _ in counts.most_common(20))]))


def suggest_alignment(names_a: Sequence[str], names_b: Sequence[str]) -> dict[str, Any] | None:
    """The prefix mapping that pairs the most names, when it pairs more than the names do now.

    Tries stripping one prefix (a wrapper's ``model.``, ``module.``, ``_orig_mod.``, or
    any first name component) from either side's names, or a different one from each.

    Returns
    -------
    dict or None
        ``{"renames": [Rename...], "spec": "a:model.=", "shared_before": n, "shared_after": m}``,
        or None when no mapping pairs more names.
    """
    a, b = set(names_a), set(names_b)
    before = len(a & b)
    strip_a = [p for p in _candidates(names_a) if any(n.startswith(p) for n in a)]
    strip_b = [p for p in _candidates(names_b) if any(n.startswith(p) for n in b)]
    best: tuple[int, list[Rename]] = (before, [])

    def strip(names: set[str], p: str) -> set[str]:
        return {n[len(p) :] if n.startswith(p) else n for n in names}

    options: list[list[Rename]] = [[Rename("a", p, "")] for p in strip_a]
    options += [[Rename("b", p, "")] for p in strip_b]
    options += [
        [Rename("a", p, ""), Rename("b", q, "")] for p in strip_a for q in strip_b if p != q
    ]
    for opt in options:
        ma, mb = a, b
        for r in opt:
            if r.side == "a":
                ma = strip(ma, r.old)
            else:
                mb = strip(mb, r.old)
        n = len(ma & mb)
        if n > best[0]:
            best = (n, opt)
    if not best[1]:
        return None
    return {
        "renames": best[1],
        "spec": " ".join(str(r) for r in best[1]),
        "shared_before": before,
        "shared_after": best[0],
    }


def closest(word: str, names: Iterable[str], n: int = 3) -> list[str]:
    """The names most like ``word`` (glob characters ignored), for "did you mean" messages."""
    names = list(names)
    plain = "".join(c for c in word if c not in "*?[]")
    import difflib  # only when a suggestion is made (start-up time)

    return difflib.get_close_matches(plain, names, n=n, cutoff=0.0) if names else []
