"""One file described: format, layout, records, tensors with their hashes, padding.

What ``dmlib inspect`` prints, as data.
"""

from __future__ import annotations

import os
from typing import Any

from dmlib.hashing import hash_bytes, new_hasher
from dmlib.io import open_tensors
from dmlib.padding import padding_census

__all__ = ["describe"]


def describe(
    path: str | os.PathLike[str], *, format: str | None = None, hashes: bool = True
) -> dict[str, Any]:
    """Everything ``dmlib inspect`` shows about one file, as one dict.

    Parameters
    ----------
    path
        A checkpoint file (any format :func:`dmlib.open_tensors` reads).
    format
        Skip detection and read as this format.
    hashes
        SHA-256 of each tensor, each record, all tensor bytes and the whole file (one
        pass over the tensor bytes); False leaves them None.

    Returns
    -------
    dict
        ``path``, ``format``, ``layout``, ``metadata``, ``scalars``, ``n_tensors``,
        ``numel``, ``file_hash``, ``data_hash``, ``records`` (one dict per burnpack
        record), ``tensors`` (one dict per tensor in disk order, keys as in
        ``TensorSet.table()`` plus ``data_hash``) and, for burnpack files, ``padding``
        (:func:`dmlib.padding_census` as lists of rows). :func:`dmlib._json.jsonable`
        makes it JSON.
    """
    with open_tensors(path, format=format) as ts:
        # one pass over the tensor bytes feeds every hash: per tensor, per record, whole data
        whole = new_hasher()
        per_record = {r.index: new_hasher() for r in ts.records}
        tensors = []
        for t in ts.disk_order():
            digest = None
            if hashes:
                raw = t.raw()
                digest = hash_bytes(raw)
                whole.update(raw.data)
                if t.record in per_record:
                    per_record[t.record].update(raw.data)
            tensors.append({**t.describe(), "data_hash": digest})
        doc: dict[str, Any] = {
            "path": ts.path,
            "format": ts.format,
            "layout": ts.layout,
            "metadata": ts.metadata,
            "scalars": ts.scalars,
            "n_tensors": len(ts),
            "numel": ts.numel,
            "file_hash": ts.file_hash() if hashes else None,
            "data_hash": whole.hexdigest() if hashes else None,
            "records": [
                {
                    "record": r.index,
                    "start": r.start,
                    "end": r.end,
                    "data_base": r.data_base,
                    "layout": r.layout["layout"],
                    "n_tensors": len(r),
                    "data_hash": per_record[r.index].hexdigest() if hashes else None,
                }
                for r in ts.records
            ],
            "tensors": tensors,
        }
        if ts.format == "burnpack":
            c = padding_census(ts)
            doc["padding"] = {
                "gaps": c.gaps.to_dict(orient="records"),
                "slots": c.slots.to_dict(orient="records"),
            }
    return doc
