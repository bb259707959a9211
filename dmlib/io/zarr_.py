"""Zarr v2 and v3 arrays as Orbax writes them, over any ``key -> bytes`` store.

An array is its metadata (v2 ``.zarray``, v3 ``zarr.json``: shape, dtype, chunk grid,
codecs) and one value per chunk under a key built from the chunk's grid position. Orbax
writes one chunk per array on one device and one per shard for an array sharded over
devices; with zarr v3 each chunk is a ``sharding_indexed`` shard holding inner chunks and
an index (offset, length per inner chunk) protected by a CRC-32C.

Reading an array places every stored chunk's decoded bytes at its position; each chunk
must decode to exactly its chunk's size, and a chunk that is absent is an error unless the
writer said absent chunks equal the fill value. The chunk grid is never enumerated: the
stored chunks are listed (a key outside the grid is refused), an absent one is found by
walking the grid only as far as the stored ones reach, and absent chunks hold the fill
value. Work is bounded by this machine (:mod:`dmlib._limits`), never by what the metadata
declares: an array larger than one piece may take is refused when read, a chunk inflates
at most to its own size and no more than its stored size allows, and a nonzero fill value
covers at most what a stored byte may inflate to. Metadata JSON nested deeper than
:data:`dmlib._limits.MAX_NESTING` levels is refused. Supported codecs: v2 compressor zstd,
zlib, gzip or none (no filters); v3 ``bytes``, ``zstd``, ``gzip``, ``crc32c``,
``sharding_indexed``. Others are refused by name.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import numpy as np

from dmlib import _limits
from dmlib.errors import FormatError, UnsupportedError
from dmlib.io._checks import shape_problem, short_repr
from dmlib.io.ocdbt import crc32c, zstd_decompress
from dmlib.safepaths import bounded_json

__all__ = ["ZarrArray", "parse_metadata", "read_array"]

Get = Callable[[str], "bytes | None"]

# zarr v3 data type names (and tensorstore's ml_dtypes extensions) -> numpy names
_V3 = {
    "bool": "bool",
    **{n: n for n in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")},
    **{n: n for n in ("float16", "float32", "float64", "complex64", "complex128")},
}
_ML = (
    "bfloat16",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e4m3b11fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e8m0fnu",
    "float4_e2m1fn",
    "float6_e2m3fn",
    "float6_e3m2fn",
    "int4",
    "uint4",
    "int2",
    "uint2",
)


def _dtype(name: Any, what: str, path: str) -> np.dtype:
    """numpy dtype of a zarr v2 (``"<f4"``, ``"bfloat16"``) or v3 (``"float32"``) name."""
    if not isinstance(name, str):
        raise FormatError(f"{what}: dtype {short_repr(name)} is not a string", path=path)
    if name in _ML:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    if name in _V3:
        return np.dtype(_V3[name])
    if len(name) >= 3 and name[0] in "<>|" and name[1] in "biufc" and name[2:].isdigit():
        try:
            return np.dtype(name)
        except TypeError:
            pass
    raise UnsupportedError(f"{what}: dtype {short_repr(name)} is not supported", path=path)


@dataclass
class ZarrArray:
    """One array's metadata, decoded and checked."""

    name: str
    zarr_format: int
    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[int, ...]
    order: str = "C"
    compressor: str = "none"
    separator: str = "."
    key_prefix: str = ""  # v3 default encoding: "c" + separator
    shard: tuple[int, ...] | None = None  # v3 sharding_indexed: the inner chunk shape
    inner: list[dict[str, Any]] = field(default_factory=list)  # codecs of the (inner) chunks
    index_crc: bool = False
    index_at_end: bool = True
    fill: Any = None

    def grid(self) -> tuple[int, ...]:
        """Chunks per axis: the shape over the chunk shape, rounded up (0 where a chunk is 0)."""
        return tuple(-(-s // c) if c else 0 for s, c in zip(self.shape, self.chunks))

    def chunk_key(self, idx: tuple[int, ...]) -> str:
        """The store key of the chunk at grid position ``idx``.

        ``name/`` then the indices joined by :attr:`separator`, after a ``c`` in v3's default
        encoding; a 0-d array's chunk is ``name/0`` (``name/c`` in v3's default encoding).
        """
        if self.zarr_format == 2:
            return f"{self.name}/" + (self.separator.join(map(str, idx)) if idx else "0")
        tail = self.separator.join(map(str, idx))
        if self.key_prefix:  # default encoding: c/0/0, a 0-d array's chunk is "c"
            return f"{self.name}/c" + (self.separator + tail if idx else "")
        return f"{self.name}/" + (tail if idx else "0")

    def chunk_index(self, key: str) -> tuple[int, ...] | None:
        """The grid position whose :meth:`chunk_key` is ``key``; None for any other key."""
        tail = key[len(self.name) + 1 :] if key.startswith(self.name + "/") else None
        if tail is None:
            return None
        if self.zarr_format == 3 and self.key_prefix:
            tail = (
                tail[2:] if tail.startswith("c" + self.separator) else "" if tail == "c" else None
            )
            if tail is None:
                return None
        if not self.shape:
            return () if self.chunk_key(()) == key else None
        parts = tail.split(self.separator)
        # decimal digits as chunk_key writes them: ASCII, no leading zero
        if not all(
            p.isascii() and p.isdigit() and len(p) <= 20 and (len(p) == 1 or p[0] != "0")
            for p in parts
        ):
            return None
        idx = tuple(map(int, parts))
        grid = self.grid()
        if len(idx) != len(grid) or any(i >= g for i, g in zip(idx, grid)):
            return None
        return idx

    def nbytes(self) -> int:
        """The bytes the whole array takes in memory."""
        return math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> dict[str, Any]:
        """Layout facts: zarr format, chunk shape, grid and compressor (sharded: the inner chunk
        shape, and the compressor as ``sharding_indexed[...]`` with ``+crc32c index`` if so).
        """
        d: dict[str, Any] = {
            "zarr_format": self.zarr_format,
            "chunks": list(self.chunks),
            "grid": list(self.grid()),
            "compressor": self.compressor,
        }
        if self.shard is not None:
            d["inner_chunks"] = list(self.shard)
            d["compressor"] = f"sharding_indexed[{self.compressor}]" + (
                "+crc32c index" if self.index_crc else ""
            )
        return d


def _ints(v: Any, what: str, path: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v
    ):
        raise FormatError(
            f"{what}: {short_repr(v)} is not a list of non-negative integers", path=path
        )
    return tuple(v)


def _v2(name: str, md: dict[str, Any], path: str) -> ZarrArray:
    what = f"{name}/.zarray"
    shape = _ints(md.get("shape"), f"{what} shape", path)
    chunks = _ints(md.get("chunks"), f"{what} chunks", path)
    dtype = _dtype(md.get("dtype"), what, path)
    if md.get("filters"):
        raise UnsupportedError(
            f"{what}: filters {short_repr(md['filters'])} are not supported", path=path
        )
    comp = md.get("compressor")
    cname = "none" if comp is None else comp.get("id") if isinstance(comp, dict) else None
    if cname not in ("none", "zstd", "zlib", "gzip"):
        raise UnsupportedError(f"{what}: compressor {short_repr(comp)} is not supported", path=path)
    order = md.get("order", "C")
    if order not in ("C", "F"):
        raise FormatError(f"{what}: order {short_repr(order)} is not C or F", path=path)
    sep = md.get("dimension_separator", ".")
    if sep not in (".", "/"):
        raise FormatError(f"{what}: dimension_separator {short_repr(sep)}", path=path)
    return ZarrArray(
        name,
        2,
        shape,
        dtype,
        chunks,
        order=order,
        compressor=str(cname),
        separator=sep,
        fill=md.get("fill_value"),
    )


def _conf(obj: dict[str, Any], what: str, path: str) -> dict[str, Any]:
    """``obj["configuration"]``: an object, or {} where there is none."""
    conf = obj.get("configuration")
    if conf is None:
        return {}
    if not isinstance(conf, dict):
        raise FormatError(f"{what}: configuration {short_repr(conf)} is not an object", path=path)
    return conf


def _codec_list(v: Any, what: str, path: str) -> list[dict[str, Any]]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise FormatError(f"{what}: codecs {short_repr(v)} is not a list", path=path)
    return [_codec(c, what, path) for c in v]


def _codec(c: Any, what: str, path: str) -> dict[str, Any]:
    if isinstance(c, str):
        c = {"name": c}
    if not isinstance(c, dict) or not isinstance(c.get("name"), str):
        raise FormatError(f"{what}: codec {short_repr(c)} is not an object with a name", path=path)
    if c["name"] not in ("bytes", "zstd", "gzip", "crc32c", "sharding_indexed"):
        raise UnsupportedError(f"{what}: codec {c['name']!r} is not supported", path=path)
    return c


def _v3(name: str, md: dict[str, Any], path: str) -> ZarrArray:
    what = f"{name}/zarr.json"
    if md.get("node_type", "array") != "array":
        raise FormatError(
            f"{what}: node_type {short_repr(md.get('node_type'))} is not array", path=path
        )
    shape = _ints(md.get("shape"), f"{what} shape", path)
    dtype = _dtype(md.get("data_type"), what, path)
    grid = md.get("chunk_grid") or {}
    if not isinstance(grid, dict) or grid.get("name") != "regular":
        raise UnsupportedError(f"{what}: chunk grid {short_repr(grid)} is not regular", path=path)
    chunks = _ints(_conf(grid, what, path).get("chunk_shape"), f"{what} chunk_shape", path)
    enc = md.get("chunk_key_encoding") or {"name": "default"}
    ename = enc.get("name") if isinstance(enc, dict) else None
    conf = _conf(enc, what, path) if isinstance(enc, dict) else {}
    if ename not in ("default", "v2"):
        raise UnsupportedError(f"{what}: chunk key encoding {short_repr(enc)}", path=path)
    sep = conf.get("separator", "/" if ename == "default" else ".")
    if sep not in (".", "/"):
        raise FormatError(f"{what}: chunk key separator {short_repr(sep)}", path=path)
    if not isinstance(md.get("codecs"), list):
        raise FormatError(f"{what}: codecs {short_repr(md.get('codecs'))} is not a list", path=path)
    arr = ZarrArray(
        name,
        3,
        shape,
        dtype,
        chunks,
        separator=sep,
        key_prefix="c" if ename == "default" else "",
        fill=md.get("fill_value"),
    )
    codecs = _codec_list(md["codecs"], what, path)
    if codecs and codecs[0]["name"] == "sharding_indexed":
        if len(codecs) != 1:
            raise UnsupportedError(f"{what}: codecs after sharding_indexed", path=path)
        codecs = _sharding(arr, _conf(codecs[0], what, path), what, path)
    names = [c["name"] for c in codecs]
    if not names or names[0] != "bytes" or "sharding_indexed" in names:
        raise UnsupportedError(
            f"{what}: codec chain {names} (expected bytes, then compressors)", path=path
        )
    endian = _conf(codecs[0], what, path).get("endian", "little")
    if endian not in ("little", "big"):
        raise FormatError(f"{what}: endian {short_repr(endian)} is not little or big", path=path)
    if dtype.itemsize > 1:
        arr.dtype = dtype.newbyteorder("<" if endian == "little" else ">")
    arr.inner = codecs[1:]
    arr.compressor = "+".join(names[1:]) or "none"
    return arr


def _sharding(arr: ZarrArray, sc: dict[str, Any], what: str, path: str) -> list[dict[str, Any]]:
    """Set ``arr``'s shard facts from a ``sharding_indexed`` configuration; its inner codecs."""
    arr.shard = _ints(sc.get("chunk_shape"), f"{what} inner chunk_shape", path)
    if len(arr.shard) != len(arr.chunks) or any(
        c % i if i else c for c, i in zip(arr.chunks, arr.shard)
    ):
        raise FormatError(
            f"{what}: inner chunks {list(arr.shard)} do not divide {list(arr.chunks)}", path=path
        )
    codecs = _codec_list(sc.get("codecs"), what, path)
    index = [c["name"] for c in _codec_list(sc.get("index_codecs"), what, path)]
    if index not in (["bytes"], ["bytes", "crc32c"]):
        raise UnsupportedError(f"{what}: shard index codecs {index}", path=path)
    arr.index_crc = index[-1] == "crc32c"
    loc = sc.get("index_location", "end")
    if loc not in ("start", "end"):
        raise FormatError(f"{what}: index_location {short_repr(loc)}", path=path)
    arr.index_at_end = loc == "end"
    return codecs


def parse_metadata(name: str, raw: bytes, zarr_format: int, path: str) -> ZarrArray:
    """The checked metadata of array ``name`` from its ``.zarray``/``zarr.json`` bytes."""
    try:
        md = bounded_json(raw.decode(), where=path, error=FormatError)
    except UnicodeDecodeError as err:
        raise FormatError(f"{name}: array metadata is not JSON ({err})", path=path) from None
    except FormatError as err:  # not JSON, or nested too deeply: say which array
        msg = str(err).removeprefix(f"{path}: ")
        raise FormatError(f"{name}: array metadata {msg}", path=path) from None
    if not isinstance(md, dict) or md.get("zarr_format") != zarr_format:
        raise FormatError(f"{name}: array metadata is not zarr v{zarr_format}", path=path)
    arr = _v2(name, md, path) if zarr_format == 2 else _v3(name, md, path)
    if len(arr.chunks) != len(arr.shape) or (arr.shape and 0 in arr.chunks and 0 not in arr.shape):
        raise FormatError(
            f"{name}: chunks {list(arr.chunks)} do not fit shape {list(arr.shape)}", path=path
        )
    problem = shape_problem(list(arr.shape), arr.dtype.itemsize) or shape_problem(
        list(arr.chunks), arr.dtype.itemsize
    )
    if problem:
        raise FormatError(f"{name}: {problem}", path=path)
    return arr


_STEP = 16 << 20  # bytes decoded at a time from a zlib or gzip stream


def _inflate(data: bytes, name: str, want: int, what: str, path: str) -> bytes:
    """One compressed stream decoded into at most ``want`` bytes (the chunk's own size) and
    no more than :func:`dmlib._limits.allowed_output` lets its stored size inflate to."""
    limit = min(want, _limits.allowed_output(len(data)))
    if name == "zstd":
        return zstd_decompress(data, limit, what, path)
    d = zlib.decompressobj(31 if name == "gzip" else 15)
    out, tail = bytearray(), data
    try:
        while True:  # in pieces: the output grows by what was decoded, never past the limit
            piece = d.decompress(tail, _STEP)
            out += piece
            if len(out) > limit:
                raise FormatError(
                    f"{what}: {len(data)} {name} bytes inflate past {limit} bytes "
                    f"({_limits.limit_hint()})",
                    path=path,
                )
            tail = d.unconsumed_tail
            if d.eof or (not tail and len(piece) < _STEP):
                return bytes(out)
    except zlib.error as err:
        raise FormatError(f"{what}: corrupt {name} data ({err})", path=path) from None


def _decode(data: bytes, codecs: list[dict[str, Any]], want: int, what: str, path: str) -> bytes:
    """Undo the compressors (v3 names, or the v2 compressor id), outermost last in the list;
    the result is at most ``want`` bytes (see :func:`_inflate`)."""
    for c in reversed(codecs):
        name = c["name"]
        if name == "crc32c":
            if len(data) < 4 or crc32c(data[:-4]) != int.from_bytes(data[-4:], "little"):
                raise FormatError(f"{what}: CRC-32C mismatch (damaged)", path=path)
            data = data[:-4]
        elif name in ("zstd", "gzip", "zlib"):
            data = _inflate(data, name, want, what, path)
    return data


def _place(
    out: np.ndarray,
    arr: ZarrArray,
    origin: tuple[int, ...],
    box: tuple[int, ...],
    raw: bytes,
    what: str,
    path: str,
) -> None:
    """Write a decoded chunk of shape ``box`` at ``origin`` into ``out`` (clipped to the array)."""
    want = math.prod(box) * arr.dtype.itemsize
    if len(raw) != want:
        raise FormatError(
            f"{what}: decodes to {len(raw)} bytes, a chunk of {list(box)} is {want}", path=path
        )
    block = np.frombuffer(raw, arr.dtype)
    block = block.reshape(box, order="F" if arr.order == "F" else "C")
    sl = tuple(slice(o, min(o + b, s)) for o, b, s in zip(origin, box, arr.shape))
    out[sl] = block[tuple(slice(0, s.stop - s.start) for s in sl)]


def _shard(
    out: np.ndarray,
    arr: ZarrArray,
    origin: tuple[int, ...],
    raw: bytes,
    what: str,
    path: str,
    absent_ok: bool,
) -> None:
    """Unpack one ``sharding_indexed`` shard: its index, then each inner chunk. The index
    must lie in the stored shard, so the inner chunks walked are bounded by its bytes."""
    inner = arr.shard or ()
    per = tuple(c // i if i else 0 for c, i in zip(arr.chunks, inner))
    n = math.prod(per)
    isize = 16 * n + (4 if arr.index_crc else 0)
    if len(raw) < isize:
        raise FormatError(f"{what}: {len(raw)} bytes, shorter than its index ({isize})", path=path)
    index = raw[-isize:] if arr.index_at_end else raw[:isize]
    if arr.index_crc:
        if crc32c(index[:-4]) != int.from_bytes(index[-4:], "little"):
            raise FormatError(f"{what}: shard index CRC-32C mismatch (damaged)", path=path)
        index = index[:-4]
    table = np.frombuffer(index, "<u8").reshape(n, 2) if n else np.zeros((0, 2), "<u8")
    want = math.prod(inner) * arr.dtype.itemsize
    empty = (1 << 64) - 1
    for k, pos in enumerate(product(*(range(p) for p in per))):
        off, length = int(table[k, 0]), int(table[k, 1])
        sub = tuple(o + p * i for o, p, i in zip(origin, pos, inner))
        if off == length == empty:
            if absent_ok or any(s >= dim for s, dim in zip(sub, arr.shape)):
                continue  # the fill value is already there (or the chunk lies past the edge)
            raise FormatError(
                f"{arr.name}: {what} inner chunk {k} is missing from its shard", path=path
            )
        if off + length > len(raw):
            raise FormatError(
                f"{what}: inner chunk {k} [{off}, {off + length}) beyond the shard's {len(raw)} bytes",
                path=path,
            )
        data = _decode(raw[off : off + length], arr.inner, want, f"{what} inner chunk {k}", path)
        _place(out, arr, sub, inner, data, f"{what} inner chunk {k}", path)


def _fill_value(arr: ZarrArray, path: str) -> np.ndarray:
    """The array's fill value as one element of its dtype (zarr's JSON spellings: numbers,
    ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, ``"0x..."`` bit patterns; null is 0). A
    number its dtype cannot hold (300 for uint8, 1.5 for an integer, 1e300 for float32)
    is refused, not wrapped or rounded."""
    v = arr.fill
    try:
        if v is None:
            return np.zeros((), arr.dtype)
        if isinstance(v, str) and v.startswith("0x"):
            bits = np.array(int(v, 16), f"<u{arr.dtype.itemsize}")
            return bits.view(arr.dtype.newbyteorder("<")).astype(arr.dtype)
        if isinstance(v, str):
            v = {"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}.get(v, v)
            v = float(v)
        if not isinstance(v, (bool, int, float)):
            raise TypeError(v)
        with warnings.catch_warnings(), np.errstate(over="raise", invalid="raise", under="ignore"):
            warnings.simplefilter("error")
            out = np.array(v).astype(arr.dtype)
        if arr.dtype.kind in "iub" and out.item() != v:
            raise ValueError(v)
        if isinstance(v, (int, float)) and math.isfinite(v) and not np.isfinite(out):
            raise OverflowError(v)
        return out
    except (TypeError, ValueError, OverflowError, ArithmeticError, RuntimeWarning):
        raise UnsupportedError(
            f"{arr.name}: fill_value {short_repr(arr.fill)} is not a value of {arr.dtype}",
            path=path,
        ) from None


def _check_size(arr: ZarrArray, path: str) -> int:
    """The array's bytes and its chunk's, refused when either is more than one piece of an
    input may take on this machine (:func:`dmlib._limits.max_decompressed`)."""
    cap = _limits.max_decompressed()
    total = arr.nbytes()
    chunk = math.prod(arr.chunks) * arr.dtype.itemsize
    for what, n in (("the array", total), ("one chunk", chunk)):
        if n > cap:
            raise FormatError(
                f"{arr.name}: refused: {what} declares {_limits.human(n)} "
                f"({list(arr.shape if what == 'the array' else arr.chunks)} x "
                f"{arr.dtype.itemsize} bytes), more than the {_limits.human(cap)} one array "
                f"may take on this machine; {_limits.limit_hint()}",
                path=path,
            )
    return total


def _stored(arr: ZarrArray, keys: Iterable[str]) -> list[tuple[tuple[int, ...], str]]:
    """(grid position, key) of every stored chunk, in grid order (other keys ignored)."""
    found = []
    for key in keys:
        idx = arr.chunk_index(key)
        if idx is not None:
            found.append((idx, key))
    return sorted(found)


def _positions(grid: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Grid positions in C order, one at a time (``itertools.product`` would first make a
    tuple of every axis's range: 2**28 integers for a 2**28-chunk axis)."""
    if 0 in grid:
        return
    idx = [0] * len(grid)
    while True:
        yield tuple(idx)
        for ax in reversed(range(len(grid))):
            idx[ax] += 1
            if idx[ax] < grid[ax]:
                break
            idx[ax] = 0
        else:
            return


def _first_missing(arr: ZarrArray, have: set[tuple[int, ...]]) -> str | None:
    """The key of the first grid position not in ``have``: walks at most ``len(have) + 1``
    positions, never the whole grid."""
    if len(have) >= math.prod(arr.grid()):
        return None
    for idx in _positions(arr.grid()):
        if idx not in have:
            return arr.chunk_key(idx)
    return None  # pragma: no cover (fewer stored positions than the grid holds)


def _start(arr: ZarrArray, n_stored: int, absent_ok: bool, path: str) -> np.ndarray:
    """The output before the stored chunks are placed: zeros (pages the system maps only
    when written), or the fill value where absent chunks take a nonzero one; what that
    fills may not exceed what :mod:`dmlib._limits` lets absent (zero stored) bytes become."""
    whole = arr.shard is None and n_stored >= math.prod(arr.grid())  # nothing left to fill
    if not absent_ok or whole:
        return np.zeros(arr.shape, arr.dtype)
    value = _fill_value(arr, path)
    if not value.tobytes().strip(b"\0"):
        return np.zeros(arr.shape, arr.dtype)
    covered = n_stored * math.prod(arr.chunks) * arr.dtype.itemsize
    absent = max(arr.nbytes() - covered, 0)
    if absent > _limits.allowed_output(0):
        raise FormatError(
            f"{arr.name}: refused: absent chunks would fill {_limits.human(absent)} with the "
            f"fill value {short_repr(arr.fill)}, more than {_limits.human(_limits.allowed_output(0))}"
            f" that nothing stored may become on this machine; {_limits.limit_hint()}",
            path=path,
        )
    return np.full(arr.shape, value, arr.dtype)


def read_array(
    arr: ZarrArray, get: Get, path: str, *, absent_ok: bool, keys: Iterable[str]
) -> np.ndarray:
    """The whole array, its stored chunks read and placed (C order, stored byte order).

    ``keys``: the store's keys under the array (only those that are chunk keys of its
    grid are read). ``absent_ok``: a chunk that is not stored holds the fill value (the
    writer skipped chunks equal to it); otherwise an absent chunk is an error naming its key.
    """
    _check_size(arr, path)
    want = math.prod(arr.chunks) * arr.dtype.itemsize
    codecs = arr.inner if arr.zarr_format == 3 else [{"name": arr.compressor}]
    if arr.chunks == arr.shape and arr.shard is None and arr.order == "C" and 0 not in arr.shape:
        # one chunk the size of the array (Orbax's layout on one device): no placement copy
        key = arr.chunk_key(tuple(0 for _ in arr.shape))
        raw = get(key)
        if raw is not None:
            data = _decode(raw, codecs, want, f"chunk {key}", path)
            if len(data) != want:
                raise FormatError(
                    f"chunk {key}: decodes to {len(data)} bytes, a chunk of "
                    f"{list(arr.chunks)} is {want}",
                    path=path,
                )
            return np.frombuffer(data, arr.dtype).reshape(arr.shape)
    if 0 in arr.shape:
        return np.zeros(arr.shape, arr.dtype)
    stored = _stored(arr, keys)
    missing = None if absent_ok else _first_missing(arr, {i for i, _ in stored})
    if missing is not None:
        raise FormatError(f"{arr.name}: chunk {missing} is missing", path=path)
    out = _start(arr, len(stored), absent_ok, path)
    for idx, key in stored:
        raw = get(key)
        origin = tuple(i * c for i, c in zip(idx, arr.chunks))
        if raw is None:  # listed, then gone: the store changed while read
            raise FormatError(f"{arr.name}: chunk {key} is missing", path=path)
        if arr.shard is not None:
            _shard(out, arr, origin, raw, f"chunk {key}", path, absent_ok)
            continue
        data = _decode(raw, codecs, want, f"chunk {key}", path)
        _place(out, arr, origin, arr.chunks, data, f"chunk {key}", path)
    return out
