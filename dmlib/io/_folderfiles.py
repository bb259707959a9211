"""The files of a checkpoint folder read by name (``trainer_state.json``, ``config.json``, a
weights file): inside the folder, regular, of a bounded size; a JSON member parsed within
the keys-per-object and nesting bounds (:func:`json_member`). Shared by the Trainer folder's
reader (:mod:`dmlib.io.hf_trainer`), its helpers (:mod:`dmlib.io._hf_names`) and the
``save_pretrained`` folders (:mod:`dmlib.io.hf_pretrained`)."""

from __future__ import annotations

import json
import os
from typing import Any

from dmlib import _limits
from dmlib.errors import FormatError
from dmlib.safepaths import contained, read_regular


def _resolved_member(folder: str, fname: str) -> tuple[str, str]:
    """(``folder/fname``, its real path), refused when a symbolic link leads out of the folder."""
    fpath = os.path.join(folder, fname)
    real = os.path.realpath(fpath)
    if not contained(folder, real):
        raise FormatError(
            f"is a symbolic link to {real!r}, outside the checkpoint folder; only files "
            "inside it are read",
            path=fpath,
        )
    return fpath, real


def member(folder: str, fname: str) -> str:
    """``folder/fname``, refused when it is a symbolic link that leads out of the folder."""
    return _resolved_member(folder, fname)[0]


def read_member(folder: str, fname: str) -> bytes:
    """The bytes of ``folder/fname``: a regular file inside the folder, of a bounded size.

    Refused (:class:`FormatError`, naming the file): a symbolic link that leads out of the
    folder, anything but a regular file (a FIFO is opened without waiting on it, a device
    such as ``/dev/zero`` is never read), a file larger than
    :data:`dmlib._limits.MAX_TEXT_BYTES` (JSON becomes many times its size in memory) and
    one whose size changes while it is read. The path checked to lie inside the folder is
    the one opened (:func:`dmlib.safepaths.read_regular`, without following a symlink).
    """
    fpath, real = _resolved_member(folder, fname)
    return read_regular(
        real, where=fpath, error=FormatError, limit=_limits.MAX_TEXT_BYTES,
        kind="a JSON file of a checkpoint",
    )  # fmt: skip


_TOO_DEEP = object()  # json.loads ran out of recursion: refused as nested too deeply


def json_member(folder: str, fname: str, what: str) -> tuple[Any, str]:
    """(the JSON value of ``folder/fname``, its text), read by :func:`read_member`.

    Parsed within the bounds of every JSON file of a checkpoint folder: no object of more
    than :data:`dmlib._limits.MAX_JSON_KEYS` keys (refused while parsing), no nesting
    deeper than :data:`dmlib._limits.MAX_NESTING` (whether the parser runs out of
    recursion first or not). Each refusal is a :class:`FormatError` naming the file;
    ``what`` names its content in the message (``"trainer state"``, ``"config"``). The
    value may be any JSON value: the caller says what it expects.
    """
    fpath = os.path.join(folder, fname)
    raw = read_member(folder, fname)
    try:
        text = raw.decode("utf-8")
        value = json.loads(text, object_pairs_hook=_limits.json_pairs_hook(fpath, what))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(f"corrupt {what} ({err})", path=fpath) from None
    except RecursionError:
        value = _TOO_DEEP
    if value is _TOO_DEEP or _limits.nesting_depth(value) > _limits.MAX_NESTING:
        raise FormatError(
            f"{what} nests too deeply (more than {_limits.MAX_NESTING} levels)", path=fpath
        )
    return value, text
