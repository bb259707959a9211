"""Burn's burnpack format (``.bpk``): reader with a solved and validated data base, and a
writer that reproduces Burn's files byte for byte.

Layout (see docs/formats.md): ``b"NRUB"`` magic, u16 version (1), u32 ``metadata_size``, CBOR
metadata, zero padding up to ``D = ceil((10 + metadata_size) / 256) * 256``, then the data
section; every tensor's ``data_offsets`` are relative to ``D``, which is never stored.
Legacy files (Burn v0.19 to v0.20-pre.4) put ``D = 10 + metadata_size`` and pack tensors back
to back. A reader that guesses the base wrong gets a shifted window of plausible bytes, so
this one derives the base from the layout, checks every offset against it and refuses a
file that fits neither layout (or both).

A file may hold several records back to back (model + optimizer + EMA); each is a complete
burnpack image starting at the next 256-byte boundary after the previous one ends.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from dmlib import _atomic
from dmlib.dtypes import SAFETENSORS_DTYPES
from dmlib.errors import FormatError, LayoutError, TruncatedError, UnsupportedError
from dmlib.io import cbor
from dmlib.io._checks import offsets_problem, shape_problem, short_repr, tiling_problem
from dmlib.tensor import Scalar, Tensor, TensorSet

MAGIC = b"NRUB"  # u32 0x4255524E little-endian
VERSION = 1
HEADER = 10
ALIGN = 256

# pad_fill(absolute_offset, nbytes) -> the padding bytes a writer puts there
PadFill = Callable[[int, int], bytes]

# CBOR dtype text -> numpy dtype
# (Burn's dtype names are safetensors' for the types both have; bf16 resolves lazily)
_SIMPLE_DTYPES = SAFETENSORS_DTYPES.without("BOOL", "F8_E4M3", "F8_E5M2").extended(
    {"Flex32": np.dtype("<f4"), "Bool": np.dtype("?")}  # Bool: files written by Burn up to v0.20
)
_BOOL_STORES: dict[str, np.dtype] = {
    "Native": np.dtype("?"),
    "U8": np.dtype("u1"),
    "U32": np.dtype("<u4"),
}


def align_up(n: int, a: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a`` (:data:`ALIGN` by default)."""
    return -(-n // a) * a


def _parse_dtype(value: Any, path: str, name: str) -> tuple[np.dtype, str, bool]:
    """(numpy dtype, readable dtype name, quantized) of a CBOR dtype value."""
    if isinstance(value, str) and value in _SIMPLE_DTYPES:
        return _SIMPLE_DTYPES[value], value, False
    if isinstance(value, dict) and len(value) == 1:
        ((key, inner),) = value.items()
        if key == "Bool" and isinstance(inner, str) and inner in _BOOL_STORES:
            return _BOOL_STORES[inner], f"Bool({inner})", False
        if key == "QFloat":
            return np.dtype("u1"), "QFloat", True
    raise UnsupportedError(
        f"tensor {name!r}: unknown dtype {short_repr(value)} (expected one of "
        f"{', '.join(_SIMPLE_DTYPES)}, {{'Bool': Native|U8|U32}} or {{'QFloat': ...}})",
        path=path,
    )


def dtype_value_for(dtype: np.dtype) -> Any:
    """The CBOR dtype value Burn writes for a numpy dtype."""
    dtype = np.dtype(dtype)
    if dtype == np.dtype("?"):
        return {"Bool": "Native"}
    try:
        return _SIMPLE_DTYPES.without("Flex32", "Bool").name_of(dtype)
    except KeyError:
        raise UnsupportedError(f"burnpack has no dtype for numpy {dtype}") from None


@dataclass
class BurnTensor:
    """A tensor to write: data plus what Burn stores beside it.

    ``dtype_value`` is the CBOR dtype (e.g. ``"Flex32"``, ``{"Bool": "U32"}``); by default it
    follows ``data.dtype``. ``data``'s bytes are always written as they are, so a
    quantized tensor is its packed bytes (a ``uint8`` array) with
    ``dtype_value={"QFloat": ...}`` and ``shape`` the logical shape to store.
    """

    data: np.ndarray
    dtype_value: Any = None
    param_id: int | None = None
    shape: tuple[int, ...] | None = None


class Record(TensorSet):
    """One record image of a burnpack file: a TensorSet with its byte range and data base.

    Attributes: ``index``, ``start`` and ``end`` (absolute byte range of the image),
    ``data_base`` (absolute ``D``), ``metadata_size``, ``scalar_kinds`` (scalar name ->
    Int/UInt/Float/Bool) and ``descriptors`` (the raw CBOR descriptor of each tensor, for
    faithful rewriting); ``layout["layout"]`` is ``"aligned"`` or ``"legacy-unaligned"``.
    A file of several records opens as a Record over all of them (``records`` lists each,
    the attributes are the first one's, ``end`` the last one's).
    """

    def __init__(
        self,
        tensors: Mapping[str, Tensor],
        *,
        path: str,
        buffer: np.ndarray,
        index: int,
        start: int,
        end: int,
        data_base: int,
        metadata_size: int,
        metadata: Mapping[str, str],
        scalars: Mapping[str, Scalar],
        scalar_kinds: dict[str, str],
        descriptors: dict[str, dict[str, Any]],
        layout: Mapping[str, Any],
        records: tuple[Record, ...] | None = None,
    ) -> None:
        super().__init__(
            tensors,
            path=path,
            format="burnpack",
            metadata=metadata,
            scalars=scalars,
            layout=layout,
            buffer=buffer,
        )
        self.index, self.start, self.end = index, start, end
        self.data_base, self.metadata_size = data_base, metadata_size
        self.scalar_kinds, self.descriptors = scalar_kinds, descriptors
        self.records = (self,) if records is None else records


def _decode_scalars(raw: Any, path: str) -> tuple[dict[str, Scalar], dict[str, str]]:
    if raw is None:
        return {}, {}
    if not isinstance(raw, dict):
        raise FormatError(f"'scalars' is a {type(raw).__name__}, expected a map", path=path)
    values: dict[str, Scalar] = {}
    kinds: dict[str, str] = {}
    for k, v in raw.items():
        if not (isinstance(k, str) and isinstance(v, dict) and len(v) == 1):
            raise FormatError(
                f"scalar {short_repr(k)}: expected a one-key map like {{'UInt': 42}}, got {short_repr(v)}",
                path=path,
            )
        ((kind, val),) = v.items()
        ok = {
            "Int": isinstance(val, int) and not isinstance(val, bool),
            "UInt": isinstance(val, int) and not isinstance(val, bool) and val >= 0,
            "Float": isinstance(val, float),
            "Bool": isinstance(val, bool),
        }.get(kind, False)
        if not ok:
            raise FormatError(
                f"scalar {k!r}: invalid value {short_repr(v)} (Int/UInt/Float/Bool)", path=path
            )
        values[k], kinds[k] = val, kind
    return values, kinds


def _parse_header(
    buf: np.ndarray, start: int, size: int, path: str, index: int
) -> tuple[int, dict]:
    where = f"record {index} at byte {start}: " if index else ""
    if size - start < HEADER:
        raise TruncatedError(
            f"{where}{size - start} bytes, shorter than the 10-byte burnpack header", path=path
        )
    head = bytes(buf[start : start + HEADER])
    if head[:4] != MAGIC:
        raise FormatError(
            f"{where}bad magic {head[:4]!r} (a burnpack file starts with b'NRUB')", path=path
        )
    version, msize = struct.unpack("<HI", head[4:])
    if version > VERSION or version == 0:
        raise UnsupportedError(
            f"{where}burnpack version {version}; this reader supports version 1", path=path
        )
    if start + HEADER + msize > size:
        raise TruncatedError(
            f"{where}metadata_size {msize} runs past the end of the file ({size} bytes)", path=path
        )
    try:
        meta = cbor.decode(buf[start + HEADER : start + HEADER + msize])
    except cbor.CBORError as err:
        raise FormatError(f"{where}corrupt CBOR metadata ({err})", path=path) from None
    if not isinstance(meta, dict) or not isinstance(meta.get("tensors"), dict):
        raise FormatError(f"{where}CBOR metadata is not a map with a 'tensors' map", path=path)
    return msize, meta


class _Descriptor(NamedTuple):
    """One tensor's CBOR descriptor, checked; ``start``/``end`` relative to the data base."""

    name: str
    dtype: np.dtype
    dtype_name: str
    quantized: bool
    shape: tuple[int, ...]
    start: int
    end: int
    param_id: int | None
    raw: dict[str, Any]  # as stored, for faithful rewriting


def _descriptors(meta: dict, path: str) -> list[_Descriptor]:
    out = []
    for name, d in meta["tensors"].items():
        if not isinstance(name, str) or not isinstance(d, dict):
            raise FormatError(
                f"tensor entry {short_repr(name)} is not a name -> map descriptor", path=path
            )
        for key in ("dtype", "shape", "data_offsets"):
            if key not in d:
                raise FormatError(f"tensor {name!r}: descriptor lacks {key!r}", path=path)
        dtype, dname, quantized = _parse_dtype(d["dtype"], path, name)
        shape, offs = d["shape"], d["data_offsets"]
        problem = shape_problem(shape, dtype.itemsize)
        if problem is not None:
            raise FormatError(f"tensor {name!r}: {problem}", path=path)
        problem = offsets_problem(offs)
        if problem is not None:
            raise FormatError(f"tensor {name!r}: {problem}", path=path)
        pid = d.get("param_id")
        if pid is not None and not (
            isinstance(pid, int) and not isinstance(pid, bool) and 0 <= pid < 1 << 64
        ):
            raise FormatError(
                f"tensor {name!r}: param_id {short_repr(pid)} is not a u64", path=path
            )
        numel = 1
        for s in shape:
            numel *= s
        if not quantized and offs[1] - offs[0] != numel * dtype.itemsize:
            raise LayoutError(
                f"tensor {name!r}: {offs[1] - offs[0]} bytes at data_offsets {offs} but {dname} x {shape} "
                f"needs {numel * dtype.itemsize}",
                path=path,
            )
        out.append(
            _Descriptor(name, dtype, dname, quantized, tuple(shape), offs[0], offs[1], pid, d)
        )
    return out


def _fits(
    base: int, descs: list[_Descriptor], size: int, buf: np.ndarray, aligned: bool
) -> tuple[bool, int, str]:
    """Does the record fit with data base ``base``? Returns (ok, record end, reason)."""
    last = max((d.end for d in descs), default=0)
    end = base + last
    # Burn's writer puts each tensor at the first aligned offset after the previous one
    # (legacy files: back to back): a larger gap means offsets shifted
    problem = tiling_problem(
        ((d.start, d.end, d.name) for d in descs),
        size - base,
        base=base,
        align=ALIGN if aligned else 1,
        exact_end=False,
    )
    if problem is not None:
        return False, end, problem.message
    if end > size:  # no tensor at all, and the data base itself past the end
        return False, end, f"the data would start at byte {end}, past the end of the file ({size})"
    if end == size:
        return True, end, ""
    for nxt in {align_up(end), end}:
        if nxt + 4 <= size and bytes(buf[nxt : nxt + 4]) == MAGIC:
            return True, end, ""
    return (
        False,
        end,
        f"the record would end at byte {end} but the file has {size - end} more bytes that are not another record",
    )


def _newer_than_legacy(meta: dict, descs: list[_Descriptor]) -> str | None:
    """What in the metadata proves the file postdates the legacy layout (None if nothing)."""
    if meta.get("scalars"):
        return "'scalars'"
    for d in descs:
        if isinstance(d.raw["dtype"], dict) and "Bool" in d.raw["dtype"]:
            return f"the dtype {d.raw['dtype']!r} (tensor {d.name!r})"
    return None


def _read_record(buf: np.ndarray, start: int, size: int, path: str, index: int) -> Record:
    """The record starting at byte ``start``: header, descriptors, then its data base.

    The data base is where Burn's aligned layout or the legacy unaligned one puts the
    data (:func:`_data_base`); every tensor is a view of the map from there.
    """
    msize, meta = _parse_header(buf, start, size, path, index)
    descs = _descriptors(meta, path)
    base, end, layout = _data_base(buf, start, size, msize, meta, descs, path, index)
    md = meta.get("metadata") or {}
    if not isinstance(md, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in md.items()
    ):
        raise FormatError("'metadata' is not a str -> str map", path=path)
    scalars, kinds = _decode_scalars(meta.get("scalars"), path)
    tensors, descriptors = {}, {}
    for d in descs:
        descriptors[d.name] = d.raw
        tensors[d.name] = Tensor(
            d.name, d.dtype, d.shape, nbytes=d.end - d.start, offset=base + d.start,
            param_id=d.param_id, dtype_name=d.dtype_name, record=index, quantized=d.quantized,
            source=buf, in_buffer=True, path=path,
        )  # fmt: skip
    return Record(
        tensors, path=path, buffer=buf, index=index, start=start, end=end, data_base=base,
        metadata_size=msize, metadata=md, scalars=scalars, scalar_kinds=kinds,
        descriptors=descriptors,
        layout={
            "layout": layout, "data_base": base, "metadata_size": msize, "start": start,
            "end": end,
        },
    )  # fmt: skip


def _data_base(
    buf: np.ndarray,
    start: int,
    size: int,
    msize: int,
    meta: dict,
    descs: list[_Descriptor],
    path: str,
    index: int,
) -> tuple[int, int, str]:
    """(data base, record end, layout name): the one layout the record fits, else an error.

    A file that two layouts would read differently is refused, never guessed at.
    """
    d_aligned = start + align_up(HEADER + msize)
    d_legacy = start + HEADER + msize
    ok_a, end_a, why_a = _fits(d_aligned, descs, size, buf, aligned=True)
    newer = _newer_than_legacy(meta, descs)
    if d_legacy == d_aligned:
        ok_l, end_l, why_l = False, end_a, "same base as the aligned layout"
    else:
        ok_l, end_l, why_l = _legacy_fit(
            buf, descs, size, d_legacy, d_aligned, ok_a, newer, index, path
        )
    if ok_a and not ok_l and not newer and d_legacy != d_aligned and buf[d_legacy:d_aligned].any():
        _refuse_shifted_legacy(descs, size, d_legacy, d_aligned, index, path)
    if ok_a and ok_l:
        raise LayoutError(
            f"record {index}: ambiguous data base (both {d_aligned} and {d_legacy} fit); refusing to guess",
            path=path,
        )
    if not ok_a and not ok_l:
        raise LayoutError(
            f"record {index}: no valid data base. Aligned layout (D={d_aligned}): {why_a}. "
            f"Legacy unaligned layout (D={d_legacy}): {why_l}",
            path=path,
        )
    return (d_aligned, end_a, "aligned") if ok_a else (d_legacy, end_l, "legacy-unaligned")


def _legacy_fit(
    buf: np.ndarray,
    descs: list[_Descriptor],
    size: int,
    d_legacy: int,
    d_aligned: int,
    ok_a: bool,
    newer: str | None,
    index: int,
    path: str,
) -> tuple[bool, int, str]:
    """Does the legacy unaligned layout fit (as :func:`_fits`), given what the aligned one did?"""
    ok_l, end_l, why_l = _fits(d_legacy, descs, size, buf, aligned=False)
    all_aligned = bool(descs) and all(d.start % ALIGN == 0 for d in descs)
    if ok_l and all_aligned and ok_a:
        ok_l = False  # aligned starts that also pack back to back: the aligned reading wins
    if ok_l and newer:
        # the legacy layout ended with Burn v0.20.0-pre.4; these fields came later, so
        # a legacy reading would be a shifted window of an aligned file cut short
        ok_l, why_l = (
            False,
            f"the metadata has {newer}, which Burn wrote only after the legacy layout ended",
        )
    if ok_l and all_aligned and not buf[d_legacy:d_aligned].any():
        # Packed starts that are all aligned, and zeros where the aligned padding
        # would be: this is equally an aligned file cut short by the padding length.
        raise LayoutError(
            f"record {index}: ambiguous data base: legacy D={d_legacy} fits, but so would an aligned "
            f"file (D={d_aligned}) cut short by {d_aligned - d_legacy} bytes; refusing to guess",
            path=path,
        )
    return ok_l, end_l, why_l


def _refuse_shifted_legacy(
    descs: list[_Descriptor], size: int, d_legacy: int, d_aligned: int, index: int, path: str
) -> None:
    """Refuse an aligned reading whose header padding is not zero when the tensors also pack
    back to back from the legacy base: most likely a legacy file with trailing bytes, and
    the aligned reading would be a shifted window."""
    packed, prev = True, 0
    for s_, e_ in sorted((d.start, d.end) for d in descs):
        packed, prev = packed and s_ == prev, max(prev, e_)
    # (with no tensor bytes at all, both readings agree: nothing could be shifted)
    if packed and 0 < prev and d_legacy + prev <= size:
        raise LayoutError(
            f"record {index}: ambiguous data base: the aligned layout (D={d_aligned}) fits the file "
            f"length, but the {d_aligned - d_legacy} header-padding bytes are not zero and the "
            f"tensors also pack back to back from the legacy base (D={d_legacy}), leaving "
            f"{size - d_legacy - prev} trailing bytes; refusing to guess",
            path=path,
        )


def can_open(head: bytes, path: str) -> bool:
    """A file whose first 4 bytes are burnpack's magic ``NRUB`` (any name)."""
    return head[:4] == MAGIC


def open_burnpack(path: str | os.PathLike[str], *, record: int | None = None) -> TensorSet:
    """Open a burnpack file (every record in it) as a TensorSet.

    Names of record ``i > 0`` are prefixed ``"record{i}/"``; ``ts.records[i]`` holds each
    record with its plain names, and ``record=i`` returns that record alone.
    """
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size == 0:
        raise TruncatedError(
            "empty file (0 bytes); a burnpack file has at least a 10-byte header", path=path
        )
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    records: list[Record] = []
    start = 0
    while True:
        rec = _read_record(buf, start, size, path, len(records))
        records.append(rec)
        if rec.end >= size:
            break
        nxt = (
            align_up(rec.end)
            if bytes(buf[align_up(rec.end) : align_up(rec.end) + 4]) == MAGIC
            else rec.end
        )
        start = nxt
    if record is not None:
        if not 0 <= record < len(records):
            raise FormatError(
                f"record {record} requested but the file holds {len(records)} record(s)", path=path
            )
        return records[record]
    if len(records) == 1:
        return records[0]
    tensors: dict[str, Tensor] = {}
    for r in records:
        for name, t in r.items():
            tensors[name if r.index == 0 else f"record{r.index}/{name}"] = t
    first = records[0]
    return Record(
        tensors,
        path=path,
        buffer=buf,
        index=0,
        start=0,
        end=records[-1].end,
        data_base=first.data_base,
        metadata_size=first.metadata_size,
        metadata=first.metadata,
        scalars=first.scalars,
        scalar_kinds=first.scalar_kinds,
        descriptors=first.descriptors,
        layout={"layout": first.layout["layout"], "records": [dict(r.layout) for r in records]},
        records=tuple(records),
    )


# ----------------------------------------------------------------------------- writer


class _Entry(NamedTuple):
    """One tensor to write."""

    name: str
    dtype_value: Any  # the CBOR dtype
    shape: tuple[int, ...]
    data: bytes
    param_id: int | None


def _as_entries(tensors: Mapping[str, Any] | TensorSet, legacy: bool = False) -> list[_Entry]:
    """The tensors to write, in disk order.

    ``legacy``: default dtypes as Burn v0.19-v0.20 wrote them (plain ``"Bool"``).
    """

    def default_dtype(dt: np.dtype) -> Any:
        return "Bool" if legacy and dt == np.dtype("?") else dtype_value_for(dt)

    out = []
    if isinstance(tensors, TensorSet):
        descs = getattr(tensors, "descriptors", {}) if len(tensors.records) <= 1 else {}
        for t in tensors.disk_order():
            raw = descs.get(t.name, {}).get("dtype")
            if raw is None:
                raw = {"QFloat": {}} if t.quantized else default_dtype(t.dtype)
            out.append(_Entry(t.name, raw, t.shape, t.raw().tobytes(), t.param_id))
        return out
    for name, v in tensors.items():
        if isinstance(v, BurnTensor):
            arr = np.ascontiguousarray(v.data)
            dval = v.dtype_value if v.dtype_value is not None else default_dtype(arr.dtype)
            shape = tuple(v.shape) if v.shape is not None else arr.shape
            out.append(_Entry(name, dval, shape, arr.tobytes(), v.param_id))
        else:
            arr = np.ascontiguousarray(np.asarray(v))
            out.append(_Entry(name, default_dtype(arr.dtype), arr.shape, arr.tobytes(), None))
    return out


def _scalar_value(name: str, value: Scalar, kind: str | None) -> dict[str, Any]:
    if kind is None:
        if isinstance(value, bool):
            kind = "Bool"
        elif isinstance(value, (int, np.integer)):
            kind = "UInt" if value >= 0 else "Int"
        elif isinstance(value, (float, np.floating)):
            kind = "Float"
        else:
            raise UnsupportedError(f"scalar {name!r}: {type(value).__name__} is not int/float/bool")
    conv = {"Int": int, "UInt": int, "Float": float, "Bool": bool}[kind]
    return {kind: conv(value)}


def encode_burnpack(
    tensors: Mapping[str, Any] | TensorSet,
    *,
    metadata: Mapping[str, str] | None = None,
    scalars: Mapping[str, Scalar] | None = None,
    scalar_kinds: Mapping[str, str] | None = None,
    layout: str = "aligned",
    pad_fill: PadFill | None = None,
) -> bytes:
    """The bytes of a burnpack file, as Burn's writer lays them out.

    Parameters
    ----------
    tensors
        Ordered mapping name -> array or :class:`BurnTensor` (disk order = mapping order),
        or a burnpack TensorSet/Record to rewrite (its dtypes, param_ids, metadata and
        scalars are kept unless given here).
    layout
        ``"aligned"`` (current Burn) or ``"legacy-unaligned"`` (Burn v0.19-v0.20, which
        also wrote booleans as plain ``"Bool"``).
    pad_fill
        ``pad_fill(absolute_offset, nbytes) -> bytes`` fills the gaps between tensors
        (Burn writes zeros; other writers leave stale memory there).
    """
    if layout not in ("aligned", "legacy-unaligned"):
        raise ValueError(f"layout must be 'aligned' or 'legacy-unaligned', not {layout!r}")
    if isinstance(tensors, TensorSet):
        metadata = tensors.metadata if metadata is None else metadata
        scalars = tensors.scalars if scalars is None else scalars
        scalar_kinds = (
            getattr(tensors, "scalar_kinds", None) if scalar_kinds is None else scalar_kinds
        )
    aligned = layout == "aligned"
    entries = _as_entries(tensors, legacy=not aligned)
    offsets = []
    cur = 0
    for entry in entries:
        start = align_up(cur) if aligned else cur
        offsets.append((start, start + len(entry.data)))
        cur = start + len(entry.data)
    descs = {}
    for entry, (s, e) in zip(entries, offsets, strict=True):
        d: dict[str, Any] = {
            "dtype": entry.dtype_value,
            "shape": [int(x) for x in entry.shape],
            "data_offsets": [s, e],
        }
        if entry.param_id is not None:
            d["param_id"] = int(entry.param_id)
        descs[entry.name] = d
    meta: dict[str, Any] = {
        "tensors": {k: descs[k] for k in sorted(descs, key=lambda n: n.encode("utf-8"))}
    }
    if metadata:
        meta["metadata"] = {str(k): str(v) for k, v in metadata.items()}
    if scalars:
        kinds = scalar_kinds or {}
        meta["scalars"] = {k: _scalar_value(k, v, kinds.get(k)) for k, v in scalars.items()}
    blob = cbor.encode(meta)
    base = align_up(HEADER + len(blob)) if aligned else HEADER + len(blob)
    out = bytearray(MAGIC + struct.pack("<HI", VERSION, len(blob)) + blob)
    out += bytes(base - len(out))
    for entry, (s, _) in zip(entries, offsets, strict=True):
        _pad(out, base + s - len(out), pad_fill)
        out += entry.data
    return bytes(out)


def write_burnpack(
    path: str | os.PathLike[str], tensors: Mapping[str, Any] | TensorSet, **kwargs: Any
) -> None:
    """Write a burnpack file atomically (see :func:`encode_burnpack` for the arguments)."""
    _atomic.atomic_write_bytes(path, encode_burnpack(tensors, **kwargs))


def write_records(
    path: str | os.PathLike[str],
    records: list[bytes],
    *,
    pad_fill: PadFill | None = None,
) -> None:
    """Write several burnpack images back to back, each at the next 256-byte boundary.

    ``pad_fill`` fills the bytes between records, as for :func:`encode_burnpack`.
    """
    out = bytearray()
    for i, rec in enumerate(records):
        if rec[:4] != MAGIC:
            raise ValueError(f"record {i} does not start with the burnpack magic")
        if out:
            _pad(out, align_up(len(out)) - len(out), pad_fill)
        out += rec
    _atomic.atomic_write_bytes(path, bytes(out))


def _pad(out: bytearray, gap: int, pad_fill: PadFill | None) -> None:
    """Append ``gap`` padding bytes to ``out``: zeros, or what ``pad_fill`` returns."""
    if not gap:
        return
    fill = bytes(gap) if pad_fill is None else bytes(pad_fill(len(out), gap))
    if len(fill) != gap:
        raise ValueError(f"pad_fill returned {len(fill)} bytes for a {gap}-byte gap")
    out += fill
