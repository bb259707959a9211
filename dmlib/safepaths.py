"""Paths named by a file dmlib reads stay where that file says they are.

A capture manifest names its dumped tensors by path; a study names capture folders. Both
may come from someone else. :func:`inside` resolves a relative path against the folder
that names it, symlinks included (``os.path.realpath``), and refuses one that is
absolute or ends up outside the folder; :func:`regular_file` refuses what is not a plain
file (a FIFO would block a hash forever, ``/proc`` files change while read);
:func:`bounded_json` reads JSON nested no deeper than :data:`dmlib._limits.MAX_NESTING`. A
reader of a folder format opens each file through :func:`confined_file` (inside the folder,
symlinks resolved, a regular file).

:func:`read_regular` is the one reader of a file an input names, whole or a byte range:
the Orbax and OCDBT readers' chunks and metadata, a Trainer or ``save_pretrained`` folder's
JSON (:func:`dmlib.io._folderfiles.read_member`, after its own confinement check) and a
mapping file (:func:`dmlib.mapping.spec.load_mapping`) all go through it: never through a
final symlink, never waiting on a FIFO, a size limit checked before reading where one is
given, a file changing size while read refused.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from dmlib._limits import MAX_NESTING, human, nesting_depth
from dmlib.errors import DmlibError

__all__ = [
    "bounded_json",
    "confined_file",
    "contained",
    "inside",
    "read_regular",
    "regular_file",
]


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


def confined_file(
    top: str,
    path: str | os.PathLike[str],
    *,
    what: str,
    where: str | os.PathLike[str] | None = None,
    error: type[DmlibError] = DmlibError,
    folders: dict[str, str] | None = None,
) -> tuple[str, int] | None:
    """(real path, size) of ``path`` when it resolves inside the folder ``top`` and is a
    regular file; None when nothing is there.

    ``top`` must already be a real path (``os.path.realpath``). ``path`` is resolved with
    every symlink followed: one that leads outside ``top`` is refused naming ``what`` and
    where it leads, whether or not its target exists; what is there but is not a regular
    file (a FIFO, a device, a folder) is refused without being opened. Messages are
    prefixed with ``where`` (the folder as the user named it; default ``top``).

    ``folders`` caches the real path of each folder met (a reader of thousands of chunk
    files resolves their folder once, then looks at each file itself with ``lstat``,
    resolving it whole only where it is a symlink).
    """
    where = top if where is None else where
    if "\x00" in os.fspath(path):
        raise error(f"{what} holds a NUL character; not a path", path=where)
    real, st = _resolved(os.fspath(path), folders)
    if not (real == top or real.startswith(top.rstrip(os.sep) + os.sep)):
        raise error(
            f"{what} leads outside the checkpoint (a symlink to {real}); only files "
            "inside it are read",
            path=where,
        )
    try:
        st = st if st is not None else os.stat(real)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise error(f"{what} cannot be read ({err.strerror})", path=where) from None
    if not stat.S_ISREG(st.st_mode):
        raise error(
            f"{what} is not a regular file (a folder, device or FIFO); not read", path=where
        )
    return real, st.st_size


def _resolved(path: str, folders: dict[str, str] | None) -> tuple[str, os.stat_result | None]:
    """(real path, its stat where already known) of ``path``, through the folder cache."""
    if folders is None:
        return os.path.realpath(path), None
    parent, name = os.path.split(path)
    top = folders.get(parent)
    if top is None:
        top = folders[parent] = os.path.realpath(parent)
    try:
        st = os.lstat(path)
    except OSError:
        return os.path.realpath(path), None  # nothing there (or unreadable): resolved whole
    if stat.S_ISLNK(st.st_mode) or name in ("", ".", ".."):
        return os.path.realpath(path), None
    return os.path.join(top, name), st


# read only, never blocking (a FIFO), never through a final symlink
_READ_FLAGS = (
    os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)


def read_regular(
    real: str,
    offset: int = 0,
    length: int | None = None,
    *,
    what: str = "",
    where: str | os.PathLike[str],
    error: type[DmlibError] = DmlibError,
    limit: int | None = None,
    kind: str = "a file",
    hint: str = "",
) -> bytes:
    """``length`` bytes at ``offset`` of the regular file ``real`` (None: the rest of it).

    The one reader of a file named by an input: ``real`` is a path already resolved (and,
    for a folder format, checked to lie inside the folder: :func:`confined_file`). It is
    opened without following a final symlink and without blocking, then checked with
    ``fstat``, so a FIFO or device put in its place after the caller looked is refused,
    never waited on or read. With ``limit``, a file larger than ``limit`` bytes is refused
    before a byte is read (``kind`` names what may take that much: ``"a mapping file"``;
    ``hint``, where given, follows: how to lift the limit for a file the user trusts).
    Read to its end, a file whose size changes while it is read is refused, never returned
    cut short or grown. Each refusal is one ``error`` for ``where``, its text prefixed
    with ``what`` (the member's name where ``where`` is its folder).
    """
    pre = f"{what} " if what else ""
    try:
        fd = os.open(real, _READ_FLAGS)
    except FileNotFoundError:
        raise error(f"{pre}not found", path=where) from None
    except OSError as err:
        raise error(f"{pre}cannot be read ({err.strerror or err})", path=where) from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise error(f"{pre}is a directory, not {kind}; not read", path=where)
        if not stat.S_ISREG(st.st_mode):
            raise error(
                f"{pre}is not a regular file (a device, FIFO or socket); not read", path=where
            )
        if limit is not None and st.st_size > limit:
            text = f"{pre}is {_sizes(st.st_size, limit)} {kind} may take"
            raise error(f"{text}; {hint}" if hint else text, path=where)
        want = max(st.st_size - offset, 0) if length is None else length
        data = _pread_all(fd, offset, want)
        if length is None and (len(data) != want or os.pread(fd, 1, offset + want)):
            raise error(f"{pre}changed while reading (its size is not the one opened)", path=where)
        return data
    finally:
        os.close(fd)


def _sizes(size: int, limit: int) -> str:
    """``4.9 KiB, more than the 4.0 KiB``: in bytes where the short figures would read alike."""
    big, top = human(size), human(limit)
    if big == top:
        big, top = f"{size:,} bytes", f"{limit:,} bytes"
    return f"{big}, more than the {top}"


def _pread_all(fd: int, offset: int, want: int) -> bytes:
    """Up to ``want`` bytes at ``offset`` (fewer where the file ends first)."""
    parts, got = [], 0
    while got < want:
        chunk = os.pread(fd, min(want - got, 1 << 30), offset + got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def bounded_json(
    text: str,
    *,
    where: str | os.PathLike[str],
    limit: int = MAX_NESTING,
    error: type[DmlibError] = DmlibError,
) -> Any:
    """``json.loads(text)``, refusing invalid JSON and nesting deeper than ``limit``.

    The message names ``where`` (the file) and says what was wrong. The default limit is
    the one every reader's nesting has (a capture manifest dmlib writes nests at most 6).
    """
    try:
        obj = json.loads(text)
    except RecursionError:
        raise error(
            f"is nested too deeply (more than {limit} levels of lists or objects)", path=where
        ) from None
    except ValueError as err:
        raise error(f"is not valid JSON ({err})", path=where) from None
    if nesting_depth(obj, limit) > limit:
        raise error(
            f"is nested too deeply (more than {limit} levels of lists or objects)", path=where
        )
    return obj
