"""The files of a checkpoint folder read by name (``trainer_state.json``, ``config.json``, a
weights file): inside the folder, regular, of a bounded size. Shared by the Trainer folder's
reader (:mod:`dmlib.io.hf_trainer`), its helpers (:mod:`dmlib.io._hf_names`) and the
``save_pretrained`` folders (:mod:`dmlib.io.hf_pretrained`)."""

from __future__ import annotations

import os

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
    from dmlib import _limits

    fpath, real = _resolved_member(folder, fname)
    return read_regular(
        real, where=fpath, error=FormatError, limit=_limits.MAX_TEXT_BYTES,
        kind="a JSON file of a checkpoint",
    )  # fmt: skip
