"""Tensor names across two sets: prefix mapping, and the obvious alignments when names differ.

The same weights often carry different names in two files: a training wrapper saves them
under ``model.``, ``torch.nn.parallel.DistributedDataParallel`` under ``module.``,
``torch.compile`` under ``_orig_mod.``. :class:`Rename` maps one side's names
(``"a:model.="`` strips ``model.`` from the first set's names, ``"b:=model."`` adds it to
the second's; ``"b:re:/=."`` is a regular expression rule, every match replaced) and
:func:`suggest_alignment` finds the prefix mapping that pairs the most names.

Across frameworks the same state also differs in separators and in a trailing ``value``
(JAX: Orbax writes ``model.l1.kernel.value`` for an ``nnx.State`` leaf, an npz export has
``model/l1/kernel`` or ``model.l1.kernel``): :func:`detect_mapping` finds the one rule set
(``/`` to ``.``, a trailing ``.value`` dropped, on either side) that pairs the names, and
only when exactly one does.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from dmlib.errors import DmlibError
from dmlib.tensor import TensorSet

__all__ = [
    "KNOWN_PREFIXES",
    "Rename",
    "apply_renames",
    "closest",
    "detect_mapping",
    "parse_renames",
    "regex_budget",
    "suggest_alignment",
]

#: Prefixes that wrappers add to every parameter name (checked first when aligning).
KNOWN_PREFIXES = ("model.", "module.", "_orig_mod.", "module._orig_mod.", "_orig_mod.module.")


@dataclass(frozen=True)
class Rename:
    """Replace the prefix ``old`` by ``new`` in the names of one side (``"a"`` or ``"b"``).

    Names that do not start with ``old`` keep their name. With ``regex=True``, ``old`` is
    a regular expression and every match in a name is replaced by ``new`` (``re.sub``:
    ``\\1`` refers to a group); spelled ``SIDE:re:REGEX=REPLACEMENT``.

    Examples
    --------
    >>> Rename.parse("a:model.=").apply("model.fc.weight")
    'fc.weight'
    """

    side: str
    old: str
    new: str
    regex: bool = False

    @classmethod
    def parse(cls, text: str) -> Rename:
        """From ``SIDE:OLD=NEW`` (SIDE ``a`` or ``b``; OLD or NEW may be empty, not both),
        or ``SIDE:re:REGEX=REPLACEMENT`` (split at the last ``=``)."""
        side, colon, rest = str(text).partition(":")
        if colon and side in ("a", "b") and rest.startswith("re:"):
            pattern, eq, repl = rest[3:].rpartition("=")
            if not eq or not pattern:
                raise DmlibError(
                    f"invalid name rule {text!r}; expected SIDE:re:REGEX=REPLACEMENT, e.g. "
                    "'b:re:/=.' (every '/' of B's names becomes '.')"
                )
            try:
                re.compile(pattern)
            except re.error as err:
                raise DmlibError(
                    f"invalid regular expression in name rule {text!r}: {err}"
                ) from None
            return cls(side, pattern, repl, regex=True)
        old, eq, new = rest.partition("=")
        if not colon or not eq or side not in ("a", "b") or (not old and not new):
            raise DmlibError(
                f"invalid name mapping {text!r}; expected SIDE:OLD=NEW with SIDE a or b, e.g. "
                "'a:model.=' (strip 'model.' from A's names) or 'b:=module.' (add it to B's)"
            )
        return cls(side, old, new)

    def apply(self, name: str) -> str:
        """``name`` renamed (a name that does not start with ``old`` is kept); with ``regex=True``
        every match replaced, a failing replacement a DmlibError.
        """
        if self.regex:
            try:
                return _compiled(self.old).sub(self.new, name)
            except (re.error, IndexError) as err:  # a replacement naming a missing group
                raise DmlibError(f"name rule {self}: {err}") from None
        return self.new + name[len(self.old) :] if name.startswith(self.old) else name

    def __str__(self) -> str:
        return f"{self.side}:{'re:' if self.regex else ''}{self.old}={self.new}"


def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


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


_SLASH = r"/"
_VALUE = r"\.value$"


def _rules(names: set[str], side: str) -> list[list[Rename]]:
    """The separator / trailing-``value`` rule sets that change some of ``names``."""
    sep = any("/" in n for n in names)
    val = any(n.endswith((".value", "/value")) for n in names)
    one = [Rename(side, _SLASH, ".", regex=True)] if sep else []
    two = [Rename(side, _VALUE, "", regex=True)] if val else []
    out: list[list[Rename]] = [[]]
    out += [one] if one else []
    out += [two] if two else []
    out += [one + two] if one and two else []
    return out


def _mapped(names: set[str], rules: list[Rename]) -> dict[str, str] | None:
    """``{new: old}``, or None when the rules map two names onto one."""
    out: dict[str, str] = {}
    for n in names:
        m = n
        for r in rules:
            m = r.apply(m)
        if m in out:
            return None
        out[m] = n
    return out


def detect_mapping(names_a: Sequence[str], names_b: Sequence[str]) -> dict[str, Any] | None:
    """The separator / ``.value`` rules that pair names of two frameworks, when unambiguous.

    Candidate rules, on either side: every ``/`` becomes ``.``; a trailing ``.value`` is
    dropped. The rule set chosen pairs more names than the names do as they are, maps no
    two names of a side onto one, and is the only set (of the fewest rules) giving that
    many pairs; otherwise None (nothing is renamed without being sure).

    Returns
    -------
    dict or None
        ``{"renames": [Rename...], "spec": "b:re:/=. a:re:\\.value$=", "shared_before": n,
        "shared_after": m}``.
    """
    a, b = set(names_a), set(names_b)
    before = len(a & b)
    found: list[tuple[int, int, list[Rename], frozenset[tuple[str, str]]]] = []
    for ra in _rules(a, "a"):
        ma = _mapped(a, ra)
        if ma is None:
            continue
        for rb in _rules(b, "b"):
            mb = _mapped(b, rb)
            if mb is None or not (ra or rb):
                continue
            pairs = frozenset((ma[k], mb[k]) for k in ma.keys() & mb.keys())
            found.append((len(pairs), len(ra) + len(rb), ra + rb, pairs))
    if not found:
        return None
    best = max(f[0] for f in found)
    if best <= before:
        return None
    fewest = min(f[1] for f in found if f[0] == best)
    top = [f for f in found if f[0] == best and f[1] == fewest]
    if len({f[3] for f in top}) != 1:
        return None
    rules = top[0][2]
    return {
        "renames": rules,
        "spec": " ".join(str(r) for r in rules),
        "shared_before": before,
        "shared_after": best,
    }


def closest(word: str, names: Iterable[str], n: int = 3) -> list[str]:
    """The names most like ``word`` (glob characters ignored), for "did you mean" messages."""
    names = list(names)
    plain = "".join(c for c in word if c not in "*?[]")
    import difflib  # only when a suggestion is made (start-up time)

    return difflib.get_close_matches(plain, names, n=n, cutoff=0.0) if names else []


#: Seconds one user regex may spend on one name (main thread) before it is refused.
REGEX_BUDGET = 1.0


class _OverBudget(Exception):
    pass


def _nested_repeat(tree: Any, inside: bool = False) -> bool:
    """Whether a parsed pattern repeats (max > 1) something that itself repeats or branches."""
    import re._constants as c  # the parser's own opcodes (Python 3.11+)

    for op, av in tree:
        if op in (c.MAX_REPEAT, c.MIN_REPEAT, c.POSSESSIVE_REPEAT):
            lo, hi, sub = av
            if hi > 1 and inside:
                return True
            if _nested_repeat(sub, inside or hi > 1):
                return True
        elif op == c.BRANCH:
            if inside:
                return True
            if any(_nested_repeat(s, inside) for s in av[1]):
                return True
        elif op in (c.SUBPATTERN, c.ATOMIC_GROUP, c.ASSERT, c.ASSERT_NOT):
            sub = av[-1]
            if _nested_repeat(sub, inside):
                return True
    return False


def user_regex(pattern: str, what: str) -> Callable[[str], bool]:
    """``search`` of a regular expression given by a user or a shared file, bounded in time.

    Refused (:class:`DmlibError`, naming ``what``): an invalid pattern, and one that
    repeats a repetition or an alternation (``(a+)+``, ``(a|b)*``), whose matching time
    can grow exponentially with the name. Each match in the main thread runs under
    :data:`REGEX_BUDGET` seconds (a SIGALRM timer; the regex engine checks for signals);
    a match over budget is refused naming the pattern and the name's length.
    """
    import re
    import re._parser as parser

    try:
        rx = re.compile(pattern)
        tree = parser.parse(pattern)
    except re.error as err:
        raise DmlibError(f"{what}: bad regular expression {pattern!r}: {err}") from None
    if _nested_repeat(tree.data if hasattr(tree, "data") else tree):
        raise DmlibError(
            f"{what}: regular expression {pattern!r} repeats a repetition or an alternation "
            "(like (a+)+ or (a|b)*), which can take exponential time on a long name; rewrite it "
            "without the nested repeat"
        )
    return lambda name: _timed_search(rx, name, what)


def _timed_search(rx: Any, name: str, what: str) -> bool:
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getitimer(
        signal.ITIMER_REAL
    ) != (0.0, 0.0):
        return rx.search(name) is not None  # no timer to borrow: the structural check only

    def over(signum: int, frame: Any) -> None:
        raise _OverBudget()

    previous = signal.signal(signal.SIGALRM, over)
    try:
        signal.setitimer(signal.ITIMER_REAL, REGEX_BUDGET)
        return rx.search(name) is not None
    except _OverBudget:
        raise DmlibError(
            f"{what}: regular expression {rx.pattern[:100]!r} took more than {REGEX_BUDGET:g} s "
            f"on a name of {len(name):,} characters; refused (simplify the pattern)"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _Budget:
    """State of :func:`regex_budget`: the match running now (pattern, name, start) or None."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.running: tuple[Any, str, float] | None = None

    def fullmatch(self, rx: Any, name: str) -> Any:
        """``rx.fullmatch(name)``, timed (see :func:`regex_budget`)."""
        import time

        self.running = (rx, name, time.monotonic())
        try:
            return rx.fullmatch(name)
        finally:
            self.running = None


@contextlib.contextmanager
def regex_budget(what: str) -> Iterator[_Budget]:
    """Many matches of patterns from a user or a shared file, each bounded in time.

    Within the block, ``budget.fullmatch(rx, name)`` is ``rx.fullmatch(name)``; in the main
    thread each such match may run :data:`REGEX_BUDGET` seconds, past which it is refused
    (:class:`DmlibError` naming ``what``, the pattern and the name's length), as
    :func:`user_regex` refuses a search. One interval timer (``SIGALRM`` every quarter of
    the budget) serves every match of the block, so a match costs one clock reading more;
    the timer interrupts nothing but a match that has run past its budget. Outside the main
    thread, or where the program runs its own ``ITIMER_REAL`` timer, matches are untimed.
    """
    import signal
    import threading
    import time

    budget = _Budget(what)
    if threading.current_thread() is not threading.main_thread() or signal.getitimer(
        signal.ITIMER_REAL
    ) != (0.0, 0.0):
        yield budget
        return

    def tick(signum: int, frame: Any) -> None:
        running = budget.running
        if running is not None and time.monotonic() - running[2] >= REGEX_BUDGET:
            raise _OverBudget(running)

    previous = signal.signal(signal.SIGALRM, tick)
    try:
        signal.setitimer(signal.ITIMER_REAL, REGEX_BUDGET / 4, REGEX_BUDGET / 4)
        yield budget
    except _OverBudget as over:
        rx, name, _ = over.args[0]
        raise DmlibError(
            f"{what}: pattern {rx.pattern[:100]!r} took more than {REGEX_BUDGET:g} s on a name "
            f"of {len(name):,} characters; refused (simplify the pattern)"
        ) from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
