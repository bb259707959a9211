"""The one JSON rule: what dmlib returns, as plain JSON types.

JSON has no NaN and no infinity. Everywhere dmlib writes JSON (the CLI's ``--json``, the
numbers a report records, ``dmlib inspect``) a missing or undefined value (None, pandas
NA, NaN) becomes ``null`` and an infinity the string ``"inf"`` / ``"-inf"``: an infinite
``rel_fro`` is a finding, not a missing number, so it must not read as one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from dmlib.errors import DmlibError

__all__ = ["jsonable"]


def jsonable(
    value: Any, *, default: Callable[[Any], Any] | None = None, what: str = "value"
) -> Any:
    """Plain JSON types (dict, list, str, int, float, bool, None) for ``value``.

    Parameters
    ----------
    value
        Numbers, strings, numpy/pandas scalars and arrays, DataFrames (a list of row
        dicts), dicts, lists and tuples, nested.
    default
        Applied to anything else (``str`` shows it as text); None raises.
    what
        Names the value in the error message.

    Examples
    --------
    >>> jsonable({"a": float("nan"), "b": np.float32("inf"), "c": np.arange(2)})
    {'a': None, 'b': 'inf', 'c': [0, 1]}
    """
    if value is None or isinstance(value, (bool, str)):
        return value
    # pandas only when loaded: a DataFrame or NA here means someone imported it (the
    # command line's compare never does)
    pd = sys.modules.get("pandas")
    if pd is not None and isinstance(value, pd.DataFrame):
        return [jsonable(r, default=default, what=what) for r in value.to_dict("records")]
    if isinstance(value, (dict, Mapping)):  # a typed verdict is a read-only Mapping
        return {str(k): jsonable(v, default=default, what=what) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v, default=default, what=what) for v in value]
    if pd is not None and (value is pd.NA or value is pd.NaT):
        return None
    if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0:
        value = value.item()  # numpy scalars -> Python scalars (NaT -> None)
        if value is None or isinstance(value, (bool, str)):
            return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, np.ndarray) or (
        pd is not None and isinstance(value, (pd.Series, pd.Index))
    ):
        return jsonable(value.tolist(), default=default, what=what)
    if pd is not None:
        try:  # other NA-likes
            if pd.isna(value):
                return None
        except (TypeError, ValueError):
            pass
    if default is not None:
        return default(value)
    raise DmlibError(
        f"{what}: cannot store a {type(value).__name__} as JSON; "
        "pass a number, string, list or dict"
    )
