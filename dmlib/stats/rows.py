"""What a comparison's rows and attrs are made of, shared by the plain comparison
(:mod:`dmlib.stats.compare`) and the mapped one (:mod:`dmlib.stats.mapped`): the result as
records or a DataFrame, the per-tensor hashes collected, a float pair rounded to the
narrower dtype, the scalars and metadata compared. Both import it; neither imports the
other but ``compare`` -> ``mapped`` (the ``mapping=`` path).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dmlib.kernels.pair import NULLABLE_INT
from dmlib.sources import Patterns


def rows_out(
    rows: list[dict[str, Any]], attrs: dict[str, Any], columns: list[str], *, frame: bool
) -> Any:
    """A comparison's result: ``(records, attrs)`` without pandas (what the command line
    prints), else a DataFrame of ``columns`` with the nullable integer columns typed and
    ``attrs`` attached."""
    if not frame:
        return [{c: r.get(c) for c in columns} for r in rows], attrs
    import pandas as pd

    df = pd.DataFrame(rows, columns=columns)
    for col in NULLABLE_INT:
        df[col] = df[col].astype("UInt64" if col == "max_ulp" else "Int64")
    df.attrs.update(attrs)
    return df


def collect_data_hashes(rows: list[dict[str, Any]]) -> None:
    """Replace each row's pending per-tensor hashes by ``data_hash_a``/``_b``."""
    for row in rows:
        fa, fb = row.pop("_hashes")
        row["data_hash_a"] = None if fa is None else fa.result()  # None: no hash asked for
        row["data_hash_b"] = row["data_hash_a"] if fb is None else fb.result()


def dtype_label(t: Any) -> str:
    """A tensor's dtype as a comparison's records name it (``bfloat16``, ``qint8``...)."""
    return t.dtype_label


ROUNDING = "round to nearest, ties to even"


def rounded_pair(ta: Any, tb: Any) -> tuple[Any, Any, dict[str, Any]] | None:
    """(a, b, record) with the wider float side rounded to the narrower dtype, else None."""
    from dmlib.dtypes import is_float
    from dmlib.tensor import Tensor

    if ta.quantized or tb.quantized or ta.shape != tb.shape:
        return None
    if not (is_float(ta.dtype) and is_float(tb.dtype)) or ta.dtype.itemsize == tb.dtype.itemsize:
        return None
    wide, narrow, side = (ta, tb, "a") if ta.dtype.itemsize > tb.dtype.itemsize else (tb, ta, "b")
    with np.errstate(over="ignore", invalid="ignore"):
        arr = np.ascontiguousarray(wide.load().astype(narrow.dtype))
    t = Tensor(wide.name, arr.dtype, arr.shape, nbytes=arr.nbytes, source=arr)
    record = {
        "name": wide.name,
        "rounded": side,
        "from": dtype_label(wide),
        "to": dtype_label(narrow),
        "rounding": ROUNDING,
    }
    return (t, tb, record) if side == "a" else (ta, t, record)


# The recorded step (a torch checkpoint's "step", the step an Orbax or Trainer reader reads
# from the folder): held by one side only it is no value left uncompared (a safetensors or
# npz export records none; ladders check steps on their own, forensics.ladder.check_steps).
# Held by both and different, it is a difference like any scalar.
STEP_KEY = "step"


def scalar_attrs(
    da: dict[str, Any], db: dict[str, Any], include: Patterns, exclude: Patterns
) -> dict[str, Any]:
    """The scalars under the same name selection as the tensors: ``scalars_diff`` (held by
    both sides, values differ: a difference), ``scalars_only_in_a``/``_b`` (held by one side:
    listed, like a file's metadata, and not a difference of values), ``scalar_names``."""
    from dmlib.sources import name_filter

    keep = name_filter(include, exclude)
    a = {k: v for k, v in da.items() if keep(k)}
    b = {k: v for k, v in db.items() if keep(k)}
    return {
        "scalars_diff": {k: [a[k], b[k]] for k in a if k in b and not _same_scalar(a[k], b[k])},
        "scalars_only_in_a": [k for k in a if k not in b and k != STEP_KEY],
        "scalars_only_in_b": [k for k in b if k not in a and k != STEP_KEY],
        "scalar_names": list(dict.fromkeys([*a, *b])),
    }


def _same_scalar(x: Any, y: Any) -> bool:
    """Equal values (a bool never equals a number: True vs 1 differ; NaN equals NaN)."""
    if isinstance(x, bool) != isinstance(y, bool):
        return False
    try:
        if x != x and y != y:  # NaN on both sides (of any float type)
            return True
        return bool(x == y)
    except (TypeError, ValueError):  # values that do not compare (arrays): by their repr
        return repr(x) == repr(y)


def dict_diff(da: dict, db: dict) -> dict[str, list[Any]]:
    """Key -> ``[value in a, value in b]`` for every key whose values differ or that one side
    lacks (None there); a's keys first, in order, then b's others.
    """
    keys = list(da) + [k for k in db if k not in da]
    return {
        k: [da.get(k), db.get(k)] for k in keys if da.get(k) != db.get(k) or (k in da) != (k in db)
    }
