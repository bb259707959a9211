"""The capture directory format, its hashing rule and its reader (no torch needed).

A capture is a directory::

    manifest.json            written last; "complete": true once the run finished
    tensors/00012.safetensors  full tensors of the boundaries selected for dumping

``manifest.json`` lists the boundaries (a tensor entering or leaving a named module) in
execution order with dtype, shape, the SHA-256 of the whole physical tensor and, when
the tensor's leading dimensions match the row map, per logical request: the SHA-256 of
the request's rows in position order and of each block of ``block_rows`` positions.
Hashing per logical request makes the hashes comparable between layouts that place the
same request at different physical rows (alone, padded, packed with others).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from dmlib import dtypes as _dtypes  # noqa: F401  (registers bfloat16/float8 names)
from dmlib.errors import CaptureError, DmlibError
from dmlib.hashing import hash_bytes

FORMAT = "dmlib-capture"
VERSION = 1
MANIFEST = "manifest.json"
TENSOR_DIR = "tensors"
WHOLE_KEY = "tensor"  # safetensors key of a whole physical tensor
REQUEST_PREFIX = "request:"  # safetensors key prefix of one request's rows


def request_key(request: Any) -> str:
    """Request ids are kept as strings (JSON object keys); ``3`` and ``"3"`` are one request."""
    return str(request)


def request_hashes(rows: np.ndarray, block_rows: int) -> tuple[str, list[str]]:
    """SHA-256 of a request's rows (position order) and of each block of ``block_rows`` rows.

    ``rows`` has one leading entry per position; a block's bytes are those positions'
    C-order bytes, so the hash does not depend on where the rows sat physically.
    """
    rows = np.ascontiguousarray(rows)
    flat = (
        rows.reshape(rows.shape[0], -1).view(np.uint8)
        if rows.size
        else rows.reshape(rows.shape[0], 0)
    )
    blocks = [hash_bytes(flat[i : i + block_rows]) for i in range(0, rows.shape[0], block_rows)]
    return hash_bytes(flat), blocks


class RowMap:
    """Physical row -> (request id, position) or None for padding.

    Parameters
    ----------
    entries
        One entry per physical row of the boundary tensors' leading dimensions
        flattened (batch x sequence, say): ``(request_id, position)`` or ``None``.
    """

    def __init__(
        self, entries: Sequence[Any], *, path: str | os.PathLike[str] | None = None
    ) -> None:
        self.entries: list[tuple[str, int] | None] = []
        rows: dict[str, list[tuple[int, int]]] = {}
        for i, e in enumerate(entries):
            if e is None:
                self.entries.append(None)
                continue
            try:
                rid, pos = e
                pos = int(pos)
            except (TypeError, ValueError):
                raise CaptureError(
                    f"row map entry {i} is {e!r}; expected (request_id, position) or None",
                    path=path,
                ) from None
            if pos < 0:
                raise CaptureError(f"row map entry {i} has negative position {pos}", path=path)
            key = request_key(rid)
            self.entries.append((key, pos))
            rows.setdefault(key, []).append((pos, i))
        self.requests: dict[str, np.ndarray] = {}
        for key, pairs in rows.items():
            pairs.sort()
            positions = [p for p, _ in pairs]
            if positions != list(range(len(positions))):
                raise CaptureError(
                    f"request {key!r} has positions {positions[:8]}...; expected 0..n-1, each once",
                    path=path,
                )
            self.requests[key] = np.array([i for _, i in pairs], dtype=np.int64)

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
        return [None if e is None else [e[0], e[1]] for e in self.entries]


@dataclass(frozen=True)
class RequestHash:
    sha256: str
    n_rows: int
    blocks: list[str]


@dataclass(frozen=True)
class Boundary:
    """One recorded tensor: what entered (``kind='input'``) or left a module call."""

    index: int
    name: str
    module: str
    call: int
    kind: str
    slot: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str
    row_dims: int | None
    requests: dict[str, RequestHash] = field(default_factory=dict)
    dump: dict[str, Any] | None = None

    @property
    def row_mapped(self) -> bool:
        return self.row_dims is not None

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row (the dims after the row-mapped leading ones)."""
        return self.shape[self.row_dims :] if self.row_dims is not None else self.shape


def _boundary(i: int, d: dict[str, Any], path: Path) -> Boundary:
    try:
        return Boundary(
            index=i,
            name=str(d["name"]),
            module=str(d["module"]),
            call=int(d["call"]),
            kind=str(d["kind"]),
            slot=str(d["slot"]),
            dtype=str(d["dtype"]),
            shape=tuple(int(s) for s in d["shape"]),
            sha256=str(d["sha256"]),
            row_dims=None if d.get("row_dims") is None else int(d["row_dims"]),
            requests={
                k: RequestHash(str(v["sha256"]), int(v["n_rows"]), [str(b) for b in v["blocks"]])
                for k, v in (d.get("requests") or {}).items()
            },
            dump=d.get("dump"),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CaptureError(
            f"boundary {i} of {MANIFEST} is malformed ({err!r})", path=path
        ) from None


class Capture:
    """A capture directory opened for reading (see :func:`open_capture`)."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.block_rows: int = int(manifest["block_rows"])
        self.row_map = (
            RowMap(manifest["row_map"], path=path) if manifest.get("row_map") is not None else None
        )
        self.boundaries: list[Boundary] = [
            _boundary(i, d, path) for i, d in enumerate(manifest["boundaries"])
        ]
        self._by_name = {b.name: b for b in self.boundaries}
        if len(self._by_name) != len(self.boundaries):
            raise CaptureError("boundary names repeat in the manifest", path=path)

    def __repr__(self) -> str:
        return f"Capture({str(self.path)!r}, {len(self.boundaries)} boundaries, requests={self.requests})"

    def __len__(self) -> int:
        return len(self.boundaries)

    def __iter__(self) -> Iterator[Boundary]:
        return iter(self.boundaries)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self.manifest.get("metadata") or {})

    @property
    def requests(self) -> dict[str, int]:
        """Request id -> number of positions, from the row map (empty without one)."""
        if self.row_map is None:
            return {}
        return {k: len(v) for k, v in self.row_map.requests.items()}

    def boundary(self, name: str | Boundary) -> Boundary:
        if isinstance(name, Boundary):
            return name
        try:
            return self._by_name[name]
        except KeyError:
            raise CaptureError(
                f"no boundary {name!r}; the capture has {len(self.boundaries)} boundaries, "
                f"e.g. {[b.name for b in self.boundaries[:4]]}",
                path=self.path,
            ) from None

    def block_hashes(self, boundary: str | Boundary, request: Any) -> list[str]:
        b = self.boundary(boundary)
        rh = b.requests.get(request_key(request))
        if rh is None:
            raise CaptureError(
                f"boundary {b.name!r} has no rows of request {request!r}", path=self.path
            )
        return list(rh.blocks)

    def dumped(self, boundary: str | Boundary, request: Any = None) -> bool:
        """Whether :meth:`tensor` can return this boundary (for this request)."""
        b = self.boundary(boundary)
        if not b.dump:
            return False
        if b.dump.get("whole"):
            return request is None or (b.row_mapped and request_key(request) in b.requests)
        return request is not None and request_key(request) in b.dump.get("requests", [])

    def tensor(self, boundary: str | Boundary, request: Any = None) -> np.ndarray:
        """The dumped tensor; with ``request``, that request's rows in position order.

        Returns a read-only array of shape ``(n_positions, *row_shape)`` for a request,
        else the whole physical tensor.
        """
        b = self.boundary(boundary)
        if not self.dumped(b, request):
            what = "whole" if request is None else f"request {request!r}"
            raise CaptureError(
                f"boundary {b.name!r} was not dumped ({what}); capture hashes only. "
                "Re-run the capture with dump= matching it",
                path=self.path,
            )
        dump = cast(dict[str, Any], b.dump)  # dumped() checked it
        file = self.path / dump["file"]
        from dmlib.io import load

        try:
            if dump.get("whole"):
                whole = load(file, [WHOLE_KEY])[WHOLE_KEY]
                if request is None:
                    out = whole
                else:
                    rows = whole.reshape((-1, *b.row_shape))
                    out = rows[cast(RowMap, self.row_map).requests[request_key(request)]]
            else:
                key = REQUEST_PREFIX + request_key(request)
                out = load(file, [key])[key]
        except DmlibError as err:
            raise CaptureError(
                f"dumped tensor of boundary {b.name!r} is unreadable: {err}", path=self.path
            ) from None
        out = np.array(out, copy=True) if not out.flags.c_contiguous else out
        out.flags.writeable = False
        expected = (
            b.shape if request is None else (self.requests[request_key(request)], *b.row_shape)
        )
        if tuple(out.shape) != tuple(expected) or out.dtype != np.dtype(b.dtype):
            raise CaptureError(
                f"dumped tensor of {b.name!r} is {out.dtype}{list(out.shape)}; the manifest says "
                f"{b.dtype}{list(expected)}",
                path=file,
            )
        return out

    def table(self):
        """One row per boundary: name, module, kind, dtype, shape, row_mapped, dumped."""
        import pandas as pd

        return pd.DataFrame(
            [
                {
                    "boundary": b.name,
                    "module": b.module,
                    "kind": b.kind,
                    "dtype": b.dtype,
                    "shape": list(b.shape),
                    "row_mapped": b.row_mapped,
                    "dumped": bool(b.dump),
                    "sha256": b.sha256,
                }
                for b in self.boundaries
            ]
        )


def open_capture(path: str | os.PathLike[str] | Capture) -> Capture:
    """Open a capture directory written by :func:`dmlib.capture` (a Capture is returned as is).

    A Capture holds no open file (dumped tensors are read when asked), so there is
    nothing to close.

    Raises
    ------
    CaptureError
        The directory or its manifest is missing, the capture did not finish (interrupted
        run), or the manifest is not a dmlib capture of a known version.
    """
    if isinstance(path, Capture):
        return path
    path = Path(path)
    if not path.is_dir():
        raise CaptureError(
            "not a directory; expected a capture directory holding manifest.json", path=path
        )
    mf = path / MANIFEST
    if not mf.is_file():
        raise CaptureError(
            f"no {MANIFEST}: the capture never finished or this is not a capture", path=path
        )
    try:
        manifest = json.loads(mf.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CaptureError(f"{MANIFEST} is not valid JSON ({err})", path=path) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CaptureError(f"{MANIFEST} is not a {FORMAT} manifest", path=path)
    if manifest.get("version") != VERSION:
        raise CaptureError(
            f"capture version {manifest.get('version')!r}; this dmlib reads version {VERSION}",
            path=path,
        )
    if manifest.get("complete") is not True:
        why = manifest.get("error") or "the run was interrupted before the capture finished"
        raise CaptureError(f"incomplete capture: {why}", path=path)
    for key in ("block_rows", "boundaries"):
        if key not in manifest:
            raise CaptureError(f"{MANIFEST} lacks {key!r}", path=path)
    if not isinstance(manifest["block_rows"], int) or manifest["block_rows"] < 1:
        raise CaptureError(
            f"block_rows is {manifest['block_rows']!r}; expected a positive integer", path=path
        )
    return Capture(path, manifest)


def n_blocks(n_rows: int, block_rows: int) -> int:
    return math.ceil(n_rows / block_rows)


__all__ = ["Boundary", "Capture", "RowMap", "open_capture", "request_hashes", "FORMAT", "VERSION"]
