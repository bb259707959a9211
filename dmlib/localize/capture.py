"""Record what enters and leaves named torch modules during one forward pass.

``with dmlib.capture(model, path, row_map=...): model(x)`` installs forward hooks,
hashes every boundary tensor (whole, and per logical request in blocks of positions),
optionally dumps selected boundaries in full, and writes ``path/manifest.json`` last.
Hooks return nothing and only read: each tensor is detached and never written, so the
model's outputs are unchanged.

Where the time goes, and what is done about it (``benchmarks/bench_capture.py``):

- Host tensors are hashed with XXH3-128 (``xxh3-128-tree-v1``, format version 4: about
  ten times BLAKE3's speed, which ``hash="blake3"`` keeps) in the hook, on the tensor's
  own memory: at 55 GB/s hashing costs less than the private copy a worker thread would
  need (a later in-place op may change the memory). With BLAKE3, tensors over 1 MiB are
  copied and hashed on worker threads while the forward pass goes on. A request that
  fits in one block is hashed once: its block's bytes are all of its bytes. A tensor is
  made contiguous once and every digest (whole, per batch row, per request and block) is
  taken from byte offsets into that buffer. A request's digest is derived from its
  blocks' digests (a hash tree, since format version 3), so each byte is hashed twice
  (whole tensor, blocks), no longer three times; the whole tensor stays a plain digest,
  comparable whatever the row maps.
- Every digest of one boundary (whole, per index of axis 0, each request's blocks and tree
  digest, the requests' dicts) comes from one call into the compiled module on the
  tensor's own memory (:func:`dmlib.kernels.treehash.hash_boundary`; the Python loop where
  it is not built): per block, the interpreter's slice, hash object and hex string cost
  more than hashing a few KiB. XXH3-128 is called there without a Python call per digest
  (the xxhash package's exported ``XXH3_128bits_dispatch``, its AVX2/AVX-512 entry, checked
  against its own function first). An op's tensor read by row axes (attention's ``(batch,
  heads, positions, head_dim)``) is hashed on a view whose rows are in C order where they
  are (a ``transpose(1, 2)`` of ``(batch, positions, ...)``), else on one copy gathered in C.
- How a tensor of a given shape is read (row dims, row axes, per-index digests) is worked
  out once per capture; a row map's requests, JSON text and KV-cache row plans once per row
  map, kept for the next captures of that layout (:meth:`RowMap.shared`); the manifest's entries
  are written by the compiled JSON writer in one call (:func:`dmlib.kernels.jsonenc.
  compact_lines`, the text ``json.dumps`` writes; the digests several boundaries share are
  written once and copied); a manifest is replaced after the old one is removed (ext4
  writes out a file renamed over another at once: 0.3 ms a manifest).
- An op's output over the memory of one of its inputs (a view, ``_unsafe_view``) takes the
  input's digests when the op writes nothing (its ATen schema says so); the output of an
  op that may write is always hashed (inside the dispatch, torch has not yet bumped the
  version counter of what it wrote).
- One tensor object passed on unchanged (a block's output is the next block's input, the
  input of query, key and value) is hashed, copied and dumped once: a boundary that
  records the same live tensor object at the same version counter (torch bumps it on
  every in-place write) takes the first recording's digests and dump file.
- Device tensors are checksummed where they live (``cksum4-v1``, torch integer ops):
  three sums per row cross to the host, which assembles every digest from them, and
  nothing else is copied unless dumped. Where the device checksum cannot be taken (a row
  of an odd number of bytes, an op the device lacks), the host hash of a copy is the
  fallback; each boundary names the scheme it was hashed with.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import json
import os
import stat
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import numpy as np

from dmlib import _atomic, hashing
from dmlib.errors import CaptureError, MissingDependencyError
from dmlib.kernels import jsonenc, treehash
from dmlib.kernels.treehash import request_blocks
from dmlib.localize.captures import (
    FORMAT,
    HOST_SCHEMES,
    LAYOUT_INPUTS,
    MANIFEST,
    REQUEST_PREFIX,
    TENSOR_DIR,
    TREE_TAGS,
    VERSION,
    WHOLE_KEY,
    XXH_TREE,
    RowMap,
    digest_hex,
    is_layout_slot,
    request_hashes,
    root_label,
    tree_request,
)
from dmlib.localize.ops import OpRecorder, quiet

try:
    import torch
except ImportError:  # pragma: no cover - reading captures needs no torch; writing does
    torch = None  # type: ignore[assignment]


MAX_PENDING_BYTES = 512 << 20  # tensor copies waiting to be hashed, at most
_MEMO_PLANS = 32  # KV-cache row plans kept with a row map between captures, at most
_UNSET: Any = object()
_PERMS: dict[tuple[int, tuple[int, int]], tuple[int, ...]] = {}  # (ndim, row axes) -> order


def _axes_first(ndim: int, axes: tuple[int, int]) -> tuple[int, ...]:
    """The transpose that moves ``axes`` to the front, the other axes after them in order
    (``np.moveaxis(x, axes, (0, 1))``), worked out once per (ndim, axes)."""
    order = _PERMS.get((ndim, axes))
    if order is None:
        order = _PERMS[(ndim, axes)] = (*axes, *(i for i in range(ndim) if i not in axes))
    return order


INLINE_BYTES = 1 << 20  # host tensors up to this size are hashed in the hook, uncopied
# ... of any size with XXH3: it reads 55 GB/s (two passes: whole and blocks), a private copy
# for a worker is made at a few GB/s (a 2.2 MiB MLP activation: ~80 us hashed in place,
# 200-500 us copied, measured), so the copy costs more than the hashing it hands over
INLINE_BYTES_XXH3 = sys.maxsize
_LAYOUT_HITS: dict[tuple[Any, ...], bool] = {}  # (patterns, module, slot) -> layout input?
# json.dumps(..., separators=...) without building an encoder per call
_COMPACT = json.JSONEncoder(separators=(",", ":"))
# what the in-progress marker keeps of the manifest
_MARKER_KEYS = ("format", "version", "complete", "hash", "block_rows", "root", "metadata", "error")
# _COMPACT.encode builds its C encoder anew on every call (~5 us, once per boundary): one
# built once, with the same settings (no circular-reference check: a manifest entry is
# plain data dmlib built), gives the same text; CPython always has the C accelerator
_C_ENCODER = getattr(json.encoder, "c_make_encoder", None)
if _C_ENCODER is not None:
    _C_ENCODER = _C_ENCODER(None, _COMPACT.default, json.encoder.encode_basestring_ascii, None,
                            ":", ",", False, False, True)  # fmt: skip


def _encode_compact(obj: Any) -> str:
    """``_COMPACT.encode(obj)``: in one compiled call for plain data (every manifest entry
    dmlib builds), else with the json module's encoder, built once."""
    text = jsonenc.compact(obj)
    if text is not None:
        return text
    if _C_ENCODER is None:  # pragma: no cover
        return _COMPACT.encode(obj)
    return "".join(_C_ENCODER(obj, 0))


# how every manifest dmlib writes begins (json.dumps and _COMPACT alike: no space)
_HEAD = f'{{"format":"{FORMAT}",'.encode()


def _require_torch() -> None:
    if torch is None:
        raise MissingDependencyError("dmlib.capture needs torch: pip install 'dmlib[torch]'")


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    """A CPU numpy array with the tensor's exact bytes (bf16/f8 through ml_dtypes).

    ml_dtypes (over a second to import) is imported only for a tensor that needs it.
    """
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj() or t.is_neg():  # a lazy view (x.conj(), its .imag): its values, made
        t = t.resolve_conj().resolve_neg()
    t = t.contiguous()
    if t.dtype in _SPECIAL:
        from dmlib import dtypes

        view, name = _SPECIAL[t.dtype]
        return t.view(view).numpy().view(getattr(dtypes, name))
    return t.numpy()


def _host_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as numpy: a view with its strides for a host tensor of a numpy
    dtype (no copy), else :func:`_to_numpy`'s contiguous copy."""
    if t.is_cpu and t.dtype not in _SPECIAL and not t.requires_grad:
        try:
            return t.numpy()
        except (RuntimeError, TypeError):  # (a tensor with its negative bit set, say)
            pass
    return _to_numpy(t)


_SPECIAL: dict[Any, tuple[Any, str]] = (
    {}
    if torch is None
    else {
        torch.bfloat16: (torch.int16, "BFLOAT16"),
        torch.float8_e4m3fn: (torch.int8, "FLOAT8_E4M3FN"),
        torch.float8_e5m2: (torch.int8, "FLOAT8_E5M2"),
    }
)


_NP_DTYPES: dict[Any, np.dtype] = {}
_NP_NAMES: dict[Any, str] = {}  # numpy's dtype.name is computed in Python on every call


def _np_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype :func:`_to_numpy` gives a tensor of this torch dtype."""
    if dtype not in _NP_DTYPES:
        _NP_DTYPES[dtype] = _to_numpy(torch.empty(0, dtype=dtype)).dtype
    return _NP_DTYPES[dtype]


def _device_checksums(
    t: Any,
    k: int | None,
    axes: tuple[int, int] | None,
    leading: bool,
    row_map: RowMap | None,
    block_rows: int,
) -> tuple[str, list[str] | None, dict[str, Any] | None]:
    """``cksum4-v1`` digests (whole, per index of axis 0, per request) of a device tensor.

    The same bytes and the same rules as the host path (:meth:`Recorder._hash`): the whole
    tensor in C order, a request's rows in position order and its blocks of
    ``block_rows`` rows. Three sums per row are taken where the tensor lives
    (:func:`dmlib.hashing.row_moments_torch`, one transfer of a few bytes per row); every
    digest is assembled from them on the host. ValueError where a row has an odd number
    of bytes.
    """
    size = t.element_size()
    t = t.contiguous()
    lead_rows = t.reshape((int(t.shape[0]) if t.dim() else 1, -1))
    m_lead = hashing.row_moments_torch(lead_rows)
    lead_bytes = int(lead_rows.shape[1]) * size
    whole = _ck(m_lead, lead_bytes)
    lead = [_ck(m_lead[i : i + 1], lead_bytes) for i in range(len(m_lead))] if leading else None
    if row_map is None or (k is None and axes is None):
        return whole, lead, None
    if axes is not None:
        rows = t.movedim(axes, (0, 1)).reshape((len(row_map), -1))
        m = hashing.row_moments_torch(rows)
    elif k == 1:
        rows, m = lead_rows, m_lead
    else:
        rows = t.reshape((len(row_map), -1))
        m = hashing.row_moments_torch(rows)
    row_bytes = int(rows.shape[1]) * size
    requests: dict[str, Any] = {}
    for rid, idx in row_map.requests.items():
        mine = m[idx]
        blocks = [_ck(mine[i : i + block_rows], row_bytes) for i in range(0, len(idx), block_rows)]
        digest = blocks[0] if len(blocks) == 1 else _ck(mine, row_bytes)
        requests[rid] = {"digest": digest, "n_rows": int(len(idx)), "blocks": blocks}
    return whole, lead, requests


def _b3_hex(b3: Any, mv: memoryview, scheme: str) -> str:
    """``digest_hex`` of a byte slice: the plain BLAKE3 digest up to one piece."""
    return b3(mv).hexdigest() if mv.nbytes <= hashing.PIECE else digest_hex(mv, scheme)


def _leaf_hasher(scheme: str) -> Callable[[memoryview], str]:
    """The hex digest of a byte slice in a host ``scheme`` (its tree's leaf digest)."""
    if scheme == XXH_TREE:
        return cast("Callable[[memoryview], str]", hashing.xxh3_128().xxh3_128_hexdigest)
    b3 = hashing._blake3()
    return lambda mv: _b3_hex(b3, mv, scheme)


def _tree_args(scheme: str) -> tuple[Any, bytes, int, int]:
    """(hasher, tree tag, piece, digest size) of a tree ``scheme`` for the compiled loop."""
    if scheme == XXH_TREE:  # XXH3 digests any length in one piece
        digest = hashing.xxh3_128().xxh3_128_digest
        treehash.direct_xxh3(digest)  # the compiled loop calls XXH3 itself where it can
        return digest, TREE_TAGS[scheme], sys.maxsize, 16
    return hashing._blake3(), TREE_TAGS[scheme], hashing.PIECE, 32


def _repeat_groups(bits: Any, same: Callable[[Any, Any], bool]) -> int:
    """``g > 1`` where each run of ``g`` consecutive heads (axis 1) is one head copied, else 1.

    ``bits``: an integer view of ``(batch, heads, ...)`` (numpy or torch), so that the
    copies are compared bit for bit; ``same``: that library's whole-array equality.
    """
    h = int(bits.shape[1])
    if h < 2 or not same(bits[:, 0], bits[:, 1]):
        return 1  # the common case (distinct heads), settled by one comparison
    g = 2
    while g < h and same(bits[:, 0], bits[:, g]):
        g += 1
    while g > 1 and h % g:
        g -= 1
    grouped = bits.reshape(bits.shape[0], h // g, g, *bits.shape[2:])
    return g if g > 1 and bool((grouped == grouped[:, :, :1]).all()) else 1


def _ck(moments: np.ndarray, row_bytes: int) -> str:
    return hashing.checksum_of_rows(moments, row_bytes).split(":", 1)[1]


def _tensors(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(slot, tensor) for every tensor in a nested output/argument structure."""
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, (tuple, list)):
        for i, o in enumerate(obj):
            yield from _tensors(
                o, f"{prefix}{i}" if prefix.endswith(("input", "output")) else f"{prefix}.{i}"
            )
    elif isinstance(obj, dict):
        for k, o in obj.items():
            yield from _tensors(o, f"{prefix}.{k}")


#: keyword names under which a tuple of past (key, value) tensors is a KV cache
CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "past", "cache")


def is_cache(obj: Any) -> bool:
    """A transformers ``Cache`` (``DynamicCache``, ``StaticCache``...), by its shape only."""
    return (
        not isinstance(obj, (dict, tuple, list))
        and not torch.is_tensor(obj)
        and (
            isinstance(getattr(obj, "layers", None), list)
            or hasattr(obj, "self_attention_cache")
            or isinstance(getattr(obj, "key_cache", None), list)
        )
    )


def _cache_tensors(obj: Any, prefix: str) -> Iterator[tuple[str, Any, bool]]:
    """(slot, tensor, rolled) of each layer's keys and values in a KV cache (empty left out).

    A ``Cache`` object as ``prefix.layers.{i}.keys`` / ``.values``; a tuple of past
    (key, value) pairs as ``prefix.{i}.0`` / ``.1``. A static layer (preallocated
    ``max_cache_len`` positions, filled in place) gives its filled positions only, as a
    dynamic one holds them; a sliding-window static layer, whose positions roll over,
    is ``rolled``: hashed whole, not per request.
    """
    if torch.is_tensor(obj):
        if obj.numel():
            yield prefix, obj, False
    elif isinstance(obj, (tuple, list)):
        for i, o in enumerate(obj):
            yield from _cache_tensors(o, f"{prefix}.{i}")
    elif hasattr(obj, "self_attention_cache"):  # an EncoderDecoderCache
        for part in ("self_attention_cache", "cross_attention_cache"):
            yield from _cache_tensors(getattr(obj, part, None), f"{prefix}.{part}")
    elif isinstance(getattr(obj, "layers", None), list):
        for i, layer in enumerate(obj.layers):
            for part in ("keys", "values"):
                t = getattr(layer, part, None)
                if torch.is_tensor(t) and t.numel():
                    t, rolled = _filled(layer, t)
                    if t.numel():
                        yield f"{prefix}.layers.{i}.{part}", t, rolled
    elif isinstance(getattr(obj, "key_cache", None), list):  # older transformers
        for part in ("key_cache", "value_cache"):
            for i, t in enumerate(getattr(obj, part, None) or []):
                if torch.is_tensor(t) and t.numel():
                    yield f"{prefix}.{part}.{i}", t, False


def _filled(layer: Any, t: Any) -> tuple[Any, bool]:
    """A cache layer's keys or values cut to the positions it holds; (tensor, rolled)."""
    if getattr(layer, "max_cache_len", None) is None or t.dim() != 4:
        return t, False  # a dynamic layer: every position it holds is filled
    if getattr(layer, "is_sliding", False):
        return t, True
    n = int(layer.get_seq_length()) if hasattr(layer, "get_seq_length") else int(t.shape[2])
    return t[:, :, : min(n, int(t.shape[2]))], False


#: argument types that hold no tensor: skipped before any slot name is made
_SCALARS = (type(None), bool, int, float, str)


def _inputs(args: Any, kwargs: dict[str, Any]) -> Iterator[tuple[str, Any, bool | str]]:
    """(slot, tensor, kind) for a module call's inputs: False, a KV-cache tensor (True),
    or one of a rolling cache (``"rolled"``)."""
    tensor = torch.Tensor
    for i, a in enumerate(args):
        if type(a) is tensor:  # the common case, without the walk
            yield f"input{i}", a, False
        elif isinstance(a, _SCALARS):
            continue
        elif is_cache(a):
            for slot, t, rolled in _cache_tensors(a, f"input{i}"):
                yield slot, t, "rolled" if rolled else True
        else:
            for slot, t in _tensors(a, f"input{i}"):
                yield slot, t, False
    for k, v in kwargs.items():
        if type(v) is tensor:
            yield f"input.{k}", v, False
        elif isinstance(v, _SCALARS):
            continue
        elif is_cache(v) or (k in CACHE_KWARGS and isinstance(v, (tuple, list))):
            for slot, t, rolled in _cache_tensors(v, f"input.{k}"):
                yield slot, t, "rolled" if rolled else True
        else:
            for slot, t in _tensors(v, f"input.{k}"):
                yield slot, t, False


def default_modules(model: torch.nn.Module, named: dict[str, Any] | None = None) -> list[str]:
    """Leaf modules plus top-level blocks: the root's children and ModuleList/Sequential items.

    ``named``: ``dict(model.named_modules())``, where the caller has it already.
    """
    named = dict(model.named_modules()) if named is None else named
    lists = (torch.nn.ModuleList, torch.nn.Sequential)
    containers = {n for n, m in named.items() if isinstance(m, lists)}
    names = []
    for name, m in named.items():
        if name == "" or isinstance(m, lists):
            continue
        parent = name.rpartition(".")[0]
        if next(m.children(), None) is None or "." not in name or parent in containers:
            names.append(name)
    return names


def _select(
    model: torch.nn.Module,
    modules: str | Iterable[str] | None,
    named: dict[str, Any] | None = None,
) -> list[tuple[str, Any]]:
    named = dict(model.named_modules()) if named is None else named
    odd = [n for n in named if any(c in n for c in ":#/")]
    if odd:
        # boundary names are module:slot#call and op ids module/op#k: these would be ambiguous
        raise CaptureError(
            f"module name {odd[0]!r} holds ':', '#' or '/', which boundary names use as "
            "separators; rename the submodule"
        )
    if modules is None:
        chosen = default_modules(model, named)
    else:
        patterns = [modules] if isinstance(modules, str) else list(modules)
        chosen = [n for n in named if n and any(fnmatch.fnmatchcase(n, p) for p in patterns)]
        if "" in patterns:
            chosen.insert(0, "")
        if not chosen:
            raise CaptureError(f"no module matches {patterns}; modules are e.g. {list(named)[1:6]}")
    return [(n, named[n]) for n in chosen]


class Recorder:
    """What a capture accumulates; returned by ``with dmlib.capture(...) as rec``."""

    def __init__(
        self,
        path: Path,
        *,
        row_map: RowMap | None,
        block_rows: int,
        dump: list[str],
        dump_requests: set[str] | None,
        metadata: dict[str, Any],
        hash_threads: int = 2,
        device_hash: bool = True,
        root: str = "(model)",
        layout_inputs: Sequence[str] = LAYOUT_INPUTS,
        scheme: str = XXH_TREE,
    ) -> None:
        self.path = path
        self.root = root  # the label of the hooked model itself
        self.layout_inputs = tuple(layout_inputs)
        self.step = 0  # forward passes of the model begun before this one (decode step)
        # BLAKE3 and SHA-256 release the GIL, so boundaries are hashed (and dumped) on
        # worker threads while the forward pass goes on; each works on a private copy of
        # the tensor, taken in the hook, because a later in-place op may change the
        # module's output after the hook returns.
        # writing a dump mostly waits on the disk (fsync): two more threads hide that wait
        # (made at the first tensor handed over: most captures hash every tensor in the hook)
        self._workers = hash_threads + (2 if dump else 0) if hash_threads > 0 else 0
        self._inline = INLINE_BYTES_XXH3 if scheme == XXH_TREE else INLINE_BYTES
        self._pool: ThreadPoolExecutor | None = None
        self._pending: collections.deque[tuple[Future[None], int]] = collections.deque()
        self._pending_bytes = 0
        self.row_map = row_map
        self.block_rows = block_rows
        self.dump = dump
        self.dump_requests = dump_requests
        self.metadata = metadata
        if scheme not in TREE_TAGS:
            raise CaptureError(f"host hash scheme {scheme!r}; expected one of {sorted(TREE_TAGS)}")
        self.scheme = scheme  # the host's hash
        self._leaf = _leaf_hasher(scheme)  # a byte slice's hex digest in it
        # (hasher, tree tag, piece, digest size) of the compiled block loop, looked up once
        self._tree_args = _tree_args(scheme)
        self.device_hash = device_hash
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
        self._plan: list[tuple[str, np.ndarray, tuple[int, int] | None]] | None = None
        self._spans: dict[str, tuple[int, int]] | None = None
        # (request, first row, rows) of the requests on consecutive rows; the others
        self._span_list: list[tuple[str, int, int]] | None = None
        self._gathered: list[tuple[str, np.ndarray]] = []
        # (shape, row-mapped, op, decode step, layout) -> how such a tensor is read
        self._row_plans: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        # KV-cache shape -> its rows per request (the row map and layout are fixed once set)
        self._cache_plans: dict[tuple[Any, ...], Any] = {}

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
        suffix = "" if call == 0 else f"#{call}"
        name = f"{module}:{slot}{suffix}"
        key = self._identity(t, ("cache", len(rows[0])))
        first = self._seen.get(key) if key is not None else None
        if first is not None and first[0]() is t:  # this layer's cache, unchanged since
            same = first[1]
            entry = dict(same, name=name, module=module, call=call, slot=slot)
        else:
            arr = treehash.contiguous(_host_view(t))
            # (batch, positions, heads, head_dim): one row per (batch row, position)
            flat = treehash.contiguous(arr.transpose(0, 2, 1, 3)).reshape(len(rows[0]), -1)
            requests = self._row_set_digests(flat, rows[1])
            entry = {
                "name": name, "module": module, "call": call, "kind": "input", "slot": slot,
                "dtype": arr.dtype.name, "shape": list(arr.shape), "hash": self.scheme,
                "digest": digest_hex(arr, self.scheme), "row_dims": None,
                "requests": requests, "dump": None, "leading": None, "cache": True,
            }  # fmt: skip
            if key is not None:
                self._seen[key] = (weakref.ref(t), entry)
        entry.pop("step", None)
        if self.step:
            entry["step"] = self.step
        self.boundaries.append(entry)
        return name

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

    def _cache_rows(self, shape: tuple[int, ...]) -> tuple[list[Any], dict[str, list[int]]] | None:
        """(entry per flattened (batch, position) row, request -> its rows in order), once
        per shape and layout."""
        key = ("cache", shape, self.row_map.batch if self.row_map else None, self.layout)
        # kept with the row map (what a shape's rows are follows from it, the batch and the
        # layout), a few dozen at most: a long generate() makes one per decode step, kept
        # only for this capture
        memo = {} if self.row_map is None else self.row_map._memo
        plan = memo.get(key, self._cache_plans.get(key, _UNSET))
        if plan is _UNSET:
            plan = self._cache_rows_of(shape)
            (memo if len(memo) < _MEMO_PLANS else self._cache_plans)[key] = plan
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
        entry = self._entry(module, call, kind, slot, t.dtype, shape, extra)
        name = entry["name"]
        k, axes = self._read_rows(entry, shape, row_mapped, bool(extra))
        wants_dump = self._wants_dump(name)
        self.boundaries.append(entry)
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
        """A boundary's manifest entry, digests still to be filled."""
        suffix = "" if call == 0 else f"#{call}"
        name = (module if (kind == "output" and slot == "output0") else f"{module}:{slot}") + suffix
        entry: dict[str, Any] = {
            "name": name,
            "module": module,
            "call": call,
            "kind": kind,
            "slot": slot,
            "dtype": _NP_NAMES.get(dtype) or _NP_NAMES.setdefault(dtype, _np_dtype(dtype).name),
            "shape": list(shape),
            "hash": self.scheme,
            "digest": None,
            "row_dims": None,
            "requests": {},
            "dump": None,
            "leading": None,
            **(extra or {}),
        }
        if self.step:
            entry["step"] = self.step
        return entry

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
            self._seen[key] = (weakref.ref(original), entry)
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

    def _wait_oldest(self) -> None:
        fut, nbytes = self._pending.popleft()
        self._pending_bytes -= nbytes
        fut.result()

    def finish(self) -> None:
        """Wait for every pending hash (re-raising a worker's error) and stop the workers."""
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

    def _dump_plan(self, index: int, per_request: bool) -> dict[str, Any]:
        """The manifest's ``dump`` entry of boundary ``index`` (the file is written later)."""
        (self.path / TENSOR_DIR).mkdir(exist_ok=True)
        rel = f"{TENSOR_DIR}/{index:05d}.safetensors"
        if not per_request or self.dump_requests is None or self.row_map is None:
            return {"file": rel, "whole": True}
        wanted = [r for r in self.row_map.requests if r in self.dump_requests]
        return {"file": rel, "whole": False, "requests": wanted}

    def _write_dump(self, plan: dict[str, Any], arr: np.ndarray, rows: np.ndarray | None) -> None:
        from dmlib.io.safetensors import write_safetensors

        if plan["whole"]:
            write_safetensors(self.path / plan["file"], {WHOLE_KEY: arr})
            return
        requests = cast(RowMap, self.row_map).requests
        write_safetensors(
            self.path / plan["file"],
            {
                REQUEST_PREFIX + r: np.ascontiguousarray(cast(np.ndarray, rows)[requests[r]])
                for r in plan["requests"]
            },
        )

    def manifest(self, *, complete: bool, error: str | None = None) -> dict[str, Any]:
        """The manifest as a dict: format, version, ``complete``, the host's hash scheme, the
        capture's settings and row map, metadata and boundaries; ``ops`` and ``error`` if any.
        """
        row_map = None if self.row_map is None else self.row_map.to_json()
        return {**self._settings(complete), "row_map": row_map, **self._contents(error),
                "boundaries": self.boundaries}  # fmt: skip

    def _settings(self, complete: bool) -> dict[str, Any]:
        """The manifest's keys before the row map."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "complete": complete,
            "hash": self.scheme,  # the host's scheme; each boundary names its own
            "block_rows": self.block_rows,
            "root": self.root,
            "layout_inputs": list(self.layout_inputs),
        }

    def _contents(self, error: str | None) -> dict[str, Any]:
        """The manifest's keys after the row map, but the boundaries."""
        m: dict[str, Any] = {
            "batch": None if self.row_map is None else self.row_map.batch,
            "whole_only": self.whole_only,
            "metadata": self.metadata,
        }
        if self.ops is not None:
            m["ops"] = self.ops
        if error is not None:
            m["error"] = error
        return m

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
        mapped = [b for b in self.boundaries if b["row_dims"] is not None]
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

    def write_manifest(
        self, *, complete: bool, error: str | None = None, durable: bool = True
    ) -> None:
        """Write ``manifest.json``, atomically (a temporary file renamed into place).

        It is fsynced before the rename only where the capture wrote dump files (they
        are durable before a manifest vouches for them; their writer syncs them). A
        manifest that describes no file but itself needs no fsync: after a crash the
        folder holds the in-progress marker, an empty or a cut file, each of which a
        reader refuses, or the complete manifest (measured: 0.2 to 0.7 ms saved per
        capture). ``durable=False``: the in-progress marker, never fsynced.
        """
        if not durable:
            # what the capture is, and that it is not finished: no row map, no boundaries
            # (a reader refuses it whatever it holds; the row map alone is kilobytes)
            full = {**self._settings(complete), "metadata": self.metadata}
            if error is not None:
                full["error"] = error
            marker = {k: full[k] for k in _MARKER_KEYS if k in full}
            _replace(self.path, _COMPACT.encode(marker | {"boundaries": []}))
            return
        # the row map's text is made once per row map; the keys in manifest()'s order
        row_map = "null" if self.row_map is None else self.row_map.json_text()
        contents = _encode_compact(self._contents(error))[1:-1]
        head = f'{_encode_compact(self._settings(complete))[:-1]},"row_map":{row_map},{contents}'
        boundaries = self.boundaries
        # one boundary per line: compact, yet diffable and readable with grep
        lines = jsonenc.compact_lines(boundaries)
        if lines is None:
            lines = ",\n".join(map(_encode_compact, boundaries))
        text = f'{head},"boundaries":[\n{lines}\n]}}\n'
        if any(b["dump"] for b in boundaries) or os.path.isdir(os.path.join(self.path, TENSOR_DIR)):
            _atomic.atomic_write_text(self.path / MANIFEST, text)
        else:
            _replace(self.path, text)


def _replace(folder: Path, text: str) -> None:
    """``folder/manifest.json`` replaced by ``text`` through a rename, without fsync.

    The manifest it replaces (a capture's own: the in-progress marker, or the capture
    that ``overwrite=True`` replaces) is removed first: renaming over an existing file
    makes ext4 (``auto_da_alloc``) write the new file's data out at once, 0.3 ms a
    manifest (measured), while a reader of the folder sees no difference between no
    manifest and an unfinished one (both are refused). A run stopped between the two
    steps leaves the temporary file, which :func:`_prepare_dir` recognises as a capture.
    """
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    data = memoryview(text.encode())  # (ASCII: the JSON is written with ensure_ascii)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)
    final = os.path.join(folder, MANIFEST)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(final)
    os.replace(tmp, final)


@contextlib.contextmanager
def capture(
    model: torch.nn.Module,
    path: str | os.PathLike[str],
    *,
    modules: str | Iterable[str] | None = None,
    row_map: Sequence[Any] | None = None,
    block_rows: int = 64,
    dump: str | Iterable[str] | None = None,
    dump_requests: Iterable[Any] | None = None,
    metadata: dict[str, Any] | None = None,
    overwrite: bool = False,
    hash_threads: int = 2,
    device_hash: bool = True,
    ops: bool = False,
    op_modules: str | Iterable[str] | None = None,
    layout_inputs: str | Iterable[str] | None = None,
    hash: str = "xxh3",
) -> Iterator[Recorder]:
    """Capture module boundaries of the forward passes run inside the ``with`` block.

    Parameters
    ----------
    model
        The torch module whose submodules are hooked.
    path
        Capture directory (created). ``manifest.json`` is written last; an interrupted
        run leaves a manifest marked incomplete, which :func:`dmlib.open_capture` refuses.
    modules
        Module names or glob patterns (``"encoder.layer.0.*"``); default: every leaf
        module plus top-level blocks. ``""`` hooks the model itself.
    row_map
        One entry per physical row of the leading dimensions (batch x sequence, say):
        ``(request_id, position)`` or ``None`` for padding; or a list of such lists, one
        per batch row. Boundaries whose leading dimensions flatten to this many rows are
        hashed per request (``row_dims``); the others are hashed whole and per index of
        their first axis (``leading``), so that a per-sequence boundary (first axis =
        batch, e.g. pooled outputs) is attributed to the request filling each batch row.
        A row map that fits no boundary raises :class:`CaptureError`. A tensor whose
        leading dims flatten to the row map's length is read per position even if it is
        per sequence by meaning (``[batch, n]`` with ``n`` equal to the sequence length):
        choose shapes, or ``modules``, that keep the two apart.
    block_rows
        Positions per block hash.
    dump
        Glob patterns of boundary names whose full tensors are written (a module's
        output is named like the module, its inputs ``module:input0``...).
    dump_requests
        With ``dump``: write only these requests' rows (position order) instead of whole
        physical tensors.
    metadata
        JSON-able description stored in the manifest.
    overwrite
        Replace an existing capture at ``path``.
    hash_threads
        Worker threads that hash (and dump) host tensors while the forward pass runs
        (0: hash and write in the hook itself, with no copy of the tensor; with ``dump``,
        two more threads, which mostly wait on the disk). With ``hash="xxh3"`` (the
        default) host tensors are hashed in the hook whatever their size (hashing costs
        less than the copy a worker needs); with ``"blake3"``, those over 1 MiB are
        copied and hashed by the workers. Dumps over 1 MiB are written by the workers.
    device_hash
        Checksum tensors on a GPU (any non-CPU device) where they live, with torch ops
        (``cksum4-v1``, bit-exact with :func:`dmlib.hashing.checksum_host`); False: copy
        them to the host and hash there. Each boundary names its scheme (``hash``);
        captures compare only digests of one scheme.
    ops
        Also record every ATen (or custom) operation run inside the hooked modules,
        as boundaries named ``module/aten.addmm#0`` (see :mod:`dmlib.localize.ops`).
    op_modules
        Module names or glob patterns whose ops are recorded (default: ``modules``);
        an op belongs to the innermost such module running it.
    layout_inputs
        More inputs whose values follow the batch layout rather than one request's data
        (glob patterns on a keyword's name, ``"my_mask"``, or on a boundary name,
        ``"blocks.*:input2"``), added to :data:`~dmlib.localize.captures.LAYOUT_INPUTS`
        (attention masks, position ids, cache positions, cu_seqlens...). They are
        hashed whole, flagged ``layout`` and never judged as the request's values.
    hash
        The host tensors' digests: ``"xxh3"`` (``xxh3-128-tree-v1``, the default: XXH3-128,
        about ten times BLAKE3's speed) or ``"blake3"`` (``blake3-tree-v1``, what dmlib
        wrote before version 4: to compare with such captures). Captures compare only
        digests of one scheme; docs/formats.md says why XXH3 is enough for captures.

    KV caches (a transformers ``Cache`` or tuples of past keys and values under
    ``past_key_values`` and kin) entering a hooked module are hashed per layer (keys,
    values) and per request along their position axis (``cache``). Each forward pass of
    the model after the first (a decode step of ``generate()``) is numbered in its
    boundaries (``step``); :func:`dmlib.localize.hf.capture_generate` records the chosen
    tokens as well.
    """
    _require_torch()
    path = Path(path)
    named = dict(model.named_modules())  # walked once
    rec = _new_recorder(model, path, row_map=row_map, block_rows=block_rows, dump=dump,
                        dump_requests=dump_requests, metadata=metadata, overwrite=overwrite,
                        hash_threads=hash_threads, device_hash=device_hash,
                        layout_inputs=layout_inputs, scheme=hash, named=named)  # fmt: skip
    rec.write_manifest(complete=False, durable=False)  # marks a capture in progress
    tracker = None
    if ops:
        tracker = OpRecorder(
            rec, model, _select(model, modules if op_modules is None else op_modules, named)
        )
    with _hooked(model, modules, rec, tracker, named):
        yield rec
    _conclude(rec, path)


def _new_recorder(
    model: torch.nn.Module,
    path: Path,
    *,
    row_map: Sequence[Any] | None,
    block_rows: int,
    dump: str | Iterable[str] | None,
    dump_requests: Iterable[Any] | None,
    metadata: dict[str, Any] | None,
    overwrite: bool,
    hash_threads: int,
    device_hash: bool,
    layout_inputs: str | Iterable[str] | None,
    scheme: str = "xxh3",
    named: dict[str, Any] | None = None,
) -> Recorder:
    """Check the arguments, prepare the folder and build the :class:`Recorder`."""
    if block_rows < 1:
        raise CaptureError(f"block_rows={block_rows}; expected a positive integer", path=path)
    host = HOST_SCHEMES.get(str(scheme).lower())
    if host is None:
        raise CaptureError(f"hash={scheme!r}; expected 'xxh3' or 'blake3'", path=path)
    extra_layout = (
        [] if layout_inputs is None
        else [layout_inputs] if isinstance(layout_inputs, str) else list(layout_inputs)
    )  # fmt: skip
    root = root_label(dict(model.named_modules()) if named is None else named)
    _prepare_dir(path, overwrite)
    return Recorder(
        path,
        row_map=None if row_map is None else RowMap.shared(row_map, path=path),
        block_rows=int(block_rows),
        dump=[] if dump is None else ([dump] if isinstance(dump, str) else list(dump)),
        dump_requests=None if dump_requests is None else {str(r) for r in dump_requests},
        metadata=dict(metadata or {}),
        hash_threads=int(hash_threads),
        device_hash=bool(device_hash),
        root=root,
        layout_inputs=(*LAYOUT_INPUTS, *extra_layout),
        scheme=host,
    )


@contextlib.contextmanager
def _hooked(
    model: torch.nn.Module,
    modules: str | Iterable[str] | None,
    rec: Recorder,
    tracker: OpRecorder | None,
    named: dict[str, Any] | None = None,
) -> Iterator[None]:
    """Hooks installed for the block's duration; an exception marks the capture interrupted."""
    handles: list[Any] = []
    try:
        handles.append(model.register_forward_pre_hook(_step_hook(rec), prepend=True))
        handles += _install_hooks(model, modules, rec, named)
        if tracker is None:
            yield
        else:
            handles += tracker.install()
            with tracker:
                yield
    except BaseException as err:
        with contextlib.suppress(Exception):
            rec.finish()
        rec.write_manifest(
            complete=False, error=f"capture interrupted by {type(err).__name__}: {err}"
        )
        raise
    finally:
        for h in handles:
            h.remove()


def _conclude(rec: Recorder, path: Path) -> None:
    """Wait for the hashes, check the row map fitted, and write the complete manifest."""
    rec.finish()
    if not rec.boundaries:
        rec.write_manifest(complete=False, error="no hooked module ran inside the capture block")
        raise CaptureError("no hooked module ran inside the capture block", path=path)
    try:
        rec.settle_batch()
    except CaptureError as err:
        rec.write_manifest(complete=False, error=str(err))
        raise
    rec.write_manifest(complete=True)


def _prepare_dir(path: Path, overwrite: bool) -> None:
    """Create the capture directory; replace only a capture, and only when asked to.

    A folder that holds no dmlib capture manifest is never emptied: ``overwrite=True``
    on one that holds anything is refused, and so is any folder with a ``tensors``
    entry but no manifest (the dumps would overwrite files dmlib did not write). A
    folder whose only manifest is dmlib's temporary one (a run stopped between the two
    steps of :func:`_replace`) counts as a capture.
    """
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:
        is_dir = None  # nothing there
    except OSError as err:
        raise CaptureError(f"cannot be read ({err.strerror})", path=path) from None
    if is_dir is False:
        raise CaptureError("exists and is not a folder; expected a capture folder", path=path)
    manifest = path / MANIFEST
    # a run stopped inside _replace leaves its manifest under the temporary name alone
    is_capture = _holds_capture(manifest) or (
        not os.path.lexists(manifest) and _holds_capture(path / (MANIFEST + ".tmp"))
    )
    if manifest.exists() and not is_capture:
        raise CaptureError(
            f"{MANIFEST} here is not a {FORMAT} manifest: not a capture, not replaced", path=path
        )
    if is_capture and not overwrite:
        raise CaptureError(
            "a capture already exists here; pass overwrite=True to replace it", path=path
        )
    tensors = path / TENSOR_DIR
    if not is_capture and is_dir:
        if overwrite and any(path.iterdir()):
            raise CaptureError(
                f"overwrite=True replaces only a capture (a folder holding a {FORMAT} "
                f"{MANIFEST}); this folder holds other files: nothing replaced",
                path=path,
            )
        if os.path.lexists(tensors):
            raise CaptureError(
                f"holds {TENSOR_DIR}/ but no capture manifest: not a capture; dmlib writes "
                "no dump over files it did not write",
                path=path,
            )
    if not is_dir:
        path.mkdir(parents=True, exist_ok=True)
    if is_capture and tensors.is_dir() and not tensors.is_symlink():
        for f in tensors.glob("*.safetensors"):  # a capture's own dumps
            if f.is_file() or f.is_symlink():
                f.unlink()


def _holds_capture(manifest: Path) -> bool:
    """Whether ``manifest`` is a regular file holding a dmlib capture manifest (any state).

    A file as dmlib writes it (the ``format`` key first, a whole JSON object: it ends
    in ``}``) is recognised from its first and last bytes, without parsing the rest
    (a capture's manifest is often megabytes; re-capturing into a folder is common);
    any other file is parsed whole, as before.
    """
    try:
        # not through a symbolic link (ELOOP), and without waiting on a FIFO (O_NONBLOCK)
        fd = os.open(manifest, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        head = os.pread(fd, len(_HEAD) + 64, 0)
        tail = os.pread(fd, 8, max(0, st.st_size - 8))
        if head.startswith(_HEAD) and tail.rstrip().endswith(b"}"):
            return True
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        # only the top-level "format" is read: a plain parse, too deep a nesting refused
        # (RecursionError); no walk of the whole document (milliseconds on a big manifest)
        doc = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("format") == FORMAT


def _install_hooks(
    model: torch.nn.Module,
    modules: str | Iterable[str] | None,
    rec: Recorder,
    named: dict[str, Any] | None = None,
) -> Iterator[Any]:
    """Register a pre- and a post-forward hook on every selected module; yields the handles."""
    for name, mod in _select(model, modules, named):
        label = name or rec.root
        yield mod.register_forward_pre_hook(_pre_hook(rec, label), with_kwargs=True)
        yield mod.register_forward_hook(_post_hook(rec, label), with_kwargs=True)


def _step_hook(rec: Recorder) -> Callable[..., None]:
    """Numbers the model's forward passes: the n-th (from 0) sets ``rec.step = n``."""
    calls = [0]

    def hook(mod: Any, args: Any) -> None:
        rec.step = calls[0]
        calls[0] += 1

    return hook


def _pre_hook(rec: Recorder, name: str) -> Callable[..., None]:
    """Records the inputs of module ``name``'s next call."""

    def hook(mod: Any, args: Any, kwargs: Any) -> None:
        call = rec.calls.get(name, 0)
        with quiet():  # the recorder's own tensor calls are not the model's ops
            for slot, t, cache in _inputs(args, kwargs):
                if cache:
                    rec.record_cache(name, call, slot, t, rolled=cache == "rolled")
                elif rec.is_layout(name, slot):
                    rec.record(name, call, "input", slot, t, row_mapped=False,
                               extra={"layout": True})  # fmt: skip
                else:
                    rec.record(name, call, "input", slot, t)

    return hook


def _post_hook(rec: Recorder, name: str) -> Callable[..., None]:
    """Records the outputs of module ``name``'s call and counts the call."""

    def hook(mod: Any, args: Any, kwargs: Any, output: Any) -> None:
        call = rec.calls.get(name, 0)
        rec.calls[name] = call + 1
        with quiet():
            if type(output) is torch.Tensor:  # the common case, without the walk
                rec.record(name, call, "output", "output0", output)
                return
            for slot, t in _tensors(
                output if isinstance(output, (tuple, list)) else (output,), "output"
            ):
                rec.record(name, call, "output", slot, t)

    return hook


__all__ = ["capture", "default_modules", "Recorder"]
