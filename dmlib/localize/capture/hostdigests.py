"""A boundary's digests: host tensors in one compiled call on their own memory where it can
(else the Python loops of :mod:`dmlib.localize.capture.digests`), device tensors where
they live; grouped-KV heads repeated are detected and their collapsed digests recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np

from dmlib import hashing
from dmlib.localize.capture import treehash
from dmlib.localize.capture.digests import (
    TREE_TAGS,
    _device_checksums,
    _repeat_groups,
    digest_hex,
    request_hashes,
    tree_request,
)
from dmlib.localize.capture.rowmap import (
    RowMap,
)
from dmlib.localize.capture.tensors import torch  # (None where torch is not installed)
from dmlib.localize.capture.treehash import request_blocks
from dmlib.localize.capture.writer import ManifestWriter

_PERMS: dict[tuple[int, tuple[int, int]], tuple[int, ...]] = {}  # (ndim, row axes) -> order


def _axes_first(ndim: int, axes: tuple[int, int]) -> tuple[int, ...]:
    """The transpose that moves ``axes`` to the front, the other axes after them in order
    (``np.moveaxis(x, axes, (0, 1))``), worked out once per (ndim, axes)."""
    order = _PERMS.get((ndim, axes))
    if order is None:
        order = _PERMS[(ndim, axes)] = (*axes, *(i for i in range(ndim) if i not in axes))
    return order


class HostDigests(ManifestWriter):
    """Every digest of a boundary: on the host (in one compiled call where it can) or where
    a device tensor lives; the part of :class:`Recorder` that hashes."""

    # set by Recorder.__init__
    device_hash: bool
    _leaf: Callable[[memoryview], str]
    _tree_args: tuple[Any, bytes, int, int]
    _plan: list[tuple[str, np.ndarray, tuple[int, int] | None]] | None
    _spans: dict[str, tuple[int, int]] | None
    _span_list: list[tuple[str, int, int]] | None
    _gathered: list[tuple[str, np.ndarray]]

    def _row_set_digests(
        self, flat: np.ndarray, row_sets: dict[str, list[int]]
    ) -> dict[str, dict[str, Any]]:
        """Per-request digests of the rows ``row_sets[r]`` (in order) of a 2-d contiguous
        array: consecutive rows in one compiled call where it is built, others gathered."""
        spans = {r: (i[0], len(i)) for r, i in row_sets.items()
                 if i and i[-1] - i[0] == len(i) - 1}  # fmt: skip
        done = self._compiled(flat, spans) if self.scheme in TREE_TAGS else {}
        out: dict[str, dict[str, Any]] = {}
        for rid, idx in row_sets.items():
            digest, blocks = done.get(rid) or request_hashes(flat[idx], self.block_rows,
                                                             self.scheme)  # fmt: skip
            out[rid] = {"digest": digest, "n_rows": len(idx), "blocks": blocks}
        return out

    def _compiled(
        self, rows: np.ndarray, spans: dict[str, tuple[int, int]]
    ) -> dict[str, tuple[str, list[str]]]:
        """Tree-scheme (digest, blocks) of each request on consecutive rows
        ``spans[r] = (first row, rows)`` of the contiguous ``rows`` (physical row, ...), in
        one compiled call; empty where the compiled module is not built (or a block is
        over one piece): the caller's Python loop then hashes them."""
        if not spans or not rows.size:
            return {}
        hasher, tag, piece, size = self._tree_args
        got = request_blocks(hasher, rows.reshape(-1).view(np.uint8).data,
                             rows.nbytes // rows.shape[0], list(spans.values()), self.block_rows,
                             tag, piece, size)  # fmt: skip
        return {} if got is None else dict(zip(spans, got, strict=True))

    def _rows(
        self, arr: np.ndarray, k: int | None, axes: tuple[int, int] | None
    ) -> np.ndarray | None:
        """The tensor as (physical row, ...) when it is read per request, else None."""
        if self.row_map is None:
            return None
        if axes is not None:  # (a view already in C order is not copied; else one gather)
            moved = treehash.contiguous(arr.transpose(_axes_first(arr.ndim, axes)))
            return moved.reshape((len(self.row_map), *moved.shape[2:]))
        if k is not None:
            return arr.reshape((len(self.row_map), *arr.shape[k:]))
        return None

    def _hash(self, entry: dict[str, Any], arr: np.ndarray, rows: np.ndarray | None) -> None:
        """Digests of one boundary on the host (and its dump file, if planned)."""
        scheme = entry["hash"]
        mapped = rows is not None and self.row_map is not None
        if scheme == self.scheme and arr.ndim >= 1 and arr.size:
            if not self._hash_compiled(entry, arr, rows):  # every digest in one call, or:
                arr = np.ascontiguousarray(arr)
                mv, leaf = arr.reshape(-1).view(np.uint8).data, self._leaf
                entry["digest"] = leaf(mv)
                if entry["leading"] is not None:  # one digest per index of axis 0, by offsets
                    rb = arr.nbytes // arr.shape[0]
                    entry["leading"] = [leaf(mv[i * rb : (i + 1) * rb])
                                        for i in range(arr.shape[0])]  # fmt: skip
                if mapped:
                    entry["requests"].update(self._request_digests(cast(np.ndarray, rows), scheme))
        else:
            entry["digest"] = digest_hex(arr, scheme)
            if entry["leading"] is not None:
                entry["leading"] = [digest_hex(x, scheme) for x in arr]
            if mapped:
                entry["requests"].update(self._request_digests(cast(np.ndarray, rows), scheme))
        if mapped and entry.get("row_axes") == [0, 2] and arr.ndim == 4:
            self._kv_repeat(entry, arr, scheme)
        if entry["dump"] is not None:
            self._write_dump(entry["dump"], arr, rows)

    def _hash_compiled(
        self, entry: dict[str, Any], arr: np.ndarray, rows: np.ndarray | None
    ) -> bool:
        """:meth:`_hash`'s digests (whole, per index of axis 0, per request) in one call into
        the compiled module; False (nothing set) where it cannot: the Python loop then."""
        arr = np.ascontiguousarray(arr)
        buf, row_bytes, spans = None, 0, cast("list[tuple[str, int, int]]", [])
        if rows is not None and self.row_map is not None:
            if not rows.size:
                return False
            rows = np.ascontiguousarray(rows)
            row_bytes = rows.nbytes // rows.shape[0]
            buf = rows.reshape(-1).view(np.uint8)
            spans = self._consecutive()
        n_lead = int(arr.shape[0]) if entry["leading"] is not None else -1
        done, requests = self._boundary_call(entry, arr.reshape(-1).view(np.uint8), n_lead, buf,
                                             row_bytes, spans)  # fmt: skip
        if not done:
            return False
        if requests is not None:
            if self._gathered:  # rows not consecutive: gathered (a copy), in row-map order
                for rid, idx in self._gathered:
                    digest, blocks = request_hashes(cast(np.ndarray, rows)[idx], self.block_rows,
                                                    self.scheme)  # fmt: skip
                    requests[rid] = {"digest": digest, "n_rows": len(idx), "blocks": blocks}
                requests = {rid: requests[rid] for rid in cast(RowMap, self.row_map).requests}
            entry["requests"] = requests
        return True

    def _hash_in_place(self, entry: dict[str, Any], arr: np.ndarray, k: int | None) -> bool:
        """The common case of :meth:`_hash`, in one compiled call on ``arr``'s own memory:
        hashed whole (and per index of axis 0), or per request by its leading ``k`` dims
        (the rows are ``arr``'s bytes in order), every request on consecutive rows. False
        (nothing set): :meth:`_hash` then."""
        if not arr.ndim or not arr.size or entry["hash"] != self.scheme:
            return False
        rows, row_bytes, spans = None, 0, cast("list[tuple[str, int, int]]", [])
        if k is not None and self.row_map is not None:
            spans = self._consecutive()
            if self._gathered or not arr.flags.c_contiguous:
                return False
            rows, row_bytes = arr, arr.nbytes // len(self.row_map)
        n_lead = int(arr.shape[0]) if entry["leading"] is not None else -1
        try:
            done, requests = self._boundary_call(entry, arr, n_lead, rows, row_bytes, spans)
        except (ValueError, BufferError):  # not one contiguous buffer: the general path
            return False
        if not done:
            return False
        if requests is not None:
            entry["requests"] = requests
        return True

    def _hash_axes(self, entry: dict[str, Any], arr: np.ndarray, axes: tuple[int, int]) -> bool:
        """:meth:`_hash` of a host tensor read per request by row ``axes`` (an op's
        ``(batch, heads, positions, head_dim)``, say), in one compiled call: the rows are
        ``arr`` with ``axes`` moved to the front, copied only where that is not already
        C order (a ``transpose(1, 2)`` view of ``(batch, positions, heads, head_dim)`` is);
        the whole digest from ``arr`` itself or one contiguous copy. False (nothing set):
        the general path then (requests on rows that are not consecutive, say)."""
        rm = self.row_map
        if (rm is None or not arr.size or entry["hash"] != self.scheme
                or arr.shape[0] * arr.shape[axes[1]] != len(rm)):  # fmt: skip
            return False
        spans = self._consecutive()
        if self._gathered:
            return False
        whole = treehash.contiguous(arr)
        rows = cast(np.ndarray, self._rows(arr, None, axes))
        try:
            done, requests = self._boundary_call(entry, whole, -1, rows, rows.nbytes // len(rm),
                                                 spans)  # fmt: skip
        except (ValueError, BufferError):
            return False
        if not done:
            return False
        entry["requests"] = requests
        if axes == (0, 2) and arr.ndim == 4:
            self._kv_repeat(entry, whole, self.scheme)
        return True

    def _boundary_call(
        self,
        entry: dict[str, Any],
        whole: Any,
        n_lead: int,
        rows: Any,
        row_bytes: int,
        spans: list[tuple[str, int, int]],
    ) -> tuple[bool, dict[str, dict[str, Any]] | None]:
        """:func:`treehash.hash_boundary` for ``entry``: sets its whole digest and, with
        ``n_lead >= 0``, that many per-index digests; returns (computed, the requests'
        digests or None where not row-mapped); (False, None): nothing set."""
        hasher, tag, piece, size = self._tree_args
        got = treehash.hash_boundary(hasher, whole, n_lead, rows, row_bytes, spans,
                                     self.block_rows, tag, piece, size)  # fmt: skip
        if got is None:
            return False, None
        entry["digest"], leading, requests = got
        if leading is not None:
            entry["leading"] = leading
        return True, requests

    def _consecutive(self) -> list[tuple[str, int, int]]:
        """(request, first row, rows) of each request on consecutive rows, once; the others
        in ``_gathered``."""
        if self._span_list is None:
            self._span_list = [(r, s[0], len(i)) for r, i, s in self._request_plan()
                               if s is not None]  # fmt: skip
            self._gathered = [(r, i) for r, i, s in self._request_plan() if s is None]
        return self._span_list

    def _kv_repeat(self, entry: dict[str, Any], arr: np.ndarray, scheme: str) -> None:
        """Digests of ``(batch, heads, positions, head_dim)`` with repeated heads collapsed.

        Grouped-KV attention run on repeated heads (each of ``n_kv`` heads copied ``g``
        times in a row, as transformers' ``repeat_kv`` lays them out) holds the same
        values as the ``n_kv`` heads another layout passes unrepeated. Where every group
        of ``g`` consecutive heads is bit-for-bit one head copied (``g > 1``, the largest
        such), ``kv_repeat`` records ``g`` and the per-request digests of the first head
        of each group, so the comparison can judge the two layouts in a common form.
        """
        b, h, s, d = arr.shape
        size = arr.dtype.itemsize
        if not arr.size or size not in (1, 2, 4, 8):
            return  # not checked: the comparison leaves a head-count change unjudged
        # two heads whose first rows differ are not copies: most attention tensors end here,
        # without the whole-head comparison
        if h < 2:
            distinct = True
        elif arr.flags.c_contiguous:  # the two rows' bytes, by offset
            mv, rb = arr.reshape(-1).view(np.uint8).data, d * size
            distinct = mv[:rb] != mv[s * rb : s * rb + rb]
        else:
            distinct = arr[0, 0, 0].tobytes() != arr[0, 1, 0].tobytes()
        g = 1 if distinct else _repeat_groups(arr.view(np.dtype(f"u{size}")), np.array_equal)
        kv: dict[str, Any] = {"groups": g, "requests": {}}  # groups 1: checked, no repeats
        if g > 1:
            one = arr.reshape(b, h // g, g, s, d)[:, :, 0]
            kv["requests"] = self._request_digests(cast(np.ndarray, self._rows(one, None, (0, 2))),
                                                   scheme)  # fmt: skip
        entry["kv_repeat"] = kv

    def _kv_repeat_device(self, entry: dict[str, Any], t: Any) -> None:
        """:meth:`_kv_repeat` where ``t`` lives, digests as ``cksum4-v1`` (nothing set if
        the device cannot: the comparison then leaves a head-count change unjudged)."""
        b, h, s, d = (int(x) for x in t.shape)
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        if not t.numel() or t.element_size() not in ints:
            return
        try:
            g = _repeat_groups(t.view(ints[t.element_size()]), torch.equal)
            kv: dict[str, Any] = {"groups": g, "requests": {}}
            if g > 1:
                one = t.reshape(b, h // g, g, s, d)[:, :, 0]
                kv["requests"] = _device_checksums(
                    one, None, (0, 2), False, self.row_map, self.block_rows
                )[2]
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            return
        entry["kv_repeat"] = kv

    def _request_plan(self) -> list[tuple[str, np.ndarray, tuple[int, int] | None]]:
        """(request, its physical rows, (start, stop) where they are consecutive), once."""
        if self._plan is None:
            rm = cast(RowMap, self.row_map)
            self._plan = [(rid, idx, rm.spans.get(rid)) for rid, idx in rm.requests.items()]
        return self._plan

    def _span_dict(self) -> dict[str, tuple[int, int]]:
        """(first row, rows) of each request on consecutive rows, in the plan's order, once."""
        if self._spans is None:
            self._spans = {r: (s[0], len(i)) for r, i, s in self._request_plan() if s is not None}
        return self._spans

    def _request_digests(self, rows: np.ndarray, scheme: str) -> dict[str, dict[str, Any]]:
        """Per-request digests of ``rows`` (physical row, ...), as :func:`request_hashes`.

        The tensor is made contiguous once; a request on consecutive rows is hashed from
        byte offsets into that buffer (its blocks, then all its rows when it has several
        blocks), with no per-request array handling. Gathered requests (rows not
        consecutive), other schemes and empty rows take :func:`request_hashes`.
        """
        plan, block = self._request_plan(), self.block_rows
        out: dict[str, dict[str, Any]] = {}
        fast = scheme == self.scheme and rows.size > 0 and rows.ndim >= 1
        if fast:
            rows = np.ascontiguousarray(rows)
            mv = rows.reshape(-1).view(np.uint8).data
            rb = rows.nbytes // rows.shape[0]
        # every consecutive request's blocks in one compiled call
        done = self._compiled(rows, self._span_dict()) if fast else {}
        for rid, idx, span in plan:
            if rid in done:
                digest, blocks = done[rid]
            elif not fast or span is None:
                # consecutive rows are read in place; others are gathered (a copy)
                mine = rows[span[0] : span[1]] if span is not None else rows[idx]
                digest, blocks = request_hashes(mine, block, scheme)
            else:
                lo, n = span[0] * rb, len(idx)
                cuts = [(lo + i * rb, lo + min(i + block, n) * rb) for i in range(0, n, block)]
                blocks = [self._leaf(mv[a:b]) for a, b in cuts]
                digest = tree_request(blocks, n, block, scheme)
            out[rid] = {"digest": digest, "n_rows": int(len(idx)), "blocks": blocks}
        return out

    def _device_digests(
        self, entry: dict[str, Any], t: Any, k: int | None, axes: tuple[int, int] | None
    ) -> bool:
        """``cksum4-v1`` digests computed where ``t`` lives; False (nothing set): use the host."""
        try:
            digests = _device_checksums(t, k, axes, entry["leading"] is not None, self.row_map,
                                        self.block_rows)  # fmt: skip
        except (RuntimeError, TypeError, ValueError, NotImplementedError):
            return False  # the host hashes it instead
        entry["hash"] = hashing.CHECKSUM
        entry["digest"], leading, requests = digests
        if entry["leading"] is not None:
            entry["leading"] = leading
        if requests is not None:
            entry["requests"] = requests
        return True
