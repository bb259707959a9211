"""The files of a checkpoint folder read by name (``trainer_state.json``, ``config.json``, a
weights file): inside the folder, regular, of a bounded size. Shared by the Trainer folder's
reader (:mod:`dmlib.io.hf_trainer`) and its helpers (:mod:`dmlib.io._hf_names`)."""

from __future__ import annotations

import os
import stat

from dmlib.errors import FormatError
from dmlib.safepaths import contained


def member(folder: str, fname: str) -> str:
    """``folder/fname``, refused when it is a symbolic link that leads out of the folder."""
    fpath = os.path.join(folder, fname)
    if not contained(folder, fpath):
        raise FormatError(
            f"is a symbolic link to {os.path.realpath(fpath)!r}, outside the checkpoint "
            "folder; only files inside it are read",
            path=fpath,
        )
    return fpath


def read_member(folder: str, fname: str) -> bytes:
    """The bytes of ``folder/fname``: a regular file inside the folder, of a bounded size.

    Refused (:class:`FormatError`, naming the file): a symbolic link that leads out of the
    folder, anything but a regular file (a FIFO is opened without waiting on it, a device
    such as ``/dev/zero`` is never read), and a file larger than
    :data:`dmlib._limits.MAX_TEXT_BYTES` (JSON becomes many times its size in memory).
    """
    from dmlib import _limits

    fpath = member(folder, fname)
    try:
        fd = os.open(fpath, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise FormatError(f"cannot be read ({err.strerror or err})", path=fpath) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FormatError(
                "is not a regular file (a device, FIFO or socket); not read", path=fpath
            )
        limit = _limits.MAX_TEXT_BYTES
        if st.st_size > limit:
            raise FormatError(
                f"is {_limits.human(st.st_size)}, more than the {_limits.human(limit)} a JSON "
                f"file of a checkpoint may take; {_limits.limit_hint()}",
                path=fpath,
            )
        chunks, got = [], 0
        while got <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    if got > limit:
        raise FormatError("grew past its size limit while being read", path=fpath)
    return b"".join(chunks)
