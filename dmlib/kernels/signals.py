"""What a command does when a memory-mapped input shrinks under a read (SIGBUS).

Only the compiled module (``_fused.c``) can answer that signal: no Python runs in its
handler. This module imports nothing else, so a command installs the handler before
numpy is loaded.
"""

from __future__ import annotations

try:
    from dmlib.kernels import _fused  # type: ignore[attr-defined]
except ImportError:  # not built (no compiler at install): SIGBUS ends the process as before
    _fused = None

__all__ = ["exit_on_sigbus", "restore_sigbus"]


def exit_on_sigbus(message: str) -> bool:
    """Until :func:`restore_sigbus`, a SIGBUS ends the process with ``message`` on stderr
    and exit status 2 instead of a crash (False where the compiled module is not built,
    or the platform has no SIGBUS: the signal then kills the process as before).

    A memory-mapped file truncated while one of its chunks is being read raises SIGBUS:
    the guards before every chunk refuse a file that changed (``FileStamp.check``), but
    not one that shrinks in the instant of a read, or under a hashing thread's read. The
    command line installs this for the length of a command; a library never should
    behind its caller's back (Python code cannot run in that handler).
    """
    if _fused is None or not hasattr(_fused, "exit_on_sigbus"):
        return False
    return bool(_fused.exit_on_sigbus(message.encode("utf-8", "replace")))


def restore_sigbus() -> None:
    """Put back the SIGBUS handling :func:`exit_on_sigbus` replaced."""
    if _fused is not None and hasattr(_fused, "restore_sigbus"):
        _fused.restore_sigbus()
