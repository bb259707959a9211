"""The hook recorder: :class:`Recorder` turns each tensor a hook hands it into a manifest
entry (a :data:`~dmlib.localize.capture.format.ENTRY_KEYS` dict), deciding how it is read
(whole, per request by leading dims or by row axes, a KV cache by positions), sharing the
digests of one live tensor recorded twice, and handing big tensors to worker threads.
"""

from __future__ import annotations

import collections
import fnmatch
import sys
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import numpy as np

from dmlib.errors import CaptureError
from dmlib.hashing import CHECKSUM
from dmlib.localize.capture import treehash
from dmlib.localize.capture.broadcast import position_dims, record_broadcast
from dmlib.localize.capture.columns import record_columns, wants_columns
from dmlib.localize.capture.digests import (
    TREE_TAGS,
    _device_checksums,
    _leaf_hasher,
    _tree_args,
    digest_hex,
)
from dmlib.localize.capture.format import (
    ROOT,
    XXH_TREE,
    boundary_name,
    is_layout_slot,
    new_entry,
)
from dmlib.localize.capture.hostdigests import HostDigests
from dmlib.localize.capture.options import CaptureOptions
from dmlib.localize.capture.rowmap import (
    RowMap,
)
from dmlib.localize.capture.tensors import (
    _NP_NAMES,
    _SPECIAL,
    _host_view,
    _np_dtype,
    _to_numpy,  # (None where torch is not installed)
)

MAX_PENDING_BYTES = 512 << 20  # tensor copies waiting to be hashed, at most


_MEMO_PLANS = 32  # KV-cache row plans kept with a row map between captures, at most
_RECENT_PLANS = 4  # ... and beyond those, the latest plans a capture keeps


_UNSET: Any = object()
INLINE_BYTES = 1 << 20  # host tensors up to this size are hashed in the hook, uncopied
# ... of any size with XXH3: it reads 55 GB/s (two passes: whole and blocks), a private copy
# for a worker is made at a few GB/s (a 2.2 MiB MLP activation: ~80 us hashed in place,
# 200-500 us copied, measured), so the copy costs more than the hashing it hands over
INLINE_BYTES_XXH3 = sys.maxsize
_LAYOUT_HITS: dict[tuple[Any, ...], bool] = {}  # (patterns, module, slot) -> layout input?


class _RowSets:
    """The two things :func:`_device_checksums` reads of a row map: its length (rows) and
    ``requests`` (request -> its rows in order), for a KV cache's own rows."""

    def __init__(self, entries: list[Any], requests: dict[str, list[int]]) -> None:
        self.entries, self.requests = entries, requests

    def __len__(self) -> int:
        return len(self.entries)


class Recorder(HostDigests):
    def __init__(
        self,
        path: Path,
        options: CaptureOptions | None = None,
        *,
        row_map: RowMap | None = None,
        root: str = ROOT,
        layout_inputs: Sequence[str] | None = None,
        scheme: str | None = None,
        **settings: Any,
    ) -> None:
        """A recorder writing into ``path`` with ``options`` (or its fields given as
        keywords in ``settings``: ``block_rows``, ``dump``, ``hash_threads``...);
        ``row_map``: the capture's :class:`RowMap`; ``root``: the model's own label;
        ``layout_inputs``: every layout-input pattern (default: the options'
        ``layout_patterns``); ``scheme``: a host scheme by its full name, as ``hash``."""
        if scheme is not None:
            if scheme not in TREE_TAGS:
                raise CaptureError(
                    f"host hash scheme {scheme!r}; expected one of {sorted(TREE_TAGS)}"
                )
            settings["hash"] = scheme
        opts = CaptureOptions.of(options, **settings)
        self.options = opts
        self.path = path
        self.root = root  # the label of the hooked model itself
        self.layout_inputs = opts.layout_patterns if layout_inputs is None else tuple(layout_inputs)
        self.step = 0  # forward passes of the model begun before this one (decode step)
        # BLAKE3 and SHA-256 release the GIL, so boundaries are hashed (and dumped) on
        # worker threads while the forward pass goes on; each works on a private copy of
        # the tensor, taken in the hook, because a later in-place op may change the
        # module's output after the hook returns.
        # writing a dump mostly waits on the disk (fsync): two more threads hide that wait
        # (made at the first tensor handed over: most captures hash every tensor in the hook)
        threads, scheme = opts.hash_threads, opts.scheme
        self._workers = threads + (2 if opts.dump else 0) if threads > 0 else 0
        self._inline = INLINE_BYTES_XXH3 if scheme == XXH_TREE else INLINE_BYTES
        self._pool: ThreadPoolExecutor | None = None
        self._pending: collections.deque[tuple[Future[None], int]] = collections.deque()
        self._pending_bytes = 0
        self.row_map = row_map
        self.block_rows = opts.block_rows
        self.dump = list(opts.dump)
        reqs = opts.dump_requests
        self.dump_requests: set[str] | None = None if reqs is None else set(reqs)
        self.metadata = dict(opts.metadata)  # (capture_generate adds to it: the recorder's own)
        self.scheme = scheme  # the host's hash
        self._leaf = _leaf_hasher(scheme)  # a byte slice's hex digest in it
        # (hasher, tree tag, piece, digest size) of the compiled block loop, looked up once
        self._tree_args = _tree_args(scheme)
        self.device_hash = opts.device_hash
        self._device_path_on_cpu = False  # tests: take the device path with CPU tensors
        self.boundaries: list[dict[str, Any]] = []
        self.calls: dict[str, int] = {}
        self.whole_only: list[str] = []
        self.layout: tuple[int, int] | None = None  # (batch, positions), from the first 2-d rows
        # op-level capture (dmlib.localize.ops) lists each recorded op here
        self.ops: list[dict[str, Any]] | None = None
        # (id, version, pointer, shape, strides, dtype, how rows are read) -> (a weak
        # reference to the tensor, its first entry): the same live tensor object at the
        # same version holds the same bytes
        self._seen: dict[tuple[Any, ...], tuple[Any, dict[str, Any]]] = {}
        self._same: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (entry, its first)
        # (a weak reference, version) of each tensor first recorded as an output in this
        # forward pass (emptied as each pass begins: hooks.py's pass hook reads it)
        self.pass_outputs: list[tuple[Any, int]] = []
        self._plan: list[tuple[str, np.ndarray, tuple[int, int] | None]] | None = None
        self._spans: dict[str, tuple[int, int]] | None = None
        # (request, first row, rows) of the requests on consecutive rows; the others
        self._span_list: list[tuple[str, int, int]] | None = None
        self._gathered: list[tuple[str, np.ndarray]] = []
        # (shape, row-mapped, op, decode step, layout) -> how such a tensor is read
        self._row_plans: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        # KV-cache shape -> its rows per request (the row map and layout are fixed once set)
        self._cache_plans: dict[tuple[Any, ...], Any] = {}
        # (batch, prompt positions) -> the prompt's layout for a longer cache's rows
        self._decode_layouts: dict[tuple[int, int], Any] = {}
        # what the capture saw of the forward passes as a whole: whether the model itself
        # was hooked, its forward's parameter names (to pair positional and keyword inputs),
        # and what it produced that was not captured ({"what", "reason"}): a comparison is
        # never "identical" about those
        self.coverage: dict[str, Any] = {"root_hooked": None, "arg_names": {}, "not_captured": []}
        self.grads: Any = None  # the backward hooks (backward.py), with backward=True
        self.recorded_calls: dict[str, int] = {}  # dmlib.record() name -> calls (record.py)

    def backward(self, out: Any) -> None:
        """``out.backward()`` with the capture's upstream gradient: seeded random with
        ``grad_seed`` (written in the manifest), else ones (a scalar's own backward)."""
        from dmlib.localize.capture.backward import run_backward

        run_backward(self, out)

    def upstream(self, out: Any) -> Any:
        """The upstream gradient :meth:`backward` would send into ``out`` (the next draw)."""
        from dmlib.localize.capture.backward import GradHooks

        if self.grads is None:
            self.grads = GradHooks(self, [])
        return self.grads.upstream(out)

    def note_unseen(self, what: str, reason: str) -> None:
        """List ``what`` (a model's output, a state) as produced but not captured (once)."""
        items = self.coverage["not_captured"]
        if not any(u["what"] == what for u in items):
            items.append({"what": what, "reason": reason})

    def _contents(self, error: str | None) -> dict[str, Any]:
        """The writer's keys after the row map, with the capture's ``coverage``."""
        m = super()._contents(error)
        m["coverage"] = self.coverage
        return m

    def is_layout(self, module: str, slot: str) -> bool:
        """Whether input ``slot`` of ``module`` follows the batch layout (a mask, positions)."""
        key = (self.layout_inputs, module, slot)
        hit = _LAYOUT_HITS.get(key)
        if hit is None:
            name = f"{module}:{slot}"
            hit = is_layout_slot(slot, self.layout_inputs) or any(
                fnmatch.fnmatchcase(name, p) for p in self.layout_inputs
            )
            _LAYOUT_HITS[key] = hit
        return hit

    def record_cache(
        self, module: str, call: int, slot: str, t: Any, *, rolled: bool = False
    ) -> str:
        """Hash one KV-cache tensor ``(batch, heads, positions, head_dim)`` per request.

        Position ``j`` of batch row ``r`` is the row map's entry ``r * seq + j`` for
        ``j < seq`` (the prompt), else the ``j - seq``-th generated token of the request
        filling row ``r`` alone; padding and rows shared by several requests are left
        out. Without a known (batch, seq) layout, or for another shape, it is hashed
        whole and per batch row. A rolling (sliding-window) cache, whose slots do not
        follow positions, is hashed whole only (``rolled``): never judged per request.
        """
        if rolled:
            return self.record(module, call, "input", slot, t, row_mapped=False,
                               extra={"cache": True, "rolled": True})  # fmt: skip
        rows = self._cache_rows(tuple(int(d) for d in t.shape))
        if rows is None:
            return self.record(module, call, "input", slot, t, extra={"cache": True})
        name = boundary_name(module, call, "input", slot)
        key = self._identity(t, ("cache", len(rows[0])))
        first = self._seen.get(key) if key is not None else None
        if first is not None and first[0]() is t:  # this layer's cache, unchanged since
            same = first[1]
            entry = dict(same, name=name, module=module, call=call, slot=slot)
        else:
            entry = self._cache_entry(module, call, slot, t, rows)
            if key is not None:
                self._seen[key] = (weakref.ref(t), entry)
        entry.pop("step", None)
        if self.step:
            entry["step"] = self.step
        self.boundaries.append(entry)
        return name

    def _cache_entry(
        self,
        module: str,
        call: int,
        slot: str,
        t: Any,
        rows: tuple[list[Any], dict[str, list[int]]],
    ) -> dict[str, Any]:
        """A KV-cache tensor's entry and its digests, whole and per request by ``rows``:
        where it lives (``cksum4-v1``, as :meth:`_digest` hashes a device tensor), else on
        the host."""
        if self.device_hash and (not t.is_cpu or self._device_path_on_cpu):
            try:  # (batch, positions, heads, head_dim) rows, as on the host
                whole, _, requests = _device_checksums(t, None, (0, 2), False,
                                                       cast(RowMap, _RowSets(*rows)),
                                                       self.block_rows)  # fmt: skip
            except (RuntimeError, TypeError, ValueError, NotImplementedError):
                pass  # the host hashes it instead
            else:
                entry = new_entry(module, call, "input", slot, _np_dtype(t.dtype).name,
                                  tuple(t.shape), CHECKSUM, {"cache": True})  # fmt: skip
                entry["digest"], entry["requests"] = whole, requests
                return entry
        arr = treehash.contiguous(_host_view(t))
        # (batch, positions, heads, head_dim): one row per (batch row, position)
        flat = treehash.contiguous(arr.transpose(0, 2, 1, 3)).reshape(len(rows[0]), -1)
        requests = self._row_set_digests(flat, rows[1])
        entry = new_entry(module, call, "input", slot, arr.dtype.name, arr.shape, self.scheme,
                          {"cache": True})  # fmt: skip
        entry["digest"], entry["requests"] = digest_hex(arr, self.scheme), requests
        return entry

    def _cache_rows(self, shape: tuple[int, ...]) -> tuple[list[Any], dict[str, list[int]]] | None:
        """(entry per flattened (batch, position) row, request -> its rows in order), once
        per shape and layout."""
        key = ("cache", shape, self.row_map.batch if self.row_map else None, self.layout)
        # kept with the row map (what a shape's rows are follows from it, the batch and the
        # layout), a few dozen at most: a long generate() makes one per decode step, kept
        # only for this capture, and only the last few (a pass meets two or three shapes:
        # each plan holds a row per (batch row, position), so keeping every step's would
        # hold batch x steps^2 / 2 entries by the end of a long generation)
        memo = {} if self.row_map is None else self.row_map._memo
        plan = memo.get(key, self._cache_plans.get(key, _UNSET))
        if plan is _UNSET:
            plan = self._cache_rows_of(shape)
            if len(memo) < _MEMO_PLANS:
                memo[key] = plan
            else:
                if len(self._cache_plans) >= _RECENT_PLANS:
                    self._cache_plans.pop(next(iter(self._cache_plans)))  # the oldest
                self._cache_plans[key] = plan
        return cast("tuple[list[Any], dict[str, list[int]]] | None", plan)

    def _cache_rows_of(
        self, shape: tuple[int, ...]
    ) -> tuple[list[Any], dict[str, list[int]]] | None:
        rm = self.row_map
        if rm is None or len(shape) != 4:
            return None
        batch = rm.batch or (self.layout[0] if self.layout else None)
        if not batch or shape[0] != batch or len(rm) % batch:
            return None
        seq = len(rm) // batch
        if shape[2] == seq:  # the prompt's positions only: the row map's own rows
            return list(rm.entries), {rid: idx.tolist() for rid, idx in rm.requests.items()}
        if shape[2] > seq:
            plan = self._decode_rows(shape[2], batch, seq)
            if plan is not None:
                return plan
        entries: list[Any] = []
        for r in range(batch):
            row = rm.entries[r * seq : (r + 1) * seq]
            owners = {e[0] for e in row if e is not None}
            owner = next(iter(owners)) if len(owners) == 1 else None
            n = len(rm.requests[owner]) if owner is not None else 0
            for j in range(shape[2]):
                if j < seq:
                    entries.append(row[j])
                else:
                    entries.append(None if owner is None else (owner, n + j - seq))
        mine: dict[str, list[tuple[int, int]]] = {}
        for i, e in enumerate(entries):
            if e is not None:
                mine.setdefault(e[0], []).append((e[1], i))
        return entries, {rid: [i for _, i in sorted(v)] for rid, v in mine.items()}

    def _decode_rows(
        self, length: int, batch: int, seq: int
    ) -> tuple[Any, dict[str, list[int]]] | None:
        """:meth:`_cache_rows_of` of a cache of ``length > seq`` positions per batch row, in
        work that grows with the prompt only (the generated rows of a request are a range):
        each request's prompt rows in position order, then, in the batch row it fills
        alone, every position after the prompt. The rows stand as a ``range`` (only their
        count is read). None where the prompt's layout is not that simple (a request
        filling several batch rows alone, or positions not 0, 1, ... without repeats)."""
        key = (batch, seq)
        if key not in self._decode_layouts:
            self._decode_layouts[key] = self._decode_layout(batch, seq)
        layout = self._decode_layouts[key]
        if layout is None:
            return None
        requests: dict[str, list[int]] = {}
        for rid, (prompt, row) in layout.items():
            idx = [r * length + j for r, j in prompt]
            if row is not None:
                idx += range(row * length + seq, (row + 1) * length)
            requests[rid] = idx
        return range(batch * length), requests

    def _decode_layout(
        self, batch: int, seq: int
    ) -> dict[str, tuple[list[Any], int | None]] | None:
        """Per request, in order of first appearance: its prompt's (batch row, column) in
        position order, and the batch row it fills alone (or None); None: not simple."""
        rm = cast(RowMap, self.row_map)
        cells: dict[str, list[tuple[int, int, int]]] = {}
        owned: dict[str, int] = {}
        for r in range(batch):
            row = rm.entries[r * seq : (r + 1) * seq]
            for j, e in enumerate(row):
                if e is not None:
                    cells.setdefault(e[0], []).append((e[1], r, j))
            owners = {e[0] for e in row if e is not None}
            if len(owners) == 1:
                (owner,) = owners
                if owner in owned:
                    return None  # generated positions in two rows: not in position order
                owned[owner] = r
        out: dict[str, tuple[list[Any], int | None]] = {}
        for rid, v in cells.items():
            if sorted(p for p, _, _ in v) != list(range(len(v))):
                return None
            out[rid] = ([(r, j) for _, r, j in sorted(v)], owned.get(rid))
        return out

    def _wants_dump(self, name: str) -> bool:
        return bool(self.dump) and any(fnmatch.fnmatchcase(name, p) for p in self.dump)

    def record(
        self,
        module: str,
        call: int,
        kind: str,
        slot: str,
        t: Any,
        *,
        row_mapped: bool = True,
        extra: dict[str, Any] | None = None,
        alias: tuple[Any, dict[str, Any]] | None = None,
        fresh: bool = False,
    ) -> str:
        """Hash (and maybe dump) one boundary tensor; returns the boundary's name.

        ``row_mapped=False`` hashes the tensor whole even where its leading dims fit the
        row map (a parameter, say); ``extra`` adds keys to the manifest entry. ``alias``:
        ``(tensor, its entry)`` of a tensor recorded before whose bytes this one's are
        known to be, unchanged since (an op's input, where the op writes nothing and its
        output shares the input's memory): the digests are shared where both are
        contiguous over the same memory and read the same way (:meth:`_same_bytes`).
        ``fresh``: hashed whatever was recorded before under the same tensor identity (the
        output of an op that may write its inputs, seen from inside the dispatch, before
        torch bumps the version counter of what it wrote).
        """
        # detach() makes a new object (identity stays the original's); only where autograd
        # would stand between the recorder and the bytes
        original, t = t, (t.detach() if t.requires_grad else t)
        shape = tuple(t.shape)  # torch.Size: ints
        if row_mapped and not extra and self.layout is not None and self.layout[0] > 1:
            k_pos = position_dims(self, shape)  # per position, broadcast over the batch
            if k_pos is not None:
                return record_broadcast(self, module, call, kind, slot, t, k_pos)
        entry = self._entry(module, call, kind, slot, t.dtype, shape, extra)
        name = entry["name"]
        k, axes = self._read_rows(entry, shape, row_mapped, bool(extra))
        wants_dump = self._wants_dump(name)
        self.boundaries.append(entry)
        if wants_columns(self, entry, shape):  # a later pass's rows of several positions
            record_columns(self, entry, t)
        how = (k, axes, entry["leading"] is not None)
        if not fresh and self._share(entry, original, how, wants_dump):
            return name
        if alias is not None and not wants_dump and self._same_bytes(alias, t, entry):
            self._same.append((entry, alias[1]))
            return name
        if wants_dump:  # planned now, so that a later boundary of this tensor can share it
            index = len(self.boundaries) - 1
            entry["dump"] = self._dump_plan(index, k is not None or axes is not None)
        elif t.is_cpu and not self._device_path_on_cpu and t.dtype not in _SPECIAL:
            # the common case: a small host tensor, hashed in one compiled call on its own
            # memory (or on one contiguous copy of it)
            arr = _host_view(t)  # a view with the tensor's strides, where numpy can take one
            if not self._workers or arr.nbytes <= self._inline:
                if axes is None:
                    arr = treehash.contiguous(arr)
                    if not self._hash_in_place(entry, arr, k):
                        self._hash(entry, arr, self._rows(arr, k, axes))
                    return name
                if self._hash_axes(entry, arr, axes):
                    return name
        self._digest(entry, t, k, axes)
        return name

    def _entry(
        self,
        module: str,
        call: int,
        kind: str,
        slot: str,
        dtype: Any,
        shape: tuple[int, ...],
        extra: dict[str, Any] | None,
    ) -> dict[str, Any]:
        """A boundary's manifest entry (:func:`new_entry`), digests still to be filled."""
        label = _NP_NAMES.get(dtype) or _NP_NAMES.setdefault(dtype, _np_dtype(dtype).name)
        return new_entry(module, call, kind, slot, label, shape, self.scheme, extra, self.step)

    def _read_rows(
        self, entry: dict[str, Any], shape: tuple[int, ...], row_mapped: bool, op: bool
    ) -> tuple[int | None, tuple[int, int] | None]:
        """How the tensor is read per request: (row dims, row axes), set in ``entry``.

        Neither: hashed whole (listed in ``whole_only``), and per index of axis 0 where
        that axis may be the batch. Worked out once per shape, way of reading, decode
        step or not, and layout (:meth:`_row_plan`).
        """
        key = (shape, row_mapped, op, self.step > 0, self.layout)
        plan = self._row_plans.get(key)
        if plan is None:
            plan = self._row_plans[key] = self._row_plan(shape, row_mapped, op)
        k, axes, leading = plan
        if k is not None or axes is not None:
            entry["row_dims"] = k
            if axes is not None:
                entry["row_axes"] = list(axes)
        elif self.row_map is not None:
            self.whole_only.append(entry["name"])
            if leading:
                entry["leading"] = []
        return k, axes

    def _row_plan(
        self, shape: tuple[int, ...], row_mapped: bool, op: bool
    ) -> tuple[int | None, tuple[int, int] | None, bool]:
        """(row dims, row axes, per-index digests of axis 0) of a tensor of ``shape``; the
        first tensor that shows the (batch, positions) layout sets it."""
        row_map = self.row_map
        k = row_map.row_dims(shape) if row_map is not None and row_mapped else None
        if k is not None and self.step and not self._prompt_rows(shape, k):
            k = None  # a later pass (a decode step): the row map is the first pass's layout
        if self.layout is None and row_map is not None and row_map.batch:
            self.layout = (row_map.batch, len(row_map) // row_map.batch)  # a nested row map
        if k == 2 and self.layout is None:
            self.layout = (shape[0], shape[1])  # (batch, positions)
        axes = self._row_axes(shape) if k is None and row_mapped and op else None
        if row_map is None or k is not None or axes is not None:
            return (k, axes, False) if row_map is not None else (None, None, False)
        # one hash per index of axis 0 (never for a parameter: its first axis is no batch):
        # if that axis is the batch, the comparison attributes each row to the request
        # filling that batch row
        return None, None, row_mapped and len(shape) >= 1 and 1 <= shape[0] <= len(row_map)

    def _share(
        self, entry: dict[str, Any], original: Any, how: tuple[Any, ...], wants_dump: bool
    ) -> bool:
        """True where this live tensor, unchanged, was recorded already: its digests are shared."""
        key = self._identity(original, how)
        first = self._seen.get(key) if key is not None else None
        if first is not None and first[0]() is original and (first[1]["dump"] or not wants_dump):
            self._same.append((entry, first[1]))  # the same bytes: digests filled in finish()
            if wants_dump:
                entry["dump"] = first[1]["dump"]
            return True
        if key is not None:
            ref = weakref.ref(original)
            self._seen[key] = (ref, entry)
            if entry["kind"] == "output":  # (the pass hook's check: this pass's outputs only)
                self.pass_outputs.append((ref, key[1]))
        return False

    @staticmethod
    def _same_bytes(alias: tuple[Any, dict[str, Any]], t: Any, entry: dict[str, Any]) -> bool:
        """Whether ``t`` holds the bytes of ``alias``'s tensor, in order, read the same way.

        Both contiguous from one address over as many bytes of one dtype and device: the
        same bytes in the same order (the caller vouches that nothing wrote them since).
        Read the same way: both per request by flat rows (any leading dims flatten to the
        same rows), both whole (with per-index digests of axis 0 of one length, or none),
        or both by the same row axes of one shape.
        """
        u, first = alias
        if first.get("dump") is not None or first.get("hash") != entry["hash"]:
            return False
        try:
            same_memory = (
                u.data_ptr() == t.data_ptr() and u.dtype == t.dtype and u.device == t.device
                and u.numel() == t.numel() and u.is_contiguous() and t.is_contiguous()
            )  # fmt: skip
        except (RuntimeError, AttributeError):
            return False
        if not same_memory:
            return False
        axes, first_axes = entry.get("row_axes"), first.get("row_axes")
        if axes is not None or first_axes is not None:
            return axes == first_axes and first["shape"] == entry["shape"]
        if entry["row_dims"] is not None or first["row_dims"] is not None:
            return entry["row_dims"] is not None and first["row_dims"] is not None
        if entry["leading"] is None or first["leading"] is None:
            return entry["leading"] is None and first["leading"] is None
        return bool(first["shape"][:1] == entry["shape"][:1])

    def _digest(
        self, entry: dict[str, Any], t: Any, k: int | None, axes: tuple[int, int] | None
    ) -> None:
        """Hash one tensor: on its device, in the hook, or on a worker from a private copy."""
        on_device = not t.is_cpu or self._device_path_on_cpu
        if on_device and self.device_hash and self._device_digests(entry, t, k, axes):
            if axes == (0, 2) and t.dim() == 4:
                self._kv_repeat_device(entry, t)
            if entry["dump"] is not None:
                arr = _to_numpy(t)
                self._write_dump(entry["dump"], arr, self._rows(arr, k, axes))
            return
        entry["hash"] = self.scheme  # (a failed device checksum falls back to the host)
        # t is detached; on the CPU here, and most often of a numpy dtype
        arr = _to_numpy(t) if on_device else treehash.contiguous(_host_view(t))
        # a dump over 1 MiB is written by a worker (mostly waiting on the disk)
        inline = self._inline if entry["dump"] is None else INLINE_BYTES
        if not self._workers or arr.nbytes <= inline:
            # no worker for a small tensor: handing it over costs more than hashing it
            if axes is None and entry["dump"] is None and self._hash_in_place(entry, arr, k):
                return
            self._hash(entry, arr, self._rows(arr, k, axes))
            return
        arr = np.array(arr, copy=True)
        rows = self._rows(arr, k, axes)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self._workers)
        fut = self._pool.submit(self._hash, entry, arr, rows)
        self._pending.append((fut, arr.nbytes))
        self._pending_bytes += arr.nbytes
        while self._pending_bytes > MAX_PENDING_BYTES:  # bound the copies held in memory
            self._wait_oldest()

    def _prompt_rows(self, shape: tuple[int, ...], k: int) -> bool:
        """Whether a later pass's tensor is laid out exactly as the row map's rows.

        The first pass may flatten any leading dims to the row map's length; a later one
        (``generate()``'s decode steps feed ``(batch, 1, ...)``) only ``(batch, seq)`` or
        ``(batch * seq,)`` itself, so that ``(batch, 1, seq)`` is never read per position.
        """
        rm = cast(RowMap, self.row_map)
        if k == 1:
            return shape[0] == len(rm)
        batch = rm.batch or (self.layout[0] if self.layout else None)
        return k == 2 and batch is not None and shape[0] == batch and shape[0] * shape[1] == len(rm)

    def _identity(self, t: Any, how: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """The key under which a tensor counts as already recorded, None: never shared."""
        try:
            version = t._version  # inference tensors have no version counter
        except (RuntimeError, AttributeError):
            return None
        # (torch.Size is a tuple and stride() returns one: hashed and compared as tuples)
        return (id(t), version, t.data_ptr(), t.shape, t.stride(), t.dtype,
                True if t.is_cpu else t.device, how)  # fmt: skip

    def _row_axes(self, shape: tuple[int, ...]) -> tuple[int, int] | None:
        """(0, j) when an op's tensor is (batch, ..., positions at j, ...), else None.

        Only for op tensors, only once a boundary has shown the (batch, positions) layout,
        and only when exactly one axis after the batch has the positions' size and it is
        not axis 1 (attention's (batch, heads, positions, head_dim); scores with two
        position-sized axes stay whole).
        """
        if self.layout is None or len(shape) < 3 or shape[0] != self.layout[0]:
            return None
        hits = [j for j in range(1, len(shape)) if shape[j] == self.layout[1]]
        return (0, hits[0]) if len(hits) == 1 and hits[0] >= 2 else None

    def _wait_oldest(self) -> None:
        fut, nbytes = self._pending.popleft()
        self._pending_bytes -= nbytes
        fut.result()

    def finish(self) -> None:
        """Wait for every pending hash (re-raising a worker's error) and stop the workers."""
        if self.grads is not None:
            self.grads.close()  # a backward pass begun and never ended: failed
        try:
            while self._pending:
                self._wait_oldest()
        finally:
            self._workers = 0  # (nothing is handed over after this)
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
                self._pool = None
        for entry, first in self._same:
            # the first recording's digests, shared: nothing changes an entry once recorded
            entry["hash"], entry["digest"] = first["hash"], first["digest"]
            entry["leading"], entry["requests"] = first["leading"], first["requests"]
            if "kv_repeat" in first:
                entry["kv_repeat"] = first["kv_repeat"]
        self._same.clear()
        self._seen.clear()

    def settle_batch(self) -> None:
        """Check the row map fits some boundary; take the batch size from them if not given.

        Raises
        ------
        CaptureError
            The row map fits no boundary (wrong length), or a nested row map's batch
            size disagrees with the ``[batch, seq, ...]`` boundaries.
        """
        if self.row_map is None:
            return
        mapped = [
            b for b in self.boundaries if b["row_dims"] is not None and not b.get("broadcast")
        ]
        if not mapped:
            shapes = sorted({tuple(b["shape"]) for b in self.boundaries}, key=len)[:4]
            raise CaptureError(
                f"row_map has {len(self.row_map)} rows but no boundary's leading dims flatten to "
                f"{len(self.row_map)} (shapes seen: {[list(s) for s in shapes]}); expected one "
                "entry per batch x sequence position",
                path=self.path,
            )
        seen = sorted({b["shape"][0] for b in mapped if b["row_dims"] >= 2})
        if self.row_map.batch is None and len(seen) == 1:
            self.row_map.batch = seen[0]
        elif self.row_map.batch is not None and seen and seen != [self.row_map.batch]:
            raise CaptureError(
                f"the nested row_map has {self.row_map.batch} batch rows but [batch, seq, ...] "
                f"boundaries have {seen}",
                path=self.path,
            )
