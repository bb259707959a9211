"""Paths named by a file dmlib reads stay where that file says they are.

A capture manifest names its dumped tensors by path; a study names capture folders. Both
may come from someone else. :func:`inside` resolves a relative path against the folder
that names it, symlinks included (``os.path.realpath``), and refuses one that is
absolute or ends up outside the folder; :func:`regular_file` refuses what is not a plain
file (a FIFO would block a hash forever, ``/proc`` files change while read);
:func:`bounded_json` reads JSON nested no deeper than a limit.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from dmlib.errors import DmlibError

__all__ = ["MAX_JSON_DEPTH", "bounded_json", "contained", "inside", "regular_file"]

#: Deepest nesting of lists and objects a manifest may hold (dmlib writes at most 6).
MAX_JSON_DEPTH = 64


def contained(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> bool:
    """Whether ``path``, symlinks resolved, is ``root`` itself or lies under it."""
    top = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def inside(
    root: str | os.PathLike[str],
    rel: Any,
    *,
    what: str,
    where: str | os.PathLike[str],
    error: type[DmlibError] = DmlibError,
) -> Path:
    """``root / rel`` when ``rel`` is a relative path that stays inside ``root``.

    Parameters
    ----------
    root
        The folder the path is relative to (a capture).
    rel
        The path as the file wrote it.
    what
        Names the entry in the message (``"boundary 3 ('fc'): dump file"``).
    where
        The file that named the path (the manifest); the message is prefixed with it.
    error
        The :class:`DmlibError` subclass raised.

    Raises
    ------
    DmlibError
        ``rel`` is not a non-empty string, is absolute, or resolves (``..``, a symlink)
        outside ``root``.
    """
    if not isinstance(rel, str) or not rel or "\x00" in rel:
        raise error(f"{what} is {rel!r}; expected a relative path inside the folder", path=where)
    if os.path.isabs(rel) or rel.startswith("~"):
        raise error(
            f"{what} {rel!r} is an absolute path; only paths inside the folder are read",
            path=where,
        )
    full = Path(root) / rel
    if not contained(root, full):
        raise error(
            f"{what} {rel!r} leads outside the folder (through '..' or a symlink); only "
            "files inside it are read",
            path=where,
        )
    return full


def regular_file(path: str | os.PathLike[str], *, error: type[DmlibError] = DmlibError) -> None:
    """Refuse ``path`` unless it is a regular file (symlinks followed)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise error(f"cannot be read ({err.strerror})", path=path) from None
    if not stat.S_ISREG(mode):
        raise error("is not a regular file (a device, FIFO or socket); not read", path=path)


def _depth(obj: Any, limit: int) -> int:
    """Nesting depth of lists and dicts in ``obj``, counted without recursion (stops past limit)."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (list, dict)):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack += [(v, d + 1) for v in (o.values() if isinstance(o, dict) else o)]
    return deepest


def bounded_json(
    text: str,
    *,
    where: str | os.PathLike[str],
    limit: int = MAX_JSON_DEPTH,
    error: type[DmlibError] = DmlibError,
) -> Any:
    """``json.loads(text)``, refusing invalid JSON and nesting deeper than ``limit``.

    The message names ``where`` (the file) and says what was wrong.
    """
    try:
        obj = json.loads(text)
    except RecursionError:
        raise error(
            f"is nested too deeply (more than {limit} levels of lists or objects)", path=where
        ) from None
    except ValueError as err:
        raise error(f"is not valid JSON ({err})", path=where) from None
    if _depth(obj, limit) > limit:
        raise error(
            f"is nested too deeply (more than {limit} levels of lists or objects)", path=where
        )
    return obj
