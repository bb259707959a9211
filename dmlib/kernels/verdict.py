"""What every typed verdict shares: read-only mapping access over ``to_dict()``.

A verdict (:class:`dmlib.stats.verdicts.Summary`, :class:`dmlib.stats.verdicts.MatrixVerdict`,
:class:`dmlib.localize.boundaries.CaptureVerdict`) is a frozen dataclass whose ``bool()``
says identical / passed, whose ``str()`` is the verdict as the command line prints it, and
whose ``to_dict()`` is the plain dict its JSON holds. It stays a read-only mapping of that
dict, so ``v["identical"]``, ``v.get("rounded")``, ``dict(v)`` and ``v == {...}`` work as
they did on the dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from dmlib.numfmt import MISSING, short
from dmlib.textsafe import shown

__all__ = ["Verdict", "cell"]


class Verdict(Mapping):
    """Mapping access over a dataclass's public fields (those not starting with ``_``)."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        """The verdict as a plain dict (its public fields, in declaration order)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)  # type: ignore[arg-type]
            if not f.name.startswith("_")
        }

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.to_dict()!r})"


def cell(v: Any) -> str:
    """A number as a verdict line shows it: ``-`` for None, a float as a table cell
    (:func:`dmlib.numfmt.short`); anything else escaped and cut (``textsafe.shown``)."""
    if v is None:
        return MISSING
    return short(v) if isinstance(v, float) else shown(v)
