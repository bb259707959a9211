"""Reading a capture (no torch needed): :func:`open_capture` and :class:`Capture`.

A capture folder is read only when its manifest is complete and of a known version;
every dump file it names is checked to lie inside the folder. :func:`lift_blake3` lets a
``blake3-64MiB`` capture (version 2) meet a ``blake3-tree-v1`` one; :func:`judge_heads`
compares a request's rows across two grouped-KV head layouts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np

from dmlib import dtypes as _dtypes
from dmlib import hashing
from dmlib.errors import CaptureError, DmlibError
from dmlib.localize.capture.digests import (
    tree_request,
)
from dmlib.localize.capture.format import (
    FORMAT,
    MANIFEST,
    OLD_ROOT,
    READS,
    REQUEST_PREFIX,
    TREE,
    WHOLE_KEY,
    Boundary,
    request_key,
)
from dmlib.localize.capture.rowmap import (
    RowMap,
)
from dmlib.safepaths import bounded_json, inside


def judge_heads(ba: Boundary, bb: Boundary, r: str) -> tuple[bool, str] | None:
    """Request ``r``'s rows of two boundaries whose head counts differ, in a common form.

    Rows ``(heads, head_dim)`` with ``h_a != h_b``: a side's heads may be grouped-KV
    heads repeated (``kv_repeat``); each side offers its rows as they are and, where
    repeated, collapsed to one head per group. Where some head count is offered by both
    sides, those digests decide (True/False and a note). Where the side with more heads
    was checked and holds no exact copies that collapse to the other's count, that is a
    difference (False). None: not a head-layout change (other dims differ), or the side
    with more heads was never checked for repeats.
    """
    sa, sb = ba.row_shape, bb.row_shape
    if len(sa) != 2 or len(sb) != 2 or sa[1] != sb[1] or sa[0] == sb[0]:
        return None
    if max(sa[0], sb[0]) % min(sa[0], sb[0]):
        return None
    if (ba if sa[0] > sb[0] else bb).kv_repeat is None:
        return None  # the side with more heads was not checked for repeats (an older capture)
    forms = []
    for x, h in ((ba, sa[0]), (bb, sb[0])):
        f = {h: x.requests[r].digest} if x.requests.get(r) is not None else {}
        if x.kv_repeat is not None and x.kv_repeat[0] > 1 and r in x.kv_repeat[1]:
            f[h // x.kv_repeat[0]] = x.kv_repeat[1][r].digest
        forms.append(f)
    common = sorted(set(forms[0]) & set(forms[1]))
    shapes = f"{sa[0]} heads in A, {sb[0]} in B"
    if common:
        n = common[0]
        same = forms[0][n] == forms[1][n]
        return same, f"grouped KV heads ({shapes}): compared as {n} heads, repeats collapsed"
    big = "A" if sa[0] > sb[0] else "B"
    return False, (
        f"grouped KV heads ({shapes}): {big}'s heads are not exact copies of "
        f"{min(sa[0], sb[0])} heads repeated; a difference"
    )


def lift_blake3(a: Capture, b: Capture) -> tuple[Capture, Capture]:
    """The two captures, one rebuilt so that ``blake3-64MiB`` meets ``blake3-tree-v1``.

    Where one capture holds ``blake3-tree-v1`` boundaries (version 3) and the other
    ``blake3-64MiB`` ones (version 2), the second's are read under the tree scheme:
    whole, per-index and block digests are defined alike in both; a request's digest
    is rebuilt from its blocks (:func:`tree_request`). Nothing is rehashed and the
    folder is not touched; other pairs come back as they are.
    """
    schemes = ({x.hash for x in a.boundaries}, {x.hash for x in b.boundaries})
    if TREE in schemes[0] and hashing.BLAKE3 in schemes[1]:
        return a, _lifted(b)
    if TREE in schemes[1] and hashing.BLAKE3 in schemes[0]:
        return _lifted(a), b
    return a, b


def _lifted(c: Capture) -> Capture:
    """``c`` with its ``blake3-64MiB`` boundaries restated as ``blake3-tree-v1``."""

    def tree(requests: dict[str, Any] | None) -> dict[str, Any]:
        return {
            r: v if v is None else dict(v, digest=tree_request(v["blocks"], v["n_rows"], block))
            for r, v in (requests or {}).items()
        }

    block, entries = c.block_rows, []
    for d in c.manifest["boundaries"]:
        if d.get("hash") == hashing.BLAKE3:
            d = dict(d, hash=TREE, requests=tree(d.get("requests")))
            if isinstance(d.get("kv_repeat"), dict):
                kv = d["kv_repeat"]
                d["kv_repeat"] = dict(kv, requests=tree(kv.get("requests")))
        entries.append(d)
    return Capture(c.path, dict(c.manifest, boundaries=entries))


class Capture:
    """A capture directory opened for reading (see :func:`open_capture`)."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.block_rows: int = int(manifest["block_rows"])
        batch = manifest.get("batch")
        self.row_map = (
            RowMap(manifest["row_map"], path=path, batch=batch)
            if manifest.get("row_map") is not None
            else None
        )
        self.boundaries: list[Boundary] = [
            Boundary.from_entry(i, d, path, int(manifest["version"]))
            for i, d in enumerate(manifest["boundaries"])
        ]
        if self.row_map is not None and self.row_map.batch is None:
            # captures written before the batch size was recorded: the same rule as capture
            seen = {
                b.shape[0] for b in self.boundaries if (b.row_dims or 0) >= 2 and not b.broadcast
            }
            if len(seen) == 1 and len(self.row_map) % min(seen) == 0:
                self.row_map.batch = seen.pop()
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
    def root(self) -> str:
        """The module label of the hooked model itself in this capture."""
        return str(self.manifest.get("root") or OLD_ROOT)

    @property
    def metadata(self) -> dict[str, Any]:
        """A copy of the manifest's ``metadata`` (empty when it has none)."""
        return dict(self.manifest.get("metadata") or {})

    @property
    def coverage(self) -> dict[str, Any]:
        """What the capture saw of the forward passes as a whole (``root_hooked``,
        ``arg_names``, ``not_captured``); empty for captures written before it was kept."""
        cov = self.manifest.get("coverage")
        return dict(cov) if isinstance(cov, dict) else {}

    @property
    def arg_names(self) -> dict[str, list[str]]:
        """Module label -> its forward's positional parameter names (the model's only)."""
        names = self.coverage.get("arg_names")
        if not isinstance(names, dict):
            return {}
        return {str(k): [str(n) for n in v] for k, v in names.items() if isinstance(v, list)}

    @property
    def not_captured(self) -> list[dict[str, str]]:
        """``[{what, reason}]``: what the forward produced that the capture did not record."""
        items = self.coverage.get("not_captured")
        if not isinstance(items, list):
            return []
        return [
            {"what": str(u.get("what")), "reason": str(u.get("reason"))}
            for u in items
            if isinstance(u, dict)
        ]

    @property
    def requests(self) -> dict[str, int]:
        """Request id -> number of positions, from the row map (empty without one)."""
        if self.row_map is None:
            return {}
        return {k: len(v) for k, v in self.row_map.requests.items()}

    @property
    def batch(self) -> int | None:
        """Batch size of the row map (rows of a per-sequence boundary), None if unknown."""
        return None if self.row_map is None else self.row_map.batch

    def boundary(self, name: str | Boundary) -> Boundary:
        """The boundary of that name (a Boundary is returned as it is); CaptureError if none."""
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
        what = f"boundary {b.index} ({b.name[:80]!r}): dump file"
        where = self.path / MANIFEST  # checked again here: a symlink may have changed since
        file = inside(self.path, dump.get("file"), what=what, where=where, error=CaptureError)
        from dmlib.io import load

        try:
            if dump.get("whole"):
                whole = load(file, [WHOLE_KEY])[WHOLE_KEY]
                if request is None:
                    out = whole
                else:
                    rows = b.physical_rows(whole)
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
        if tuple(out.shape) != tuple(expected) or out.dtype != _dtypes.from_label(b.dtype):
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
                    "hash": b.hash,
                    "digest": b.digest,
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
        text = mf.read_text()
    except UnicodeDecodeError as err:
        raise CaptureError(f"{MANIFEST} is not valid JSON ({err})", path=path) from None
    manifest = bounded_json(text, where=mf, error=CaptureError)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CaptureError(f"{MANIFEST} is not a {FORMAT} manifest", path=path)
    if manifest.get("version") not in READS or type(manifest.get("version")) is not int:
        raise CaptureError(
            f"capture version {manifest.get('version')!r}; this dmlib reads versions "
            f"{', '.join(map(str, READS))}",
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
    batch = manifest.get("batch")
    if batch is not None and (type(batch) is not int or batch < 1):
        raise CaptureError(f"batch is {batch!r}; expected a positive integer or null", path=path)
    dump_files(path, manifest)  # every dump path relative and inside the capture
    return Capture(path, manifest)


def dump_files(path: Path, manifest: dict[str, Any]) -> list[Path]:
    """The dump files a manifest names, each checked to be a relative path inside ``path``.

    Raises
    ------
    CaptureError
        Naming the manifest and the boundary: a dump ``file`` that is absolute, leads out
        through ``..`` or a symlink, or is not a string.
    """
    files: list[Path] = []
    boundaries = manifest.get("boundaries")
    for i, b in enumerate(boundaries if isinstance(boundaries, list) else []):
        dump = b.get("dump") if isinstance(b, dict) else None
        if not dump:
            continue
        what = f"boundary {i} ({str(b.get('name'))[:80]!r}): dump file"
        rel = dump.get("file") if isinstance(dump, dict) else None
        files.append(inside(path, rel, what=what, where=path / MANIFEST, error=CaptureError))
    return list(dict.fromkeys(files))
