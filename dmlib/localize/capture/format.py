"""The capture's file format: names, versions, hash schemes and the manifest's boundaries.

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

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dmlib import dtypes as _dtypes
from dmlib import hashing
from dmlib.errors import CaptureError

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


# -- a manifest entry: its keys, its name, its kind --------------------------------------

#: The keys every boundary entry has, in the order the writer writes them.
ENTRY_KEYS = (
    "name", "module", "call", "kind", "slot", "dtype", "shape", "hash", "digest", "row_dims",
    "requests", "dump", "leading",
)  # fmt: skip
#: The keys an entry has only where they apply, in the order they follow :data:`ENTRY_KEYS`:
#: its kind's marker keys (:data:`KINDS`), the decode step (from 1), the row axes, the
#: repeated KV heads, a later pass's per-column digests (``columns``: columns.py).
OPTIONAL_KEYS = (
    "layout", "cache", "rolled", "state", "router", "grad", "param_grad", "recorded", "expert",
    "op", "param", "step", "row_axes", "kv_repeat", "broadcast", "columns",
)  # fmt: skip


_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?:\.|$)")


def layer_of(name: str) -> str | None:
    """The layer index a module name or a cache path names (``model.layers.3.mlp`` and
    ``layers.3.recurrent_states.0``: ``"3"``), None where it names none: a cache's layer
    ``i`` is the model's ``layers.i`` (transformers' ``layer_idx``)."""
    m = _LAYER.search(name)
    return None if m is None else m.group(1)


def boundary_name(module: str, call: int, kind: str, slot: str) -> str:
    """A boundary's name: ``module`` for its first output, else ``module:slot``; ``#call``
    from the second call of that module on (``attn:input.mask#2``)."""
    base = module if (kind == "output" and slot == "output0") else f"{module}:{slot}"
    return base if call == 0 else f"{base}#{call}"


def new_entry(
    module: str,
    call: int,
    kind: str,
    slot: str,
    dtype: str,
    shape: Sequence[int],
    scheme: str,
    extra: dict[str, Any] | None = None,
    step: int = 0,
) -> dict[str, Any]:
    """A boundary's manifest entry as the writer starts it (digests still None, no
    requests yet): :data:`ENTRY_KEYS` in order, then ``extra`` (its kind's marker keys)
    and ``step`` where it is a later forward pass. The reader parses the same keys
    (:meth:`Boundary.from_entry`)."""
    entry: dict[str, Any] = {
        "name": boundary_name(module, call, kind, slot),
        "module": module,
        "call": call,
        "kind": kind,
        "slot": slot,
        "dtype": dtype,
        "shape": list(shape),
        "hash": scheme,
        "digest": None,
        "row_dims": None,
        "requests": {},
        "dump": None,
        "leading": None,
    }
    if extra:
        entry.update(extra)
    if step:
        entry["step"] = step
    return entry


@dataclass(frozen=True)
class BoundaryKind:
    """One kind of boundary a capture records: one row of :data:`KINDS`.

    ``name``: the kind; ``entry_kind``: the entry's ``kind`` field (``input`` or
    ``output``: what every reader, older ones included, reads as the direction);
    ``marker``: the entry key whose presence marks the kind (None: a module boundary, the
    kind of an entry with no marker); ``identity``: how its boundaries are named;
    ``rows``: how they are read per request. ``recorded=False``: reserved, its rules
    settled here, no capture writes it yet.
    """

    name: str
    entry_kind: str
    marker: str | None
    identity: str
    rows: str
    recorded: bool = True


_BY_ROWS = (
    "per request where its leading dims flatten to the row map's rows; else whole, and per "
    "index of axis 0 where that axis may be the batch (a pooled output)"
)
_OP_ROWS = (
    "as a module boundary, or by row axes (0, j) where one later axis has the positions' "
    "size (attention's (batch, heads, positions, head_dim)); a parameter (param) whole"
)
#: Every kind of boundary, the marked ones first (an entry is of the first row whose
#: marker it holds and whose direction it has; a module boundary, the last rows, holds
#: none). A new kind is one row here; the
#: recorder's hook for it, and the comparison's reading of its rows, follow the row.
KINDS: tuple[BoundaryKind, ...] = (
    BoundaryKind("layout", "input", "layout", "module:input.<keyword>#call (a mask, "
                 "positions: LAYOUT_INPUTS)", "whole: follows the batch layout, never "
                 "judged as a request's values"),
    BoundaryKind("cache", "input", "cache", "module:input.<keyword>.layers.<i>.keys|values"
                 "#call (a KV cache entering the module)", "per request along the position "
                 "axis: the prompt's rows by the row map, generated positions by the one "
                 "request filling the batch row; a sliding-window layer (rolled) whole"),
    BoundaryKind("op-input", "input", "op", "module/<op>#k:input<i> (the op's id as its "
                 "module, k counting that op's calls in the module)", _OP_ROWS),
    BoundaryKind("op-output", "output", "op", "module/<op>#k, module/<op>#k:output<i>",
                 _OP_ROWS),
    # reserved: the kinds to come, their rules settled first
    BoundaryKind("state", "output", "state", "root:state.<path in the cache>#pass: a tensor "
                 "the forward pass leaves in its cache (KV keys/values, linear-attention and "
                 "Mamba conv/recurrent states), recorded after each pass",
                 "keys/values (batch, heads, positions, dim) per request along positions as a "
                 "cache (a sliding window whole); any other state per request by its batch "
                 "row (one state per sequence: leading), never per position"),
    BoundaryKind("router", "output", "router", "module:router.indices#call (an MoE "
                 "router's chosen expert ids, (tokens, k)), module:router.margin#call (per "
                 "token the lowest chosen and the highest other score): routers.py",
                 "per request by leading dims (one decision per token), always dumped"),
    BoundaryKind("grad_output", "output", "grad", "module:grad_output<i>#call: the "
                 "gradient reaching a module's output in the backward pass", "as the "
                 "output it is the gradient of"),
    BoundaryKind("grad_input", "input", "grad", "module:grad_input<i>#call: the gradient a "
                 "module's backward gives its input", "as the input it is the gradient "
                 "of"),
    BoundaryKind("param_grad", "output", "param_grad", "<parameter name>:grad#k: a "
                 "parameter's .grad at the end of the k-th backward pass (accumulated over "
                 "the passes before it): backward.py", "whole (a parameter's first axis is "
                 "no batch)"),
    BoundaryKind("recorded", "output", "recorded", "<name>#call: a value handed to "
                 "dmlib.record(name, tensor) outside any module", "per request where its "
                 "leading dims fit the row map, else whole: record.py"),
    BoundaryKind("expert", "output", "expert", "module:expert<e>.<stage>#call: the rows one "
                 "expert of an experts module computed in a call (stage gate_up_proj or "
                 "down_proj), one SHA-256 digest per routed token: expertrows.py",
                 "per request by position: the tokens routed to expert e, each through the row "
                 "map (a decode step: the batch row the request fills alone); kept in the "
                 "entry's expert.rows, never dumped"),
    # a module boundary: an entry with no marker
    BoundaryKind("module-input", "input", None, "module:input<i>#call, "
                 "module:input.<keyword>#call", _BY_ROWS),
    BoundaryKind("module-output", "output", None, "module#call (the first output), "
                 "module:output<i>#call", _BY_ROWS),
)  # fmt: skip
_KIND_NAMES = {k.name: k for k in KINDS}


def kind_named(name: str) -> BoundaryKind:
    """The row of :data:`KINDS` named ``name`` (KeyError for another)."""
    return _KIND_NAMES[name]


def kind_of(x: Mapping[str, Any] | Boundary) -> BoundaryKind:
    """The kind of a manifest entry or a :class:`Boundary`: the first row of :data:`KINDS`
    whose marker it holds (a true value) and whose direction (``kind``) it has."""
    get = x.get if isinstance(x, Mapping) else (lambda key: getattr(x, key, None))
    direction = get("kind")
    for row in KINDS:
        if row.entry_kind == direction and (row.marker is None or get(row.marker)):
            return row
    raise ValueError(f"boundary kind {direction!r}; expected 'input' or 'output'")


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
    # a state the forward pass left behind (its cache after the pass): KINDS' "state"
    state: bool = False
    # an MoE router's decision (chosen expert ids, or the margin of the choice): "router"
    router: bool = False
    grad: bool = False  # a gradient in the backward pass: "grad_output", "grad_input"
    param_grad: bool = False  # a parameter's .grad after a backward pass: "param_grad"
    recorded: bool = False  # a value handed to dmlib.record(): "recorded"
    # per position, broadcast over the batch (rotary cos/sin, [1, L, d] or [L, d]): each
    # request's digests are of its positions' rows, judged by position
    broadcast: bool = False
    # (g, request -> digests) where axis 1 (heads) holds each head copied g times in a row
    kv_repeat: tuple[int, dict[str, RequestHash]] | None = None
    # one expert's rows (KINDS' "expert"): {"index": e, "stage": str, "rows": {request:
    # {position: sha256 hex}}}, the positions those routed to expert e in this call
    expert: dict[str, Any] | None = None
    op: str | None = None  # an op boundary: the op's id (``module/aten.addmm#0``)
    param: str | None = None  # an op's input that is a parameter or buffer: its name
    # (scheme, per batch row: its columns along axis 1 as a request's rows, one block per
    # column) of a later pass's (batch, n > 1, ...) tensor captured with block_rows=1
    columns: tuple[str, list[RequestHash]] | None = None

    @property
    def category(self) -> BoundaryKind:
        """This boundary's row of :data:`KINDS` (module input or output, op, cache...)."""
        return kind_of(self)

    @classmethod
    def from_entry(cls, i: int, d: dict[str, Any], path: Path, version: int) -> Boundary:
        """Boundary ``i`` of a manifest of ``version`` from its entry ``d`` (the reader).

        Raises
        ------
        CaptureError
            Naming the manifest and the boundary: an unknown hash scheme, a missing or
            malformed field.
        """
        return _boundary(i, d, path, version)

    def to_entry(self) -> dict[str, Any]:
        """The manifest entry the writer writes for this boundary (version 4): the keys of
        :data:`ENTRY_KEYS` in order, then those of :data:`OPTIONAL_KEYS` it has."""
        d = new_entry(self.module, self.call, self.kind, self.slot, self.dtype, self.shape,
                      self.hash, _optional_head(self), self.step)  # fmt: skip
        d["name"], d["digest"], d["row_dims"] = self.name, self.digest, self.row_dims
        d["requests"] = {r: _request_dict(h) for r, h in self.requests.items()}
        d["dump"], d["leading"] = self.dump, self.leading
        if self.row_axes is not None:
            d["row_axes"] = list(self.row_axes)
        if self.kv_repeat is not None:
            g, reqs = self.kv_repeat
            d["kv_repeat"] = {
                "groups": g,
                "requests": {r: _request_dict(h) for r, h in reqs.items()},
            }
        if self.broadcast:
            d["broadcast"] = True
        if self.columns is not None:
            d["columns"] = {"hash": self.columns[0],
                            "rows": [_request_dict(h) for h in self.columns[1]]}  # fmt: skip
        return d

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


def _request_dict(h: RequestHash) -> dict[str, Any]:
    return {"digest": h.digest, "n_rows": h.n_rows, "blocks": list(h.blocks)}


def _optional_head(b: Boundary) -> dict[str, Any]:
    """The marker keys of ``b``'s kind as the writer adds them (before ``step``)."""
    extra: dict[str, Any] = {}
    for key in ("layout", "cache", "rolled", "state", "router", "grad", "param_grad", "recorded"):
        if getattr(b, key):
            extra[key] = True
    if b.expert is not None:
        rows = b.expert["rows"]
        extra["expert"] = {
            "index": b.expert["index"],
            "stage": b.expert["stage"],
            "rows": {r: [[p, d] for p, d in v.items()] for r, v in rows.items()},
        }
    if b.op is not None:
        extra["op"] = b.op
        if b.param is not None:
            extra["param"] = b.param
    return extra


def _kv_repeat(d: Any, key: str) -> tuple[int, dict[str, RequestHash]] | None:
    """A boundary's ``kv_repeat`` entry (repeated heads collapsed), or None."""
    if d is None:
        return None
    reqs = {
        k: RequestHash(str(v[key]), int(v["n_rows"]), [str(b) for b in v["blocks"]])
        for k, v in d["requests"].items()
    }
    return int(d["groups"]), reqs


def _columns(d: Any) -> tuple[str, list[RequestHash]] | None:
    """A boundary's ``columns`` entry (a later pass's per-column digests), or None."""
    if d is None:
        return None
    rows = [RequestHash(str(v["digest"]), int(v["n_rows"]), [str(b) for b in v["blocks"]])
            for v in d["rows"]]  # fmt: skip
    return str(d["hash"]), rows


def _expert(v: Any) -> dict[str, Any] | None:
    """An ``expert`` entry read back: ``{"index", "stage", "rows": {request: {position:
    digest}}}`` (ValueError / TypeError / KeyError on anything else: the reader's
    CaptureError). The manifest keeps each request's rows as ``[position, digest]`` pairs."""
    if v is None:
        return None
    index, stage = v["index"], v["stage"]
    if type(index) is not int or index < 0 or not isinstance(stage, str):
        raise ValueError(f"expert index {index!r} / stage {stage!r}")
    rows: dict[str, dict[int, str]] = {}
    for r, pairs in v["rows"].items():
        got: dict[int, str] = {}
        for p, dg in pairs:
            if type(p) is not int or p < 0 or p in got or not isinstance(dg, str):
                raise ValueError(f"expert row {p!r} of request {r!r}")
            got[p] = dg
        rows[str(r)] = got
    return {"index": index, "stage": stage, "rows": rows}


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
            state=bool(d.get("state", False)),
            router=bool(d.get("router", False)),
            grad=bool(d.get("grad", False)),
            param_grad=bool(d.get("param_grad", False)),
            recorded=bool(d.get("recorded", False)),
            broadcast=bool(d.get("broadcast", False)),
            kv_repeat=_kv_repeat(d.get("kv_repeat"), key),
            expert=_expert(d.get("expert")),
            op=None if d.get("op") is None else str(d["op"]),
            param=None if d.get("param") is None else str(d["param"]),
            columns=_columns(d.get("columns")),
        )
    except (KeyError, TypeError, ValueError) as err:
        raise CaptureError(
            f"boundary {i} of {MANIFEST} is malformed ({err!r})", path=path
        ) from None
