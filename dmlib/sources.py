"""Sources and selection: what every analysis takes in before it computes anything.

A *source* is a path (opened with :func:`dmlib.open_tensors`), a :class:`TensorSet`, or a
mapping name -> array. :func:`opened` turns any of them into a TensorSet and closes
afterwards only what it opened itself. *Patterns* choose tensors by name: a glob
matched against the whole name when the pattern has ``*``, ``?`` or ``[`` (``"*.u"``), a
substring of the name when it has none (``"attn"``), or, prefixed ``"re:"``, a regular
expression searched anywhere in the name; :func:`select` applies ``include``/``exclude``
lists of them, and :func:`check_selection` refuses a selection over nothing.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from dmlib.errors import DmlibError
from dmlib.tensor import ArrayTensorSet, TensorSet

__all__ = [
    "Patterns",
    "Source",
    "as_tensor_set",
    "check_selection",
    "name_filter",
    "open_source",
    "opened",
    "patterns",
    "select",
]

Source = str | os.PathLike[str] | TensorSet | Mapping[str, np.ndarray]
Patterns = str | Sequence[str] | None


# -- opening ----------------------------------------------------------------------------


def as_tensor_set(source: Source) -> TensorSet:
    """A TensorSet for a source; a path is opened and left open (see :func:`opened`)."""
    if isinstance(source, TensorSet):
        return source
    if isinstance(source, (str, os.PathLike)):
        from dmlib.io import open_tensors  # readers are imported only when a file is named

        return open_tensors(source)
    if isinstance(source, Mapping):
        return ArrayTensorSet({k: np.asarray(v) for k, v in source.items()})
    raise DmlibError(
        f"cannot read tensors from a {type(source).__name__}: pass a path or a TensorSet "
        "(or a mapping name -> array)"
    )


@contextlib.contextmanager
def opened(source: Source) -> Iterator[TensorSet]:
    """A TensorSet for a source, closing on exit what was opened here from a path.

    A TensorSet passed in is yielded as is and left open: its owner closes it.
    """
    ts = as_tensor_set(source)
    try:
        yield ts
    finally:
        if isinstance(source, (str, os.PathLike)):
            ts.close()


def open_source(source: Source, stack: contextlib.ExitStack) -> TensorSet:
    """:func:`opened` entered on ``stack``: closed when the stack exits."""
    return stack.enter_context(opened(source))


# -- selection --------------------------------------------------------------------------


def patterns(p: Patterns) -> list[str]:
    """A pattern argument as a list: None -> [], one pattern -> [it]."""
    return [] if p is None else [p] if isinstance(p, str) else list(p)


def select(names: Sequence[str], include: Patterns = None, exclude: Patterns = None) -> list[str]:
    """Names kept by ``include`` (any pattern matches; None keeps all) minus ``exclude``.

    A pattern with glob characters (``*``, ``?``, ``[``) is matched against the whole
    name (``"blocks.*.attn.*"``); one without them is a substring of the name
    (``"attn"`` keeps every name containing ``attn``); prefixed ``"re:"``, it is a
    regular expression searched anywhere in the name (``"re:^factors\\."``).
    """
    keep = name_filter(include, exclude)
    return [n for n in names if keep(n)]


def name_filter(include: Patterns = None, exclude: Patterns = None) -> Callable[[str], bool]:
    """A predicate on tensor names with :func:`select`'s rules (patterns compiled once)."""
    inc = [_matcher(p) for p in patterns(include)]
    exc = [_matcher(p) for p in patterns(exclude)]

    def keep(name: str) -> bool:
        return (not inc or any(m(name) for m in inc)) and not any(m(name) for m in exc)

    return keep


GLOB_CHARS = "*?["


def _matcher(pattern: str) -> Callable[[str], bool]:
    if pattern.startswith("re:"):
        from dmlib.names import user_regex  # bounded: no pattern hangs on a long name

        return user_regex(pattern[3:], f"pattern {pattern[:100]!r}")
    if not any(c in pattern for c in GLOB_CHARS):
        return lambda name: pattern in name
    return lambda name: fnmatch.fnmatchcase(name, pattern)


def check_selection(
    names_a: Sequence[str],
    names_b: Sequence[str],
    include: Patterns,
    exclude: Patterns,
    path_a: Any = None,
    path_b: Any = None,
) -> None:
    """Refuse an ``include`` pattern that matches no name, and a selection that keeps none.

    Raises
    ------
    DmlibError
        Naming the pattern and the closest names of either side.
    """
    from dmlib.names import closest

    where = " or ".join(str(p) for p in (path_a, path_b) if p) or "either set"
    every = list(dict.fromkeys([*names_a, *names_b]))
    for p in patterns(include):
        m = _matcher(p)
        if not any(m(n) for n in every):
            near = closest(p.removeprefix("re:"), every)
            raise DmlibError(
                f"--include {p!r} matches no tensor name in {where} "
                f"(a pattern with * ? [ is matched against the whole name, one without them "
                f"is a substring); closest names: {', '.join(near) or 'none (no tensors)'}"
            )
    if every and not select(every, include, exclude):
        raise DmlibError(
            f"the selection (--include {patterns(include)} --exclude {patterns(exclude)}) "
            f"leaves no tensor of {where} to compare"
        )
