"""The mapping file: rules from source (A) names to target (B) names, each with a chain.

See ``docs/mapping.md`` for the format. :func:`load_mapping` reads a TOML file (or takes
the same structure as a dict) and checks everything that can be checked without the
tensors: keys, transforms, placeholders. :func:`to_toml` writes one back.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any

from dmlib import _limits
from dmlib.errors import DmlibError
from dmlib.mapping.transforms import Op, parse_op

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = [
    "Mapping",
    "Rule",
    "capture_names",
    "compile_pattern",
    "fill",
    "literal_ends",
    "load_mapping",
    "loads",
    "pattern_problem",
    "to_toml",
]

VERSION = 1
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)(?::([w*]))?\}")
#: what a capture matches: digits (``{i}``, at most 18: a number, not a digit string of
#: thousands that ``int()`` refuses), one dotless name part (``{p:w}``), anything (``{x:*}``)
_KINDS = {None: "[0-9]{1,18}", "": "[0-9]{1,18}", "w": "[^.]+", "*": ".+"}
_TOP_KEYS = {"version", "same_names", "ignore_a", "ignore_b", "rule"}
_RULE_KEYS = {"source", "target", "transforms", "tied", "note"}
#: the most captures one name pattern may hold (real ones hold one to three)
MAX_CAPTURES = 16


@dataclass(frozen=True)
class Rule:
    """Source patterns -> target patterns through a chain of transforms.

    ``{name}`` in a pattern captures a run of digits (a layer number, a rank). A capture
    of the sources that the targets do not use is *gathered*: every match, in numeric
    order, becomes one more source of the same rule (tensor-parallel shards).
    """

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    ops: tuple[Op, ...] = ()
    tied: bool = False
    number: int = 0  # 1-based position in the file, for messages
    note: str | None = None

    @property
    def gathered(self) -> list[str]:
        """Captures of the sources that no target uses, in order of appearance."""
        used = {n for p in self.targets for n in capture_names(p)}
        seen = [n for p in self.sources for n in capture_names(p)]
        return [n for n in dict.fromkeys(seen) if n not in used]

    def label(self) -> str:
        """``rule N (sources -> targets)``: the rule as messages name it."""
        return f"rule {self.number} ({', '.join(self.sources)} -> {', '.join(self.targets)})"


@dataclass(frozen=True)
class Mapping:
    """A parsed mapping file."""

    rules: tuple[Rule, ...]
    ignore_a: tuple[str, ...] = ()
    ignore_b: tuple[str, ...] = ()
    same_names: bool = False
    path: str | None = None
    comments: dict[int, str] = field(default_factory=dict)


def capture_names(pattern: str) -> list[str]:
    """The capture names of a pattern, in order (``{i}``, ``{p:w}``, ``{x:*}``)."""
    return [m.group(1) for m in _PLACEHOLDER.finditer(pattern)]


def fill(pattern: str, caps: dict[str, str]) -> str:
    """A pattern with its captures replaced by their values."""
    return _PLACEHOLDER.sub(lambda m: caps[m.group(1)], pattern)


@functools.lru_cache(maxsize=1024)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """A full-match regular expression for a name pattern (captures as :data:`_KINDS`).

    Compiled once per pattern (cached): a mapping is resolved again for every run a matrix
    or a ladder sees through it. Match it with :func:`dmlib.names.regex_budget` (a pattern
    from a file may backtrack for long on a name built against it).
    """
    out, pos, seen = [], 0, set()
    for m in _PLACEHOLDER.finditer(pattern):
        out.append(re.escape(pattern[pos : m.start()]))
        name = m.group(1)
        out.append(f"(?P={name})" if name in seen else f"(?P<{name}>{_KINDS[m.group(2)]})")
        seen.add(name)
        pos = m.end()
    out.append(re.escape(pattern[pos:]))
    return re.compile("".join(out))


@functools.lru_cache(maxsize=1024)
def literal_ends(pattern: str) -> tuple[str, str]:
    """The text a name must start and end with to match ``pattern`` (before its first
    capture, after its last): a test far cheaper than the match, made first."""
    found = list(_PLACEHOLDER.finditer(pattern))
    if not found:
        return pattern, pattern
    return pattern[: found[0].start()], pattern[found[-1].end() :]


def pattern_problem(pattern: str) -> str | None:
    """Why a name pattern is refused before it meets a name, or None.

    Two ``{x:*}`` captures with nothing between them split a name in any of its places
    (which one is meant cannot be told, and trying each takes time growing as a power of
    the name's length); more than :data:`MAX_CAPTURES` captures is not a name pattern.
    """
    found = list(_PLACEHOLDER.finditer(pattern))
    if len(found) > MAX_CAPTURES:
        return f"holds {len(found)} captures, more than the {MAX_CAPTURES} a pattern may hold"
    for a, b in zip(found, found[1:]):
        if a.end() == b.start() and a.group(2) == "*" and b.group(2) == "*":
            return (
                f"{a.group(0)}{b.group(0)}: two {{x:*}} captures side by side can split a name "
                "anywhere; put the text that separates them between them"
            )
    return None


_TOO_DEEP = (
    f"arrays or tables nest more than {_limits.MAX_NESTING} deep, too deep for a mapping file"
)


def _read_text(path: str) -> bytes:
    """A mapping file's bytes: a regular file (a FIFO is not waited on, a device not read)
    of at most :data:`dmlib._limits.MAX_TEXT_BYTES`, read by the one reader of files an
    input names (:func:`dmlib.safepaths.read_regular`); the messages name ``path``."""
    from dmlib.safepaths import read_regular

    return read_regular(
        os.path.realpath(path), where=path, limit=_limits.MAX_TEXT_BYTES, kind="a mapping file"
    )


def load_mapping(source: Any) -> Mapping:
    """A :class:`Mapping` from a path to a TOML file, a TOML dict, or a Mapping (as is)."""
    if isinstance(source, Mapping):
        return source
    path = None
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        try:
            raw = tomllib.loads(_read_text(path).decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
            raise DmlibError(f"not a valid TOML mapping file ({err})", path=path) from None
        except RecursionError:  # tomllib recurses per nested array or inline table
            raise DmlibError(_TOO_DEEP, path=path) from None
        except OSError as err:
            raise DmlibError(f"cannot read ({err.strerror or err})", path=path) from None
    elif isinstance(source, dict):
        raw = source
    else:
        raise DmlibError(
            f"a mapping is a path to a TOML file or a dict, not a {type(source).__name__}"
        )
    if _limits.nesting_depth(raw) > _limits.MAX_NESTING:  # nested tables need no recursion
        raise DmlibError(_TOO_DEEP, path=path)
    try:
        return _parse(raw, path)
    except DmlibError as err:
        if path is None or err.path is not None:
            raise
        raise DmlibError(err.message, path=path) from None


def loads(text: str) -> Mapping:
    """A :class:`Mapping` from TOML text."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise DmlibError(f"not a valid TOML mapping ({err})") from None
    except RecursionError:  # tomllib recurses per nested array or inline table
        raise DmlibError(_TOO_DEEP) from None
    if _limits.nesting_depth(raw) > _limits.MAX_NESTING:
        raise DmlibError(_TOO_DEEP)
    return _parse(raw, None)


def _strings(v: Any, what: str) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not items or not all(isinstance(x, str) and x for x in items):
        raise DmlibError(f"{what} must be a non-empty string or list of strings, got {v!r}")
    return tuple(items)


def _parse(raw: dict[str, Any], path: str | None) -> Mapping:
    extra = sorted(set(raw) - _TOP_KEYS)
    if extra:
        raise DmlibError(
            f"unknown key(s) {', '.join(extra)}; expected {', '.join(sorted(_TOP_KEYS))}"
        )
    if raw.get("version", VERSION) != VERSION:
        raise DmlibError(
            f"mapping version {raw.get('version')!r} is not supported (expected {VERSION})"
        )
    rules_raw = raw.get("rule", [])
    if not isinstance(rules_raw, list) or not all(isinstance(r, dict) for r in rules_raw):
        raise DmlibError("'rule' must be an array of tables ([[rule]])")
    rules = tuple(_rule(r, i + 1) for i, r in enumerate(rules_raw))
    ignore = {}
    for key in ("ignore_a", "ignore_b"):
        v = raw.get(key, [])
        ignore[key] = () if v == [] else _strings(v, key)
    same = raw.get("same_names", False)
    if not isinstance(same, bool):
        raise DmlibError(f"same_names must be true or false, got {same!r}")
    if not rules and not same:
        raise DmlibError("the mapping has no [[rule]] (and same_names is not set)")
    return Mapping(rules, ignore["ignore_a"], ignore["ignore_b"], same, path)


def _rule(r: dict[str, Any], number: int) -> Rule:
    where = f"rule {number}"
    extra = sorted(set(r) - _RULE_KEYS)
    if extra:
        raise DmlibError(
            f"{where}: unknown key(s) {', '.join(extra)}; expected {', '.join(sorted(_RULE_KEYS))}"
        )
    if "source" not in r or "target" not in r:
        raise DmlibError(f"{where}: needs 'source' and 'target'")
    sources = _strings(r["source"], f"{where}: source")
    targets = _strings(r["target"], f"{where}: target")
    for p in sources + targets:
        problem = pattern_problem(p)
        if problem:
            raise DmlibError(f"{where}: pattern {p[:100]!r} {problem}")
    ops_raw = r.get("transforms", [])
    if not isinstance(ops_raw, list):
        raise DmlibError(f"{where}: transforms must be an array of tables")
    ops = tuple(parse_op(o, f"{where}, transform {k + 1}") for k, o in enumerate(ops_raw))
    tied = r.get("tied", False)
    if not isinstance(tied, bool):
        raise DmlibError(f"{where}: tied must be true or false, got {tied!r}")
    have = {n for p in sources for n in capture_names(p)}
    for p in targets:
        unknown = [n for n in capture_names(p) if n not in have]
        if unknown:
            raise DmlibError(
                f"{where}: target {p!r} uses {{{unknown[0]}}}, which no source captures"
            )
    rule = Rule(sources, targets, (), False, number)
    own = [set(capture_names(p)) - set(rule.gathered) for p in sources]
    if any(o != own[0] for o in own):
        raise DmlibError(
            f"{where}: every source pattern must capture the same names (besides gathered "
            f"shard numbers); got {', '.join(repr(p) for p in sources)}"
        )
    words = [
        m.group(1)
        for p in sources
        for m in _PLACEHOLDER.finditer(p)
        if m.group(1) in rule.gathered and m.group(2)
    ]
    if words:
        raise DmlibError(
            f"{where}: {{{words[0]}}} is gathered (no target uses it), so it must number the "
            "shards: write it as digits, {" + words[0] + "}"
        )
    note = r.get("note")
    return Rule(sources, targets, ops, tied, number, note if isinstance(note, str) else None)


def printable(s: str) -> str:
    """``s`` with every non-printable character written as an escape (``\\x1b``, ``\\n``)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(s))


def _q(s: str) -> str:
    """A TOML basic string (control characters as ``\\uXXXX``)."""
    body = s.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + "".join(c if c.isprintable() else _uescape(c) for c in body) + '"'


def _uescape(c: str) -> str:
    return f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}"


def _names(v: tuple[str, ...]) -> str:
    return _q(v[0]) if len(v) == 1 else "[" + ", ".join(_q(x) for x in v) + "]"


def to_toml(mapping: Mapping, header: str = "") -> str:
    """The mapping as TOML text; ``mapping.comments[number]`` goes above each rule."""
    lines = [f"# {printable(ln)}".rstrip() for ln in header.splitlines()]
    lines.append(f"version = {VERSION}")
    if mapping.same_names:
        lines.append("same_names = true")
    for key in ("ignore_a", "ignore_b"):
        vals = getattr(mapping, key)
        if vals:
            lines.append(f"{key} = [" + ", ".join(_q(x) for x in vals) + "]")
    for rule in mapping.rules:
        lines.append("")
        for ln in mapping.comments.get(rule.number, "").splitlines():
            lines.append(f"# {printable(ln)}".rstrip())
        lines.append("[[rule]]")
        lines.append(f"source = {_names(rule.sources)}")
        lines.append(f"target = {_names(rule.targets)}")
        if rule.ops:
            lines.append("transforms = [" + ", ".join(op.as_toml() for op in rule.ops) + "]")
        if rule.tied:
            lines.append("tied = true")
    return "\n".join(lines) + "\n"
