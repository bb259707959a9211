"""Text from data, made safe to print on a terminal.

Names, metadata values and paths come from files dmlib did not write. Printed raw, an
escape sequence in a tensor name can recolour, erase or rewrite a line (a verdict line
reading ``IDENTICAL`` while the exit status says otherwise), a bidi override can reorder
what the reader sees, and a 52-million-character name makes a 52 MB line. Every string
the CLI prints from data goes through :func:`shown` (one value) or :func:`escape` (a
whole line); :class:`SafeStream` applies :func:`escape` to everything the CLI writes, as
a second line of defence.

Escaped: C0 controls (U+0000-U+001F, tab and newline included, except where a whole
line keeps its own newlines), U+007F, C1 controls (U+0080-U+009F), the bidi marks and
overrides (U+061C, U+200E, U+200F, U+202A-U+202E, U+2066-U+2069), the line and paragraph
separators (U+2028, U+2029) and lone surrogates (undecodable bytes of a file name). Each
is shown as its Python escape: ESC as the four characters ``\\x1b``, U+202E as ``\\u202e``.
"""

from __future__ import annotations

import io
import re
import reprlib
from collections.abc import Iterable
from typing import Any, TextIO

__all__ = ["LIMIT", "SafeStream", "clip", "cut", "escape", "names_list", "shown"]

#: Characters of one value shown before it is cut (its length is then printed).
LIMIT = 200

_OTHER = "\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE_RX = re.compile(f"[\x00-\x1f{_OTHER}]")
# the same, tab (U+0009) and newline (U+000A) kept: a block of output keeps its lines
_UNSAFE_IN_LINES = re.compile(f"[\x00-\x08\x0b-\x1f{_OTHER}]")


def _code(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c <= 0xFF else f"\\u{c:04x}"


def escape(text: str, *, lines: bool = False) -> str:
    """``text`` with every unsafe character shown as its escape (``ESC`` -> ``\\x1b``).

    ``lines``: keep newlines and tabs (for a whole block of output whose line breaks
    are the CLI's own).
    """
    return (_UNSAFE_IN_LINES if lines else _UNSAFE_RX).sub(_code, text)


def cut(text: str, limit: int = LIMIT) -> str:
    """``text`` escaped; longer than ``limit``: ``'head…' (N chars)``."""
    if len(text) <= limit:
        return escape(text)
    return f"'{escape(text[:limit])}…' ({len(text):,} chars)"


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxstring = 60
_REPR.maxother = 60
for _k in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset", "maxdeque", "maxarray"):
    setattr(_REPR, _k, 8)


def shown(value: Any, limit: int = LIMIT) -> str:
    """One value as the CLI prints it: a string escaped and cut, anything else a bounded repr.

    A nested list of a million entries is shown as its first few items (``[1, 2, ...]``),
    never expanded in full.
    """
    if isinstance(value, str):
        return cut(value, limit)
    if isinstance(value, (bool, int, float)) or value is None:
        return cut(str(value), limit)
    return cut(_REPR.repr(value), limit)


def clip(text: str, limit: int = 400) -> str:
    """A whole line escaped and at most about ``limit`` characters: the middle cut out.

    The head (the command, the file) and the tail (what is wrong) are kept, so a message
    quoting a 52 MB name still says which file and why.
    """
    if len(text) <= limit:
        return escape(text)
    head, tail = (limit * 3) // 4, limit // 4
    return f"{escape(text[:head])} …[{len(text) - head - tail:,} chars cut]… {escape(text[-tail:])}"


def names_list(names: Iterable[Any], limit: int = 20) -> str:
    """Comma-separated names, each :func:`shown`; past ``limit``: ``... (N more)``."""
    names = list(names)
    head = ", ".join(shown(n) for n in names[:limit])
    return head + (f", ... ({len(names) - limit:,} more)" if len(names) > limit else "")


class SafeStream(io.TextIOBase):
    """A text stream that writes through :func:`escape` (newlines and tabs kept).

    The CLI wraps ``sys.stdout`` and ``sys.stderr`` in it for the duration of a command,
    so that no control character from data reaches the terminal even where a message
    was formatted without :func:`shown`. JSON output passes unchanged: ``json.dumps``
    already writes every such character as a ``\\u`` escape.
    """

    def __init__(self, raw: TextIO) -> None:
        super().__init__()
        self.raw = raw

    def write(self, s: str) -> int:
        """Write ``s`` to the wrapped stream through :func:`escape` (newlines and tabs kept)."""
        self.raw.write(escape(s, lines=True))
        return len(s)

    @property
    def unescaped(self) -> TextIO:
        """The wrapped stream, for the CLI's own control characters (a progress line's ``\\r``)."""
        return self.raw

    def flush(self) -> None:
        """Flush the wrapped stream."""
        self.raw.flush()

    def isatty(self) -> bool:
        """Whether the wrapped stream is a terminal."""
        return self.raw.isatty()

    def fileno(self) -> int:
        """The wrapped stream's file descriptor."""
        return self.raw.fileno()

    def writable(self) -> bool:
        """Always True."""
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        """The wrapped stream's encoding (``utf-8`` when it has none)."""
        return getattr(self.raw, "encoding", "utf-8")
