"""Named tensors: what every reader returns and every statistic consumes.

A :class:`Tensor` is a lazy handle: metadata now, bytes on ``load()``. File-backed
tensors are read-only views into one memory map of the file, so opening a
multi-gigabyte checkpoint costs nothing until a tensor is touched, and nothing can
write to the input through them.
"""

from __future__ import annotations

import copy
import math
import os
import stat
import time
from collections.abc import Iterator, Mapping
from typing import Any, cast

import numpy as np

from dmlib import hashing
from dmlib.errors import DmlibError, FormatError, TensorNotFoundError

Scalar = int | float | bool | str | None


class FileStamp:
    """What a file looked like when a reader opened it: size, mtime, ctime, inode, device.

    Every tensor read from the file carries its set's stamp; :meth:`check` runs before its
    bytes are handed out and after a comparison or a hash of them, so a file truncated,
    rewritten in place or replaced while dmlib reads it is refused ("changed while
    reading") instead of yielding a result of neither version, and a shrunk memory map is
    not touched (which would kill the process with SIGBUS).
    """

    __slots__ = ("path", "key", "_ok")

    #: seconds a successful check vouches for the file where ``recent=True`` is asked (the
    #: checks before each chunk), so many small tensors of one file cost one stat per pair
    RECENT = 0.001

    def __init__(self, path: str, st: os.stat_result) -> None:
        self.path = path
        self.key = _stat_key(st)
        self._ok = -math.inf  # when a check last found the file unchanged (never, yet)

    def __getstate__(self) -> tuple[str, tuple[int, ...]]:
        return self.path, self.key

    def __setstate__(self, state: tuple[str, tuple[int, ...]]) -> None:
        self.path, self.key = state
        self._ok = -math.inf

    @classmethod
    def take(cls, path: str | os.PathLike[str] | None) -> FileStamp | None:
        """The stamp of a regular file now (None for no path, a folder, or an unreadable one)."""
        if path is None:
            return None
        path = os.fspath(path)
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        return cls(path, st) if stat.S_ISREG(st.st_mode) else None

    def check(self, *, recent: bool = False) -> None:
        """Raise :class:`FormatError` ("changed while reading") if the file is not as stamped.

        ``recent``: a check that passed less than :attr:`RECENT` seconds ago is enough
        (for the guards before a chunk is touched; the checks before a result is
        returned always stat the file).
        """
        if recent and time.monotonic() - self._ok < self.RECENT:
            return
        try:
            now: tuple[int, ...] | None = _stat_key(os.stat(self.path))
        except (OSError, ValueError):
            now = None
        if now == self.key:
            self._ok = time.monotonic()
            return
        if now is None:
            what = "it is gone"
        elif now[0] != self.key[0]:
            what = f"size {self.key[0]} -> {now[0]} bytes"
        elif now[3:] != self.key[3:]:
            what = "replaced by another file"
        else:
            what = "modified in place (its modification time changed)"
        raise FormatError(
            f"changed while reading ({what}); no result computed from it is reported",
            path=self.path,
        )


def _stat_key(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


#: packing -> values per byte
PACKINGS = {"fp4x2": 2}


def unpack(raw: np.ndarray, packing: str) -> np.ndarray:
    """Packed sub-byte values to one ``uint8`` bit pattern per element (a new array).

    ``"fp4x2"``: two 4-bit values per byte, the first in the low nibble (PyTorch's
    ``float4_e2m1fn_x2`` and safetensors' ``F4``, after the OCP MX spec, section 5.3.3).
    """
    if packing != "fp4x2":
        raise DmlibError(f"unknown packing {packing!r}")
    raw = np.asarray(raw, np.uint8).reshape(-1)
    out = np.empty(2 * raw.size, np.uint8)
    np.bitwise_and(raw, 0x0F, out=out[0::2])
    np.right_shift(raw, 4, out=out[1::2])
    return out


class Tensor:
    """One named tensor of a file (or of memory).

    Attributes
    ----------
    name, dtype, shape
        As stored. ``dtype`` is a numpy dtype (bfloat16/float8 via ml_dtypes); for
        quantized tensors (burnpack ``QFloat``) it is ``uint8`` and ``load()`` returns
        the raw packed bytes, ``quantized`` is True, and ``shape`` is the logical shape.
    dtype_name
        The format's own name for the dtype (``"F32"``, ``"Flex32"``, ``"Bool(Native)"``...).
    offset
        Absolute byte offset of the first byte in the file (None for in-memory tensors).
    nbytes
        Length of the stored bytes.
    param_id
        Burn's per-process parameter id, where the format has one; otherwise None.
    record
        Index of the record (burnpack files may hold several back to back).
    packing
        ``"fp4x2"`` for float4 values stored two to a byte (first value in the low
        nibble): ``raw()`` is the packed bytes, ``load()`` unpacks them to one
        ``float4_e2m1fn`` per byte. None for one element per ``dtype.itemsize`` bytes.
    opaque
        The format names a dtype dmlib cannot interpret: ``dtype`` is ``uint8``,
        ``load()`` returns the stored bytes, and comparisons are byte by byte.
    """

    __slots__ = (
        "name",
        "dtype",
        "shape",
        "offset",
        "nbytes",
        "param_id",
        "dtype_name",
        "record",
        "quantized",
        "packing",
        "opaque",
        "_source",
        "_path",
        "_in_buffer",
        "_stamp",
    )

    def __init__(
        self,
        name: str,
        dtype: np.dtype,
        shape: tuple[int, ...],
        *,
        nbytes: int,
        offset: int | None = None,
        param_id: int | None = None,
        dtype_name: str | None = None,
        record: int = 0,
        quantized: bool = False,
        packing: str | None = None,
        opaque: bool = False,
        source: Any = None,
        path: str | None = None,
        in_buffer: bool | None = None,
    ) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        self.offset = offset
        self.nbytes = int(nbytes)
        self.param_id = param_id
        self.dtype_name = dtype_name or self.dtype.name
        self.record = record
        self.opaque = opaque
        # opaque bytes are compared the way quantized ones are: byte by byte
        self.quantized = quantized or opaque
        self.packing = packing
        self._source = source
        self._path = path
        # True: ``source`` is the whole file's uint8 map and the tensor is bytes
        # [offset, offset + nbytes) of it. False: ``source`` is the tensor's own array.
        if in_buffer is None:
            in_buffer = (
                offset is not None
                and isinstance(source, np.ndarray)
                and source.dtype == np.uint8
                and source.ndim == 1
                and source.shape != self.shape
            )
        self._in_buffer = in_buffer
        self._stamp: FileStamp | None = None  # set by the TensorSet (see FileStamp)

    @property
    def numel(self) -> int:
        """The element count: the product of the shape."""
        return math.prod(self.shape)

    @property
    def path(self) -> str | None:
        """The file the tensor was read from (None when none was given)."""
        return self._path

    def raw(self) -> np.ndarray:
        """The stored bytes as a read-only 1-D ``uint8`` array (a view where possible)."""
        src = self._source
        if src is None:
            raise DmlibError(
                f"tensor {self.name!r} has no data source (file closed?)", path=self._path
            )
        if self._stamp is not None:
            self._stamp.check(recent=True)
        if callable(src):
            arr = src()
        elif self._in_buffer:
            start = cast(int, self.offset)  # a tensor in a buffer always has its offset
            arr = src[start : start + self.nbytes]
        else:
            arr = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        if arr.flags.writeable:
            arr = arr.view()
            arr.flags.writeable = False
        return arr

    def load(self) -> np.ndarray:
        """The tensor as a read-only numpy array of ``dtype`` and ``shape`` (zero-copy if possible)."""
        raw = self.raw()
        if self.quantized:
            return raw
        if self.packing is not None:
            arr = unpack(raw, self.packing).view(self.dtype).reshape(self.shape)
            arr.flags.writeable = False
            return arr
        arr = raw.view(self.dtype).reshape(self.shape)
        arr.flags.writeable = False
        return arr

    def data_hash(self) -> str:
        """SHA-256 (hex) of exactly this tensor's stored bytes."""
        digest = hashing.hash_bytes(self.raw())
        self.check_unchanged()
        return digest

    def check_unchanged(self, *, recent: bool = False) -> None:
        """Refuse (:class:`FormatError`, "changed while reading") if the tensor's file
        changed since it was opened; nothing for in-memory tensors. ``recent``: see
        :meth:`FileStamp.check`."""
        if self._stamp is not None:
            self._stamp.check(recent=recent)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.load()
        return arr if dtype is None else arr.astype(dtype)

    @property
    def dtype_label(self) -> str:
        """The one spelling dmlib prints: numpy's name (``float32``, ``bfloat16``...).

        Quantized tensors keep the format's name (their numpy dtype is the packed bytes').
        """
        return self.dtype_name if self.quantized else self.dtype.name

    def describe(self) -> dict[str, Any]:
        """Where and what this tensor is, as one row: name, dtype (numpy's name),
        format_dtype (the format's own), shape, numel, offset, nbytes, param_id, record."""
        return {
            "name": self.name,
            "dtype": self.dtype_label,
            "format_dtype": self.dtype_name,
            "shape": list(self.shape),
            "numel": self.numel,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "param_id": self.param_id,
            "record": self.record,
        }

    def __repr__(self) -> str:
        where = f" @ {self.offset}" if self.offset is not None else ""
        pid = f" param_id={self.param_id}" if self.param_id is not None else ""
        return f"<Tensor {self.name!r} {self.dtype_label} {list(self.shape)}{where}{pid}>"


class TensorSet(Mapping[str, Tensor]):
    """A read-only mapping name -> :class:`Tensor`, plus what the file says about itself.

    Attributes
    ----------
    path
        The file (None for in-memory sets).
    format
        ``"burnpack"``, ``"safetensors"``, ``"npy"``, ``"npz"``, ``"torch"`` or ``"memory"``.
    metadata
        str -> str metadata of the file (burnpack ``metadata``, safetensors ``__metadata__``).
    scalars
        Named plain values (burnpack ``scalars``: training step counters and the like;
        a torch checkpoint's non-tensor leaves: ``step``, an optimizer's ``lr``...).
    records
        For burnpack: one :class:`Record` per record image in the file (a plain file has
        one). Other formats: empty.
    layout
        Format-specific facts about the layout (data base, alignment, layout variant...).
    closer
        Called once by :meth:`close` (a reader's file handle, for instance).
    buffer
        The file's bytes (read-only ``uint8`` memory map) that :meth:`read_range` reads
        and the tensors view; None for in-memory sets.
    """

    def __init__(
        self,
        tensors: Mapping[str, Tensor] | None = None,
        *,
        path: str | os.PathLike[str] | None = None,
        format: str = "memory",
        metadata: Mapping[str, str] | None = None,
        scalars: Mapping[str, Scalar] | None = None,
        records: tuple[Any, ...] = (),
        layout: Mapping[str, Any] | None = None,
        closer: Any = None,
        buffer: np.ndarray | None = None,
        stamp: FileStamp | None = None,
    ) -> None:
        self._tensors: dict[str, Tensor] = dict(tensors or {})
        self.path = None if path is None else os.fspath(path)
        self.format = format
        self.metadata: dict[str, str] = dict(metadata or {})
        self.scalars: dict[str, Scalar] = dict(scalars or {})
        self.records = tuple(records)
        self.layout: dict[str, Any] = dict(layout or {})
        self._closer = closer
        self._buf: np.ndarray | None = buffer
        # the file as it was when opened (readers pass the stamp taken before they read
        # the header); every tensor of a file gets that file's stamp
        self.stamp: FileStamp | None = stamp if stamp is not None else FileStamp.take(self.path)
        stamps: dict[str | None, FileStamp | None] = {self.path: self.stamp}
        for t in self._tensors.values():
            if t._stamp is None and t._path is not None:
                if t._path not in stamps:
                    stamps[t._path] = FileStamp.take(t._path)
                t._stamp = stamps[t._path]

    # Mapping protocol
    def __getitem__(self, name: str) -> Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise TensorNotFoundError(
                f"no tensor named {name!r} ({len(self._tensors)} tensors"
                + (f", e.g. {next(iter(self._tensors))!r}" if self._tensors else "")
                + ")",
                path=self.path,
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    # context manager
    def __enter__(self) -> TensorSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop this set's reference to the file's memory map.

        Arrays already returned by ``load()`` stay valid (they keep the map alive); the
        tensors of a closed set refuse to load.
        """
        if self._closer is not None:
            closer, self._closer = self._closer, None
            closer()
        if self._buf is not None:
            self._buf = None
            for t in self._tensors.values():
                if t.path is not None:
                    t._source = None
            for r in self.records:
                if r is not self:
                    r.close()

    def read_range(self, start: int, end: int) -> np.ndarray:
        """Read-only ``uint8`` view of the file's bytes ``[start, end)`` (for padding analyses)."""
        buf = self._buf
        if buf is None:
            raise DmlibError("no file bytes to read (in-memory set, or closed)", path=self.path)
        if not 0 <= start <= end <= len(buf):
            raise DmlibError(
                f"byte range [{start}, {end}) is outside the file (0..{len(buf)})", path=self.path
            )
        view = buf[start:end]
        return view

    def check_unchanged(self) -> None:
        """Refuse (:class:`FormatError`, "changed while reading") if any file this set
        reads changed since it was opened."""
        seen = {id(self.stamp): self.stamp} if self.stamp is not None else {}
        for t in self._tensors.values():
            if t._stamp is not None:
                seen.setdefault(id(t._stamp), t._stamp)
        for s in seen.values():
            s.check()

    def renamed(self, names: Mapping[str, str]) -> TensorSet:
        """A set over the same bytes with tensors renamed ``old -> new`` (others keep their name)."""
        tensors = {}
        for old, t in self._tensors.items():
            new = names.get(old, old)
            if new != old:
                t = copy.copy(t)
                t.name = new
            tensors[new] = t
        return TensorSet(
            tensors,
            path=self.path,
            format=self.format,
            metadata=self.metadata,
            scalars=self.scalars,
            layout=self.layout,
            buffer=self._buf,
            stamp=self.stamp,
        )

    # derived facts
    def disk_order(self) -> list[Tensor]:
        """Tensors in the order their bytes lie in the file (name order for in-memory sets)."""
        ts = list(self._tensors.values())
        if all(t.offset is not None for t in ts):
            ts.sort(key=lambda t: (t.path or "", t.offset, t.nbytes, t.name))
        return ts

    @property
    def numel(self) -> int:
        """The element count of all its tensors together."""
        return sum(t.numel for t in self._tensors.values())

    def file_hash(self) -> str | None:
        """SHA-256 of the whole file (None for in-memory sets)."""
        if self.path is None or not os.path.isfile(self.path):
            return None
        if self.stamp is not None:
            self.stamp.check()
        digest = hashing.hash_file(self.path)
        if self.stamp is not None:  # a hash of neither version is never reported
            self.stamp.check()
        return digest

    def data_hash(self) -> str:
        """SHA-256 of all tensor bytes in disk order, metadata and padding excluded.

        Two files with the same parameter values but different metadata (Burn's
        per-process ``param_id``) have the same data hash and different file hashes.
        """
        digest = hashing.hash_chunks(t.raw() for t in self.disk_order())
        self.check_unchanged()
        return digest

    def table(self):  # -> pandas.DataFrame
        """One row per tensor in disk order: name, dtype (numpy's name), format_dtype (the
        format's own), shape, numel, offset, nbytes, param_id, record."""
        import pandas as pd

        rows = [t.describe() for t in self.disk_order()]
        cols = ["name", "dtype", "shape", "numel", "offset", "nbytes", "param_id", "record"]
        df = pd.DataFrame(rows, columns=cols)
        # u64 ids above 2**63 would become inexact floats; keep them exact
        df["param_id"] = pd.array([r["param_id"] for r in rows], dtype="UInt64")
        return df

    def __repr__(self) -> str:
        where = f" {self.path!r}" if self.path else ""
        return f"<TensorSet {self.format}{where}: {len(self)} tensors>"


class ArrayTensorSet(TensorSet):
    """A TensorSet over in-memory arrays (derived tensors, tests, torch state dicts)."""

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        *,
        path: str | os.PathLike[str] | None = None,
        format: str = "memory",
        metadata: Mapping[str, str] | None = None,
        scalars: Mapping[str, Scalar] | None = None,
    ) -> None:
        tensors = {}
        for name, arr in arrays.items():
            # np.ascontiguousarray returns at least 1-d: a 0-d array (optax's ``count``)
            # must keep its shape ()
            a = np.asarray(arr)
            if not a.flags.c_contiguous:
                a = np.ascontiguousarray(a)
            tensors[name] = Tensor(
                name,
                a.dtype,
                a.shape,
                nbytes=a.nbytes,
                source=a,
                path=None if path is None else os.fspath(path),
            )
        super().__init__(tensors, path=path, format=format, metadata=metadata, scalars=scalars)
