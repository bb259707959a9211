"""Row maps: which logical request, at which position, each physical row of a batch holds.

A capture hashes a boundary per request by its row map, so that two runs that place the
same request at different physical rows (alone, padded, packed with others) compare.
"""

from __future__ import annotations

import collections
import json
import operator
import os
import threading
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from dmlib.errors import CaptureError
from dmlib.localize.capture import jsonenc
from dmlib.localize.capture.format import (
    request_key,
)


def _is_entry(e: list[Any]) -> bool:
    """Whether ``e`` is one ``[request, position]`` entry (as JSON writes a pair), not a batch row."""
    return len(e) == 2 and not isinstance(e[0], (list, tuple)) and isinstance(e[1], int)


class RowMap:
    """Physical row -> (request id, position) or None for padding.

    Parameters
    ----------
    entries
        One entry per physical row of the boundary tensors' leading dimensions
        flattened (batch x sequence, say): ``(request_id, position)`` or ``None``.
        A list of lists (one list per batch row, all of one length) gives the same
        entries and also the batch size, so per-sequence boundaries (one row per batch
        row: a pooled representation, a classifier's logits) are attributed to the
        request that fills each batch row. With a flat list the batch size is read from
        the boundaries themselves (``[batch, seq, ...]`` tensors).
    """

    def __init__(
        self,
        entries: Sequence[Any],
        *,
        path: str | os.PathLike[str] | None = None,
        batch: int | None = None,
    ) -> None:
        entries = list(entries)
        if entries and all(isinstance(e, list) and (not e or not _is_entry(e)) for e in entries):
            lengths = {len(e) for e in entries}
            if len(lengths) != 1:
                raise CaptureError(
                    f"row map batch rows have lengths {sorted(lengths)}; every batch row must "
                    "list one entry per sequence position",
                    path=path,
                )
            batch = len(entries)
            entries = [e for row in entries for e in row]
        self.batch: int | None = None if batch is None else int(batch)
        if self.batch is not None and (self.batch < 1 or len(entries) % self.batch):
            raise CaptureError(
                f"batch size {batch} does not divide the row map's {len(entries)} rows", path=path
            )
        self.entries: list[tuple[str, int] | None] = []
        append = self.entries.append
        # request -> (positions, physical rows), in the order the entries give them
        rows: dict[str, tuple[list[int], list[int]]] = {}
        for i, e in enumerate(entries):
            if e is None:
                append(None)
                continue
            try:
                rid, pos = e
                if type(pos) is not int:
                    pos = int(pos)
            except (TypeError, ValueError):
                raise CaptureError(
                    f"row map entry {i} is {e!r}; expected (request_id, position) or None",
                    path=path,
                ) from None
            if pos < 0:
                raise CaptureError(f"row map entry {i} has negative position {pos}", path=path)
            key = rid if type(rid) is str else request_key(rid)  # (a str is its own key)
            append((key, pos))
            mine = rows.get(key)
            if mine is None:
                mine = rows[key] = ([], [])
            mine[0].append(pos)
            mine[1].append(i)
        self.requests: dict[str, np.ndarray] = {}
        for key, (positions, idx) in rows.items():
            if positions != list(range(len(positions))):  # not in position order: sorted
                pairs = sorted(zip(positions, idx, strict=True))
                positions, idx = [p for p, _ in pairs], [i for _, i in pairs]
                if positions != list(range(len(positions))):
                    raise CaptureError(
                        f"request {key!r} has positions {positions[:8]}...; expected 0..n-1, "
                        "each once",
                        path=path,
                    )
            self.requests[key] = np.array(idx, dtype=np.int64)
        # requests whose rows are consecutive physical rows: (start, stop), read as views
        self.spans: dict[str, tuple[int, int]] = {
            k: (int(v[0]), int(v[-1]) + 1)
            for k, v in self.requests.items()
            if len(v) and int(v[-1]) - int(v[0]) == len(v) - 1
        }
        self._batch0 = self.batch  # what a copy starts from (a capture may learn the batch)
        # what is worked out from the entries alone (its JSON text, KV-cache row plans):
        # one dict shared by every copy of this row map
        self._memo: dict[Any, Any] = {}

    @classmethod
    def shared(
        cls, entries: Sequence[Any], *, path: str | os.PathLike[str] | None = None
    ) -> RowMap:
        """``RowMap(entries)``; where one of the last few row maps built this way had equal
        entries (a repeat capture, the same layout again), a copy of it that shares what
        was worked out from them instead of working it out anew.

        Only entries of exactly these types are shared (two lists that compare equal then
        make the same row map): None, or a ``(request, position)`` tuple with a ``str`` or
        ``int`` request and an ``int`` position; flat, or one list of them per batch row.
        """
        entries = list(entries)
        key = _shared_key(entries)
        if key is None:
            return cls(entries, path=path)
        with _SHARED_LOCK:
            hit = _SHARED.get(key)
            if hit is not None:
                _SHARED.move_to_end(key)
                return hit._copy()
        made = cls(entries, path=path)
        with _SHARED_LOCK:
            _SHARED[key] = made
            while len(_SHARED) > _SHARED_MAX:
                _SHARED.popitem(last=False)
        return made._copy()

    def _copy(self) -> RowMap:
        """This row map, its batch size as built, everything else shared (never changed)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.batch = self._batch0
        return new

    def sequence_row(self, request: str, batch: int | None = None) -> tuple[int | None, str]:
        """The batch row that request ``request`` alone fills, or (None, why not).

        A per-sequence boundary (one row per batch row) can be attributed to a request
        only when all of the request's positions lie in one batch row and no other
        request has positions in that row.
        """
        batch = self.batch if batch is None else batch
        if batch is None:
            return None, "batch size unknown (no [batch, seq, ...] boundary; pass a nested row_map)"
        seq = len(self.entries) // batch
        idx = self.requests[request]
        rows = sorted({int(i) // seq for i in idx})
        if len(rows) != 1:
            return None, f"request {request!r} spans batch rows {rows[:6]}"
        b = rows[0]
        others = sorted(
            {e[0] for e in self.entries[b * seq : (b + 1) * seq] if e is not None} - {request}
        )
        if others:
            return None, f"batch row {b} also holds request(s) {others[:6]}: its one row mixes them"
        return b, ""

    def __len__(self) -> int:
        return len(self.entries)

    def row_dims(self, shape: Sequence[int]) -> int | None:
        """How many leading dims of ``shape`` flatten to one row per entry (None: no match)."""
        n = 1
        for k, d in enumerate(shape, start=1):
            n *= int(d)
            if n == len(self.entries):
                return k
            if n > len(self.entries):
                return None
        return None

    def to_json(self) -> list[list[Any] | None]:
        """The entries as the manifest stores them: ``[request, position]``, None for padding."""
        return [None if e is None else [e[0], e[1]] for e in self.entries]

    def json_text(self) -> str:
        """:meth:`to_json` as compact JSON text (what ``json.dumps(..., separators=(",",
        ":"))`` writes), made once: a capture writes it into every manifest it writes."""
        text = self._memo.get("json")
        if text is None:  # (the entries' tuples are written as the lists to_json() makes)
            text = jsonenc.compact(self.entries)
        if text is None:  # not compiled
            keys = {k: json.dumps(k) for k in self.requests}  # each request id encoded once
            text = "[" + ",".join(
                "null" if e is None else f"[{keys[e[0]]},{e[1]}]" for e in self.entries
            ) + "]"  # fmt: skip
        self._memo["json"] = text
        return cast(str, text)


_SHARED: collections.OrderedDict[tuple[Any, ...], RowMap] = collections.OrderedDict()


_SHARED_MAX = 8  # row maps kept for RowMap.shared (a few layouts captured in turn)


_SHARED_LOCK = threading.Lock()


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _shared_key(entries: list[Any]) -> tuple[Any, ...] | None:
    """A hashable key of ``entries``, equal for two lists only when they make the same row
    map; None where an entry is of another type (not shared)."""
    if not entries:
        return None
    nested = type(entries[0]) is list
    rows = entries if nested else [entries]
    if nested and any(type(r) is not list for r in rows):
        return None
    for row in rows:  # (each check one pass in C: map and set)
        pairs = [e for e in row if e is not None]
        if not pairs:
            continue
        if set(map(type, pairs)) != {tuple} or set(map(len, pairs)) != {2}:
            return None
        if set(map(type, map(_SECOND, pairs))) != {int}:
            return None
        if not set(map(type, map(_FIRST, pairs))) <= {str, int}:
            return None
    # the entries' JSON text where the compiled writer makes it: one string, hashed once and
    # compared by memcmp (a tuple of 400 pairs is hashed anew at every lookup); for entries
    # of these exact types, equal texts are equal entries, nested or flat alike
    text = jsonenc.compact(entries)
    if text is not None:
        return (text,)
    return (nested, tuple(map(tuple, rows)) if nested else tuple(entries))
