"""How dmlib writes a number as text: table cells, verdict lines and prose alike.

Every printed number goes through one of these functions, so that a value reads the same
in the CLI's tables, its verdict lines and the report's sentences:

- :func:`short`: a table cell (4 significant digits, scientific below 1e-3 and from 1e4);
- :func:`sci`: a verdict figure (3 decimals in scientific notation);
- :func:`general`: ``%g`` (a median ULP reads best without exponent);
- :func:`prose`: a number in a sentence (integers whole, else ``digits`` significant).

Missing values (None, pandas' NA, NaN) print as ``-``. pandas is never imported here:
it is consulted only when it is already loaded (it alone can have made an NA).
"""

from __future__ import annotations

import math
import sys
from typing import Any

MISSING = "-"


def missing(v: Any) -> bool:
    """True for None and pandas' NA (checked only when pandas is loaded: it made the NA)."""
    pd = sys.modules.get("pandas")
    return v is None or (pd is not None and v is pd.NA)


def short(v: float) -> str:
    """A float as a table cell: ``-`` for NaN, ``0`` for zero, 4 significant digits
    between 1e-3 and 1e4, else scientific with 3 decimals (``1.000e-17``, ``inf``)."""
    if v != v:
        return MISSING
    return f"{v:.3e}" if v and (abs(v) < 1e-3 or abs(v) >= 1e4) else f"{v:.4g}"


def sci(x: Any) -> str:
    """A verdict figure: ``-`` for None, a float with 3 decimals in scientific notation,
    anything else (an integer ULP count) as it prints."""
    if x is None:
        return MISSING
    return f"{x:.3e}" if isinstance(x, float) else str(x)


def general(x: float | None) -> str:
    """``%g`` of a number, ``-`` for None."""
    return MISSING if x is None else f"{x:g}"


def _absent(x: Any) -> bool:
    """None, NaN, pandas' NA or NaT (through ``pandas.isna`` when pandas is loaded)."""
    if x is None:
        return True
    pd = sys.modules.get("pandas")
    try:
        return bool(pd.isna(x)) if pd is not None else x != x
    except (TypeError, ValueError):  # an array, or a value pandas cannot judge
        return False


def prose(x: Any, digits: int = 3) -> str:
    """A number for prose: ``-`` for None/NaN/NA, a whole number (an int, or an integral
    float below 1e15) without decimals, ``inf``/``-inf``, else ``digits`` significant."""
    if _absent(x):
        return MISSING
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) < 1e15):
        return str(int(x))
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"
