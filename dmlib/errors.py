"""One exception hierarchy for everything dmlib refuses.

Every message names the file (and the tensor, where there is one), says what was
found and what would have been valid. The CLI prints ``str(err)`` as one line and
exits 2.
"""

from __future__ import annotations

import os
import re

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_ONE_LINE = re.compile(r"\s*[\r\n]+\s*")


class DmlibError(Exception):
    """Base class of every error dmlib raises on purpose.

    Parameters
    ----------
    message
        What is wrong, in one sentence.
    path
        The file (or directory) concerned; it is prefixed to the message.
    """

    def __init__(self, message: str, *, path: str | os.PathLike[str] | None = None) -> None:
        self.path = None if path is None else os.fspath(path)
        # one line, always: the CLI prints str(err) as one line, and messages quoting a
        # library's own error (torch's are paragraphs) must not break that
        message = _ONE_LINE.sub(" ", _ANSI.sub("", str(message))).strip()
        self.message = message
        super().__init__(f"{self.path}: {message}" if self.path is not None else message)

    def __str__(self) -> str:  # KeyError would otherwise repr() the message
        return self.args[0] if self.args else ""


class FormatError(DmlibError, ValueError):
    """The file is not a valid instance of the format it claims (or was asked) to be."""


class TruncatedError(FormatError):
    """The file ends before a structure it declares."""


class LayoutError(FormatError):
    """Tensor offsets are inconsistent: overlap, out of bounds, wrong length, unsolvable base."""


class UnsafePickleError(FormatError):
    """A pickle names a global, an opcode or a call outside its reader's table, or asks for
    unbounded work (nesting, shared references): refused before anything is built from it."""


class NotTensorsError(FormatError):
    """The file holds something other than tensors (a pickled settings object...): named, not read."""


class UnsupportedError(DmlibError, ValueError):
    """A valid file using something dmlib does not support (version, dtype, format)."""


class UnknownFormatError(UnsupportedError):
    """No reader recognises the file."""


class TensorNotFoundError(DmlibError, KeyError):
    """A tensor name that the file does not hold; also a ``KeyError`` so ``.get`` works."""


class MissingDependencyError(DmlibError, ImportError):
    """An optional dependency is needed; the message names the extra to install."""


class CaptureError(DmlibError):
    """A capture directory is missing, incomplete or inconsistent."""


__all__ = [
    "CaptureError",
    "DmlibError",
    "FormatError",
    "LayoutError",
    "MissingDependencyError",
    "NotTensorsError",
    "TensorNotFoundError",
    "TruncatedError",
    "UnknownFormatError",
    "UnsafePickleError",
    "UnsupportedError",
]
