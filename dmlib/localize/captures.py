"""The capture directory format, its hashing rule and its reader (no torch needed).

A capture is a directory::

    manifest.json            written last; "complete": true once the run finished
    tensors/00012.safetensors  full tensors of the boundaries selected for dumping

``manifest.json`` lists the boundaries (a tensor entering or leaving a named module) in
execution order with dtype, shape, the digest of the whole physical tensor and, when
the tensor's leading dimensions match the row map, per logical request: the digest of
the request's rows in position order and of each block of ``block_rows`` positions.
Hashing per logical request makes the hashes comparable between layouts that place the
same request at different physical rows (alone, padded, packed with others).

Every boundary names its hash scheme (``hash``): ``xxh3-128-tree-v1`` (what version 4
writes for host tensors by default: XXH3-128 leaves, a request's digest derived from its
blocks, :func:`tree_request`), ``blake3-tree-v1`` (the same tree over BLAKE3 leaves: what
version 3 wrote, and version 4 with ``capture(hash="blake3")``), ``blake3-64MiB`` (version
2's host scheme), ``cksum4-v1`` (computed on the device for GPU tensors) or ``sha256``
(every version-1 capture). Digests of different schemes are never compared: such a
boundary is not judged (:func:`same_scheme`).
"""

from __future__ import annotations

import collections
import fnmatch
import hashlib
import json
import math
import operator
import os
import struct
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from dmlib import dtypes as _dtypes
from dmlib import hashing
from dmlib.errors import CaptureError, DmlibError
from dmlib.kernels import jsonenc
from dmlib.safepaths import bounded_json, inside

FORMAT = "dmlib-capture"
# 4: host digests as an XXH3-128 hash tree by default ("xxh3-128-tree-v1"); 3: host
# digests as a BLAKE3 hash tree ("blake3-tree-v1"); 2: digests under a named scheme
# ("hash"); 1: bare SHA-256 ("sha256" fields)
VERSION = 4
READS = (1, 2, 3, 4)  # manifest versions this reader opens
#: The host's scheme of version 3 (and of version 4 with ``hash="blake3"``): whole
#: tensors, blocks and per-index rows are plain BLAKE3 (``blake3-64MiB``) digests of their
#: bytes; a request's digest is derived from its blocks' digests (:func:`tree_request`), so
#: that its bytes are not hashed a second time.
TREE = "blake3-tree-v1"
#: The host's default scheme from version 4: the same tree with XXH3-128 leaves (the
#: 16-byte digest of the bytes, any length; no pieces). Eleven times BLAKE3's speed on this
#: project's machine (45 against 4 GB/s on 100 KB): a capture hashes every boundary of the
#: forward pass. Why a non-cryptographic hash is enough here, and not for file
#: comparisons: docs/formats.md, "Capture hash schemes".
XXH_TREE = "xxh3-128-tree-v1"
#: Hash schemes a capture may name; the first is what the host writes by default.
SCHEMES = (XXH_TREE, TREE, hashing.BLAKE3, hashing.CHECKSUM, hashing.SHA256)
#: ``capture(hash=...)`` names -> the host scheme they select
HOST_SCHEMES = {"xxh3": XXH_TREE, XXH_TREE: XXH_TREE, "blake3": TREE, TREE: TREE}
MANIFEST = "manifest.json"
TENSOR_DIR = "tensors"
WHOLE_KEY = "tensor"  # safetensors key of a whole physical tensor
REQUEST_PREFIX = "request:"  # safetensors key prefix of one request's rows
#: Label of the hooked model itself (``modules=[""]``). A submodule may hold any name but
#: one with a dot at its ends, so the label is chosen per capture (:func:`root_label`)
#: and stored in the manifest (``"root"``); captures that store none used ``"model"``.
ROOT = "(model)"
OLD_ROOT = "model"
#: Keyword inputs whose values follow the batch layout, not one request's data: never
#: judged as the request's values (glob patterns on the keyword's name).
LAYOUT_INPUTS = (
    "attention_mask", "encoder_attention_mask", "position_ids", "cache_position",
    "cu_seqlens*", "cu_seq_lens*", "max_seqlen*", "max_length_*", "seq_idx", "seq_lens",
    "causal_mask", "sliding_window_mask", "mask", "*_mask_mapping", "bias_mask",
)  # fmt: skip


def root_label(module_names: Iterable[str]) -> str:
    """A root label no submodule takes: ``(model)``, else ``((model))``..."""
    names = set(module_names)
    label = ROOT
    while label in names:
        label = f"({label})"
    return label


def is_layout_slot(slot: str, patterns: Iterable[str] = LAYOUT_INPUTS) -> bool:
    """Whether an input slot (``input.attention_mask``, ``input.x.0``) is a layout input."""
    if not slot.startswith("input."):
        return False
    key = slot[len("input.") :].split(".", 1)[0]
    return any(fnmatch.fnmatchcase(key, p) for p in patterns)


def request_key(request: Any) -> str:
    """Request ids are kept as strings (JSON object keys); ``3`` and ``"3"`` are one request."""
    return str(request)


def _is_entry(e: list[Any]) -> bool:
    """Whether ``e`` is one ``[request, position]`` entry (as JSON writes a pair), not a batch row."""
    return len(e) == 2 and not isinstance(e[0], (list, tuple)) and isinstance(e[1], int)


def digest_hex(data: np.ndarray | np.generic | memoryview | bytes, scheme: str) -> str:
    """Bare hex digest of exactly these bytes (an ndarray as its C-order bytes) in ``scheme``."""
    if not isinstance(data, (bytes, memoryview)):  # an array, or a numpy scalar (x[i] of 1-d)
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    if scheme == XXH_TREE:
        return cast(str, _xxh3_hex()(data))
    if scheme in (hashing.BLAKE3, TREE):  # a tree's leaf is the plain digest of its bytes
        if memoryview(data).nbytes <= hashing.PIECE:  # the plain digest: skip the piece logic
            return hashing._blake3()(data).hexdigest()
        return hashing.digest_bytes(data, hashing.BLAKE3).split(":", 1)[1]
    if scheme == hashing.SHA256:
        return hashlib.sha256(data).hexdigest()
    if scheme == hashing.CHECKSUM:
        return hashing.checksum_host(data).split(":", 1)[1]
    raise CaptureError(f"unknown hash scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")


#: the domain tag of a ``blake3-tree-v1`` request digest over several blocks
TREE_REQUEST_TAG = b"dmlib blake3-tree-v1 request\0"
#: the domain tag of an ``xxh3-128-tree-v1`` request digest over several blocks
XXH_REQUEST_TAG = b"dmlib xxh3-128-tree-v1 request\0"
#: tree schemes -> the domain tag of a request digest over several blocks
TREE_TAGS = {TREE: TREE_REQUEST_TAG, XXH_TREE: XXH_REQUEST_TAG}
_COUNTS = struct.Struct("<2Q")  # (rows, rows per block)


def tree_request(blocks: Sequence[str], n_rows: int, block_rows: int, scheme: str = TREE) -> str:
    """A request's digest under a tree ``scheme`` from its block digests (hex).

    One block: that block's digest (the plain digest of every byte of the request: for
    ``blake3-tree-v1`` as in ``blake3-64MiB``). Several: the scheme's hash (BLAKE3,
    XXH3-128) of its domain tag (:data:`TREE_TAGS`), the row count and the rows per
    block (little-endian u64) and the blocks' raw digests in order: equal digests mean
    the same blocks, hence the same bytes. Everything it needs is in the manifest, so a
    ``blake3-64MiB`` boundary's request digests can be rebuilt under ``blake3-tree-v1``
    (:func:`lift_blake3`).
    """
    if len(blocks) == 1:
        return blocks[0]
    # one decode of all the blocks and one hasher call: per-block work costs more than the hash
    data = TREE_TAGS[scheme] + _COUNTS.pack(n_rows, block_rows) + bytes.fromhex("".join(blocks))
    if scheme == XXH_TREE:
        return cast(str, _xxh3_hex()(data))
    return cast(str, _b3_class()(data).hexdigest())


def _b3_class() -> Any:
    """The blake3 constructor, looked up once (an import statement per call costs ~1 us)."""
    global _B3
    if _B3 is None:
        _B3 = hashing._blake3()
    return _B3


_B3: Any = None


def _xxh3_hex() -> Any:
    """``xxhash.xxh3_128_hexdigest``, looked up once."""
    global _XXH
    if _XXH is None:
        _XXH = hashing.xxh3_128().xxh3_128_hexdigest
    return _XXH


_XXH: Any = None


def request_hashes(
    rows: np.ndarray, block_rows: int, scheme: str = hashing.SHA256
) -> tuple[str, list[str]]:
    """Digest of a request's rows (position order) and of each block of ``block_rows`` rows.

    ``rows`` has one leading entry per position; a block's bytes are those positions'
    C-order bytes, so the digest does not depend on where the rows sat physically.
    """
    rows = np.ascontiguousarray(rows)
    flat = (
        rows.reshape(rows.shape[0], -1).view(np.uint8)
        if rows.size
        else rows.reshape(rows.shape[0], 0)
    )
    n = rows.shape[0]
    if scheme == XXH_TREE and rows.size:
        xh, mv, rb = _xxh3_hex(), flat.reshape(-1).data, flat.shape[1]
        blocks = [xh(mv[i * rb : (i + block_rows) * rb]) for i in range(0, n, block_rows)]
        return tree_request(blocks, n, block_rows, scheme), blocks
    if scheme in (hashing.BLAKE3, TREE) and rows.size and flat.nbytes <= hashing.PIECE:
        # the same digests as digest_hex, without its per-call array handling
        b3, mv, rb = hashing._blake3(), flat.reshape(-1).data, flat.shape[1]
        blocks = [
            b3(mv[i * rb : (i + block_rows) * rb]).hexdigest() for i in range(0, n, block_rows)
        ]
        if scheme == TREE:
            return tree_request(blocks, n, block_rows), blocks
        return (blocks[0] if len(blocks) == 1 else b3(mv).hexdigest()), blocks
    blocks = [digest_hex(flat[i : i + block_rows], scheme) for i in range(0, n, block_rows)]
    if scheme in TREE_TAGS:
        return tree_request(blocks, n, block_rows, scheme), blocks
    # one block holds every byte of the request: its digest is the request's
    return (blocks[0] if len(blocks) == 1 else digest_hex(flat, scheme)), blocks


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


@dataclass(frozen=True)
class RequestHash:
    """A request's rows at one boundary: digest of all rows, their count, per-block digests."""

    digest: str
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
    digest: str  # of the whole physical tensor, in scheme ``hash``
    row_dims: int | None
    requests: dict[str, RequestHash] = field(default_factory=dict)
    dump: dict[str, Any] | None = None
    leading: list[str] | None = None  # digest of each x[i] along axis 0 (not row-mapped)
    # (batch axis, position axis) of a tensor whose rows are not leading, e.g. attention's
    # (batch, heads, positions, head_dim); row_dims is then None, so older readers that
    # know only leading rows treat it as hashed whole
    row_axes: tuple[int, int] | None = None
    hash: str = hashing.SHA256  # the scheme of every digest of this boundary
    layout: bool = False  # an input declared (or named) as following the batch layout
    step: int = 0  # forward pass (decode step, from 0) of a multi-pass capture
    cache: bool = False  # a KV-cache tensor: per request along its position axis
    # a sliding-window cache, whose slots roll over instead of following positions: hashed
    # whole, judged only between captures that place every request on the same rows
    rolled: bool = False
    # (g, request -> digests) where axis 1 (heads) holds each head copied g times in a row
    kv_repeat: tuple[int, dict[str, RequestHash]] | None = None

    @property
    def np_dtype(self) -> np.dtype:
        """The numpy dtype (bfloat16 and other ml_dtypes types import ml_dtypes)."""
        return _dtypes.from_label(self.dtype)

    @property
    def row_mapped(self) -> bool:
        """Whether its rows map to requests (leading row dims, or batch and position axes)."""
        return self.row_dims is not None or self.row_axes is not None

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one row (the dims after the row-mapped leading ones, or the others)."""
        if self.row_axes is not None:
            return tuple(d for i, d in enumerate(self.shape) if i not in self.row_axes)
        return self.shape[self.row_dims :] if self.row_dims is not None else self.shape

    def physical_rows(self, whole: np.ndarray) -> np.ndarray:
        """The whole tensor as ``(physical row, *row_shape)`` (a copy where axes move)."""
        if self.row_axes is not None:
            whole = np.moveaxis(whole, self.row_axes, (0, 1))
        return whole.reshape((-1, *self.row_shape))


def _kv_repeat(d: Any, key: str) -> tuple[int, dict[str, RequestHash]] | None:
    """A boundary's ``kv_repeat`` entry (repeated heads collapsed), or None."""
    if d is None:
        return None
    reqs = {
        k: RequestHash(str(v[key]), int(v["n_rows"]), [str(b) for b in v["blocks"]])
        for k, v in d["requests"].items()
    }
    return int(d["groups"]), reqs


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


def _axes(v: Any, ndim: int) -> tuple[int, int] | None:
    if v is None:
        return None
    axes = tuple(int(a) for a in v)
    if len(axes) != 2 or not 0 <= axes[0] < axes[1] < ndim:
        raise ValueError(f"row_axes {v!r} for a {ndim}-d tensor")
    return axes[0], axes[1]


def same_scheme(x: Boundary, y: Boundary) -> bool:
    """Whether the two boundaries' digests are of one scheme, hence comparable at all."""
    return x.hash == y.hash


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


def _boundary(i: int, d: dict[str, Any], path: Path, version: int) -> Boundary:
    # version 1 stored bare SHA-256 under "sha256"; version 2 names the scheme ("hash")
    key = "sha256" if version == 1 else "digest"
    scheme = hashing.SHA256 if version == 1 else d.get("hash")
    if scheme not in SCHEMES:
        raise CaptureError(
            f"boundary {i} of {MANIFEST} names hash {scheme!r}; this dmlib knows "
            f"{', '.join(SCHEMES)}",
            path=path,
        )
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
            digest=str(d[key]),
            row_dims=None if d.get("row_dims") is None else int(d["row_dims"]),
            requests={
                k: RequestHash(str(v[key]), int(v["n_rows"]), [str(b) for b in v["blocks"]])
                for k, v in (d.get("requests") or {}).items()
            },
            dump=d.get("dump"),
            leading=None if d.get("leading") is None else [str(h) for h in d["leading"]],
            row_axes=_axes(d.get("row_axes"), len(d["shape"])),
            hash=str(scheme),
            layout=bool(d.get("layout", False)),
            step=int(d.get("step") or 0),
            cache=bool(d.get("cache", False)),
            rolled=bool(d.get("rolled", False)),
            kv_repeat=_kv_repeat(d.get("kv_repeat"), key),
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
        batch = manifest.get("batch")
        self.row_map = (
            RowMap(manifest["row_map"], path=path, batch=batch)
            if manifest.get("row_map") is not None
            else None
        )
        self.boundaries: list[Boundary] = [
            _boundary(i, d, path, int(manifest["version"]))
            for i, d in enumerate(manifest["boundaries"])
        ]
        if self.row_map is not None and self.row_map.batch is None:
            # captures written before the batch size was recorded: the same rule as capture
            seen = {b.shape[0] for b in self.boundaries if (b.row_dims or 0) >= 2}
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


def n_blocks(n_rows: int, block_rows: int) -> int:
    """How many blocks of ``block_rows`` rows ``n_rows`` rows fill (the last one may be short)."""
    return math.ceil(n_rows / block_rows)


__all__ = [
    "Boundary", "Capture", "RowMap", "open_capture", "request_hashes", "digest_hex", "judge_heads",
    "same_scheme", "tree_request", "lift_blake3", "TREE", "XXH_TREE", "TREE_TAGS", "HOST_SCHEMES",
    "dump_files", "FORMAT",
    "VERSION", "SCHEMES", "ROOT", "LAYOUT_INPUTS", "root_label", "is_layout_slot",
]  # fmt: skip
