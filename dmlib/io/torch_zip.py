"""``torch.save`` files read without importing torch.

The zip format (torch >= 1.6): ``<archive>/data.pkl`` is a pickle whose tensors are
``torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)`` calls, each
storage a persistent id ``('storage', <storage class>, key, location, numel)`` naming the
member ``<archive>/data/<key>``, stored uncompressed. The legacy format (torch < 1.6,
``_use_new_zipfile_serialization=False``): five pickles back to back (magic number,
protocol, system info, the object, the storage keys), then each storage as an 8-byte
little-endian element count and its bytes.

The pickle goes through :mod:`dmlib.io._unpickle` with the table below; storages are
memory-mapped where they lie in the file (local header, size and placement checked, CRC
checked on first use), and each tensor is a numpy view of its storage, checked to lie
inside it. A name torch's weights-only loader reads and this table does not
(quantized and sparse tensors, big-endian files) raises :class:`NeedsTorch`: the caller
then reads the file with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import math
import re
import struct
import zipfile
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from dmlib import _limits
from dmlib.errors import FormatError, LayoutError, TruncatedError, UnsafePickleError
from dmlib.io import _unpickle, _zips
from dmlib.io._checks import shape_problem
from dmlib.io._unpickle import BASE_TABLE, Const, Func, NeedsTorch

# torch dtype -> (bytes per element, the numpy type of its bits or None: stored bytes only)
DTYPES: dict[str, tuple[int, str | None]] = {
    "float64": (8, "<f8"), "float32": (4, "<f4"), "float16": (2, "<f2"),
    "bfloat16": (2, "bfloat16"), "int64": (8, "<i8"), "int32": (4, "<i4"),
    "int16": (2, "<i2"), "int8": (1, "i1"), "uint8": (1, "u1"), "uint16": (2, "<u2"),
    "uint32": (4, "<u4"), "uint64": (8, "<u8"), "bool": (1, "?"),
    "complex64": (8, "<c8"), "complex128": (16, "<c16"), "complex32": (4, "<f2"),
    "float8_e4m3fn": (1, "float8_e4m3fn"), "float8_e5m2": (1, "float8_e5m2"),
    "float8_e4m3fnuz": (1, "float8_e4m3fnuz"), "float8_e5m2fnuz": (1, "float8_e5m2fnuz"),
    "float8_e8m0fnu": (1, "float8_e8m0fnu"), "float4_e2m1fn_x2": (1, "u1"),
    "bits8": (1, None), "bits16": (2, None), "bits1x8": (1, None), "bits2x4": (1, None),
    "bits4x2": (1, None),
}  # fmt: skip
FLOATING = {n for n in DTYPES if n.startswith(("float", "bfloat"))}
# the storage classes torch.save names for the dtypes that have one
STORAGE_CLASSES = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8",
    "BoolStorage": "bool", "ComplexFloatStorage": "complex64",
    "ComplexDoubleStorage": "complex128",
}  # fmt: skip


def numpy_dtype(name: str) -> np.dtype | None:
    """The numpy dtype of a torch dtype's bits (ml_dtypes for bfloat16 and float8)."""
    code = DTYPES[name][1]
    if code is None:
        return None
    if code[0] in "<|" or code in ("i1", "u1", "?"):
        return np.dtype(code)
    import ml_dtypes  # only files holding such a dtype need it

    return np.dtype(getattr(ml_dtypes, code))


class dtype(Const):  # noqa: N801  (named as torch's, for "entries not read: x (dtype)")
    """A torch dtype constant (``torch.float32``...)."""


class device(Const):  # noqa: N801
    """A ``torch.device``: where a tensor lived; dmlib reads everything on the CPU."""


class Storage:
    """One storage: bytes ``[start, start + nbytes)`` of a buffer, CRC-checked on first use."""

    __slots__ = ("key", "dtype", "nbytes", "_buf", "_start", "_crc", "_what")

    def __init__(
        self, key: str, dtype: str | None, buf: np.ndarray, start: int, nbytes: int,
        crc: int | None, what: str,
    ) -> None:  # fmt: skip
        self.key, self.dtype, self.nbytes = key, dtype, nbytes
        self._buf, self._start, self._crc, self._what = buf, start, crc, what

    def data(self, path: str | None) -> np.ndarray:
        """The storage's bytes, checked against its CRC on first use (FormatError if damaged)."""
        arr = self._buf[self._start : self._start + self.nbytes]
        if self._crc is not None:
            if zlib.crc32(memoryview(arr)) != self._crc:  # type: ignore[arg-type]
                raise FormatError(
                    f"{self._what}: storage {self.key!r} does not match its CRC (damaged bytes)",
                    path=path,
                )
            self._crc = None
        return arr


class StoredTensor:
    """A tensor of a torch file: a strided view of a :class:`Storage`, read on ``array()``."""

    __slots__ = ("dtype_name", "shape", "stride", "offset", "storage")

    def __init__(
        self, dtype_name: str, shape: tuple[int, ...], stride: tuple[int, ...], offset: int,
        storage: Storage,
    ) -> None:  # fmt: skip
        self.dtype_name, self.shape, self.stride = dtype_name, shape, stride
        self.offset, self.storage = offset, storage

    def dim(self) -> int:
        """The number of dimensions."""
        return len(self.shape)

    def is_floating_point(self) -> bool:
        """Whether the dtype is a float or bfloat type (:data:`FLOATING`)."""
        return self.dtype_name in FLOATING

    @property
    def numel(self) -> int:
        """The element count: the product of the shape."""
        return math.prod(self.shape)

    def array(self, path: str | None) -> np.ndarray:
        """The tensor as a read-only numpy array of its bits' type (a view where possible).

        complex32 gets one more axis (real, imaginary float16); a dtype numpy cannot
        hold (``bits16``...) is ``uint8`` with one more axis of its bytes.
        """
        item = DTYPES[self.dtype_name][0]
        base = numpy_dtype(self.dtype_name)
        # a dimension of length 1 never steps: its stride (any size in the file) is not used
        shape = self.shape
        strides = tuple(0 if n == 1 else s * item for n, s in zip(shape, self.stride, strict=True))
        if self.dtype_name == "complex32" or base is None:
            base = np.dtype("<f2") if base is not None else np.dtype("u1")
            shape, strides = (*shape, item // base.itemsize), (*strides, base.itemsize)
        if not self.numel:
            return np.zeros(shape, base)
        raw = self.storage.data(path)
        start = self.offset * item
        return (
            np.lib.stride_tricks.as_strided(
                raw[start:].view(np.uint8), shape=shape, strides=strides, writeable=False
            ).view(base)
            if base.itemsize == 1
            else np.lib.stride_tricks.as_strided(
                _typed(raw[start:], base), shape=shape, strides=strides, writeable=False
            )
        )


def _typed(raw: np.ndarray, base: np.dtype) -> np.ndarray:
    usable = raw.size - raw.size % base.itemsize
    return raw[:usable].view(base)


class NumpyArray:
    """A numpy array pickled inside a torch file (``np.random.get_state()``'s key array)."""

    __slots__ = ("array", "qualname")

    def __init__(self) -> None:
        self.array: np.ndarray | None = None
        self.qualname = "numpy.ndarray"

    def pickle_build(self, state: Any) -> None:
        """Set :attr:`array` from a BUILD state ``(version, shape, dtype, fortran, bytes)``.

        UnsafePickleError for a state of another form, a dtype that is not a :class:`NumpyDtype`,
        a shape that is not a tuple of at most 64 non-negative ints, or a byte count that does
        not match shape x itemsize.
        """
        if not (isinstance(state, tuple) and len(state) == 5):
            raise UnsafePickleError("BUILD of a numpy array with a state of another form")
        _version, shape, dt, fortran, raw = state
        if not isinstance(dt, NumpyDtype) or type(fortran) is not bool:
            raise UnsafePickleError("BUILD of a numpy array whose dtype is not a plain number type")
        if not (
            isinstance(shape, tuple)
            and len(shape) <= 64
            and all(type(s) is int and s >= 0 for s in shape)
        ):
            raise UnsafePickleError("BUILD of a numpy array with a malformed shape")
        if shape_problem(list(shape), dt.np.itemsize) is not None:
            raise UnsafePickleError(
                "BUILD of a numpy array whose shape claims more than 2**63 bytes"
            )
        if type(raw) is not bytes or len(raw) != math.prod(shape) * dt.np.itemsize:
            raise UnsafePickleError(
                f"BUILD of a numpy array whose data is not {math.prod(shape)} x {dt.np.itemsize} bytes"
            )
        arr = np.frombuffer(raw, dt.np).reshape(shape, order="F" if fortran else "C")
        self.array = arr


class NumpyDtype:
    """A plain numeric numpy dtype (``np.dtype('u4')``); BUILD may set its byte order."""

    __slots__ = ("np", "qualname")

    def __init__(self, code: str) -> None:
        self.np = np.dtype(code)
        self.qualname = "numpy.dtype"

    def pickle_build(self, state: Any) -> None:
        """Apply a BUILD state: its byte order ``<`` or ``>`` is set on the dtype.

        UnsafePickleError for a state with fields, a subarray or another form.
        """
        if not (
            isinstance(state, tuple)
            and len(state) >= 5
            and state[1] in "<>|="
            and state[2] is None
            and state[3] is None
            and state[4] is None
        ):
            raise UnsafePickleError(
                "BUILD of a numpy dtype with fields, a subarray or another form"
            )
        if state[1] in "<>":
            self.np = self.np.newbyteorder(state[1])


_DTYPE_CODE = re.compile(r"[<>|=]?(?:b1|\?|[iuf][1248]|f16|c8|c16|c32)")


def _np_dtype(code: Any, align: Any = False, copy: Any = True) -> NumpyDtype:
    if type(code) is not str or not _DTYPE_CODE.fullmatch(code):
        raise UnsafePickleError(f"numpy.dtype of {code!r:.40}, not a plain number type")
    return NumpyDtype(code)


def _np_reconstruct(cls: Any, shape: Any, code: Any) -> NumpyArray:
    if cls is not _NDARRAY:
        raise UnsafePickleError(
            f"numpy _reconstruct builds {_unpickle._what(cls)}, not a plain ndarray"
        )
    return NumpyArray()


_NDARRAY = Const("numpy.ndarray")


def _size(*args: Any) -> tuple[int, ...]:
    dims = args[0] if args else ()
    if not (
        isinstance(dims, (tuple, list)) and len(dims) <= 64 and all(type(d) is int for d in dims)
    ):
        raise UnsafePickleError("torch.Size of something other than integers")
    return tuple(dims)


def _device(*args: Any) -> device:
    if not (1 <= len(args) <= 2 and type(args[0]) is str and all(type(a) is int for a in args[1:])):
        raise UnsafePickleError("torch.device of something other than a device name")
    return device(f"device({args[0]!r})", args)


def _no_hooks(hooks: Any, what: str) -> None:
    if not (type(hooks) in (dict, OrderedDict) and not hooks):
        raise UnsafePickleError(f"{what} with backward hooks")


def _shape_ok(size: Any, stride: Any, offset: Any) -> bool:
    ints = (tuple, list)
    return (
        isinstance(size, ints) and isinstance(stride, ints) and len(size) == len(stride) <= 64
        and all(type(s) is int and s >= 0 for s in (*size, *stride))
        and type(offset) is int and offset >= 0
    )  # fmt: skip


def _tensor(storage: Any, offset: Any, size: Any, stride: Any, dt: str | None) -> StoredTensor:
    if not isinstance(storage, Storage):
        raise UnsafePickleError(
            f"a tensor rebuilt from {_unpickle._what(storage)}, not a storage of the file"
        )
    dt = storage.dtype if dt is None else dt
    if dt is None or (storage.dtype is not None and storage.dtype != dt):
        raise FormatError(f"storage {storage.key!r} is {storage.dtype}, the tensor says {dt}")
    if not _shape_ok(size, stride, offset):
        raise FormatError(
            f"a tensor on storage {storage.key!r} has a malformed size, stride or offset"
        )
    item = DTYPES[dt][0]
    size, stride = tuple(size), tuple(stride)
    problem = shape_problem(list(size), item)  # numpy's bound, zero-length dimensions too
    if problem is not None:
        raise FormatError(f"a tensor on storage {storage.key!r}: {problem}")
    numel = math.prod(size)
    if numel:
        last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if (last + 1) * item > storage.nbytes:
            raise LayoutError(
                f"a tensor of size {_dims(size)}, stride {_dims(stride)} at offset {offset} reads "
                f"element {last} of storage {storage.key!r}, which holds {storage.nbytes // item}"
            )
        if numel * item > max(storage.nbytes, _limits.max_decompressed()):
            # strides that repeat elements (an expand()ed view): read, it is copied whole
            raise FormatError(
                f"refused: a tensor of size {_dims(size)}, stride {_dims(stride)} repeats the "
                f"{_limits.human(storage.nbytes)} of storage {storage.key!r} into "
                f"{_limits.human(numel * item)}, more than the "
                f"{_limits.human(_limits.max_decompressed())} one tensor may be expanded to "
                f"on this machine; {_limits.limit_hint()}"
            )
    return StoredTensor(dt, size, stride, offset, storage)


def _dims(xs: tuple[int, ...]) -> str:
    """A size or stride for a message: at most 8 numbers, each cut to 24 digits."""
    text = [
        str(x) if x.bit_length() < 80 else f"{str(x)[:20]}...({len(str(x))} digits)" for x in xs[:8]
    ]
    return "[" + ", ".join(text) + (", ..." if len(xs) > 8 else "") + "]"


def _rebuild_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                hooks: Any = None, metadata: Any = None) -> StoredTensor:  # fmt: skip
    _no_hooks(OrderedDict() if hooks is None else hooks, "torch._utils._rebuild_tensor_v2")
    if metadata:
        raise NeedsTorch("torch._utils._rebuild_tensor_v2 with tensor metadata")
    return _tensor(storage, offset, size, stride, None)


def _rebuild_v3(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any,
                hooks: Any, dt: Any, metadata: Any = None) -> StoredTensor:  # fmt: skip
    _no_hooks(hooks, "torch._utils._rebuild_tensor_v3")
    if not isinstance(dt, dtype):
        raise UnsafePickleError(f"torch._utils._rebuild_tensor_v3 with dtype {_unpickle._what(dt)}")
    if metadata:
        raise NeedsTorch("torch._utils._rebuild_tensor_v3 with tensor metadata")
    return _tensor(storage, offset, size, stride, dt.value)


def _rebuild_v1(storage: Any, offset: Any, size: Any, stride: Any) -> StoredTensor:
    return _tensor(storage, offset, size, stride, None)


def _rebuild_parameter(
    data: Any, requires_grad: Any, hooks: Any, state: Any = None
) -> StoredTensor:
    if not isinstance(data, StoredTensor):
        raise UnsafePickleError(f"torch._utils._rebuild_parameter of {_unpickle._what(data)}")
    _no_hooks(hooks, "torch._utils._rebuild_parameter")
    if state not in (None, {}, (None, {}), ({}, {}), (None, None)) and not (
        isinstance(state, dict) and all(type(k) is str for k in state)
    ):
        raise UnsafePickleError(
            "torch._utils._rebuild_parameter_with_state of a state of another form"
        )
    return data


_REBUILDERS: dict[str, Func] = {}
_TENSOR_TYPES = {"torch.Tensor", "torch.nn.parameter.Parameter"}


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any = None) -> Any:
    if not (isinstance(func, Func) and func in _REBUILDERS.values()):
        raise UnsafePickleError(
            f"torch._tensor._rebuild_from_type_v2 calls {_unpickle._what(func)}"
        )
    if not (isinstance(new_type, Const) and new_type.qualname in _TENSOR_TYPES):
        raise UnsafePickleError(
            f"torch._tensor._rebuild_from_type_v2 of type {_unpickle._what(new_type)}"
        )
    if type(args) is not tuple or not (
        state is None or (isinstance(state, dict) and all(type(k) is str for k in state))
    ):
        raise UnsafePickleError(
            "torch._tensor._rebuild_from_type_v2 with arguments of another form"
        )
    return func.fn(*args)


_REBUILDERS.update(
    v2=Func("torch._utils._rebuild_tensor_v2", _rebuild_v2),
    v3=Func("torch._utils._rebuild_tensor_v3", _rebuild_v3),
    v1=Func("torch._utils._rebuild_tensor", _rebuild_v1),
    param=Func("torch._utils._rebuild_parameter", _rebuild_parameter),
    param_state=Func("torch._utils._rebuild_parameter_with_state", _rebuild_parameter),
)

_UNTYPED = Const("torch.storage.UntypedStorage")

TABLE: dict[tuple[str, str], Any] = {
    **BASE_TABLE,
    ("torch._utils", "_rebuild_tensor_v2"): _REBUILDERS["v2"],
    ("torch._utils", "_rebuild_tensor_v3"): _REBUILDERS["v3"],
    ("torch._utils", "_rebuild_tensor"): _REBUILDERS["v1"],
    ("torch._utils", "_rebuild_parameter"): _REBUILDERS["param"],
    ("torch._utils", "_rebuild_parameter_with_state"): _REBUILDERS["param_state"],
    ("torch._tensor", "_rebuild_from_type_v2"): Func("torch._tensor._rebuild_from_type_v2", _rebuild_from_type),
    ("torch.storage", "UntypedStorage"): _UNTYPED,
    ("torch", "Size"): Func("torch.Size", _size),
    ("torch", "device"): Func("torch.device", _device),
    ("torch", "Tensor"): Const("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): Const("torch.nn.parameter.Parameter"),
    **{("torch", n): dtype(f"torch.{n}", n) for n in DTYPES},
    **{("torch", c): Const(f"torch.{c}", d) for c, d in STORAGE_CLASSES.items()},
    # numpy values inside torch files (the Trainer's rng_state.pth holds np.random.get_state())
    ("numpy.core.multiarray", "_reconstruct"): Func("numpy.core.multiarray._reconstruct", _np_reconstruct),
    ("numpy._core.multiarray", "_reconstruct"): Func("numpy._core.multiarray._reconstruct", _np_reconstruct),
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy", "dtype"): Func("numpy.dtype", _np_dtype),
    **{("numpy.dtypes", f"{n}DType"): Func(f"numpy.dtypes.{n}DType", _np_dtype) for n in (
        "Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64",
        "Float16", "Float32", "Float64", "Complex64", "Complex128", "Byte", "UByte", "Short",
        "UShort", "Int", "UInt", "Long", "ULong", "LongLong", "ULongLong", "Half", "Float", "Double",
    )},
}  # fmt: skip

# names torch.load(weights_only=True) reads that this reader leaves to it
TORCH_ONLY: frozenset[tuple[str, str]] = frozenset(
    [("torch._utils", f) for f in (
        "_rebuild_qtensor", "_rebuild_sparse_tensor", "_rebuild_nested_tensor",
        "_rebuild_meta_tensor_no_storage", "_rebuild_wrapper_subclass",
        "_rebuild_device_tensor_from_numpy", "_rebuild_device_tensor_from_cpu_tensor",
    )]
    + [("torch", n) for n in (
        "QInt8Storage", "QUInt8Storage", "QInt32Storage", "QUInt4x2Storage", "QUInt2x4Storage",
        "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "per_tensor_affine",
        "per_tensor_symmetric", "per_channel_affine", "per_channel_symmetric",
        "per_channel_affine_float_qparams",
    )]
    + [("torch.serialization", "_get_layout"), ("torch.storage", "TypedStorage"),
       ("collections", "Counter")]
)  # fmt: skip


# -- zip archives --------------------------------------------------------------------------


def _members(
    zf: zipfile.ZipFile, buf: np.ndarray, what: str, path: str | None
) -> dict[str, tuple[int, int, int]]:
    """name -> (data start, size, CRC) of every member, one reading of the archive
    (:func:`dmlib.io._zips.check`: no name twice, local headers and the end record agreeing
    with the central directory, no overlaps), every member stored, all in one folder."""
    size = int(buf.size)
    starts = _zips.check(zf, lambda at, n: bytes(buf[at : at + n]), size, "the zip archive", path)
    out = {}
    for info in zf.infolist():
        if info.flag_bits & 1 or info.compress_type != zipfile.ZIP_STORED:
            raise FormatError(
                f"{what}: member {info.filename!r} is compressed or encrypted (torch.save stores them)",
                path=path,
            )
        if info.compress_size != info.file_size:
            raise FormatError(f"{what}: member {info.filename!r} has two sizes", path=path)
        out[info.filename] = (starts[info.filename], info.file_size, info.CRC)
    return out


def _archive_folder(members: dict[str, Any], first: str, path: str | None) -> str:
    """The one ``<archive>/`` every member lies in, as torch's reader requires (it takes
    the folder from the first member), holding the one ``data.pkl``."""
    pkl = [n for n in members if n == "data.pkl" or (n.endswith("/data.pkl") and n.count("/") == 1)]
    if len(pkl) != 1:
        raise FormatError(f"a zip archive with {len(pkl)} data.pkl members, not one", path=path)
    prefix = pkl[0][: -len("data.pkl")]
    if not first.startswith(prefix) or (not prefix and "/" in first):
        raise FormatError(
            f"data.pkl lies in {prefix or 'the top'!r}, the first member in "
            f"{first.split('/')[0]!r} (torch reads only the first member's folder)",
            path=path,
        )
    outside = [n for n in members if not n.startswith(prefix)]
    if outside:
        raise FormatError(
            f"member {outside[0]!r} lies outside the archive folder {prefix!r} (torch "
            "refuses such a file)",
            path=path,
        )
    return prefix


def read_zip(source: str | bytes, path: str | None, what: str | None = None) -> Any:
    """The object a ``torch.save`` zip holds (``source``: its path, or its bytes), tensors as
    :class:`StoredTensor` over a memory map of it."""
    what = what or "data.pkl"
    try:
        if isinstance(source, str):
            # a plain ndarray over the map: slicing a memmap subclass costs 10x more
            buf: np.ndarray = np.memmap(source, dtype=np.uint8, mode="r").view(np.ndarray)
            zf = zipfile.ZipFile(source)
        else:
            buf = np.frombuffer(source, np.uint8)
            zf = zipfile.ZipFile(io.BytesIO(source))
        with zf:
            members = _members(zf, buf, what, path)
            first = zf.infolist()[0].filename if members else ""
    except (
        zipfile.BadZipFile,
        OSError,
        EOFError,
        ValueError,
        NotImplementedError,
        struct.error,
        RuntimeError,
        OverflowError,  # a zip64 field past what a seek takes
        MemoryError,
    ) as err:
        if isinstance(err, FormatError):
            raise
        raise FormatError(
            f"damaged zip archive ({type(err).__name__}: {' '.join(str(err).split())[:120]})",
            path=path,
        ) from None
    prefix = _archive_folder(members, first, path)
    order = members.get(prefix + "byteorder")
    if order is not None and bytes(buf[order[0] : order[0] + order[1]]) != b"little":
        raise NeedsTorch("a big-endian file")
    start, size, crc = members[prefix + "data.pkl"]
    data = bytes(buf[start : start + size])
    if zlib.crc32(data) != crc:
        raise FormatError(
            f"damaged zip archive: {prefix + 'data.pkl'!r} does not match its CRC", path=path
        )
    storages: dict[str, Storage] = {}

    def persistent_load(pid: Any) -> Storage:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] in ("storage", b"storage")):
            raise UnsafePickleError("holds a persistent id that is not a storage")
        _, cls, key, _location, numel = pid
        if cls is _UNTYPED:
            dt, item = None, 1
        elif isinstance(cls, Const) and cls.qualname.removeprefix("torch.") in STORAGE_CLASSES:
            dt = cls.value
            item = DTYPES[dt][0]
        else:
            raise UnsafePickleError(f"a storage of class {_unpickle._what(cls)}")
        if type(key) is not str or type(numel) is not int or numel < 0:
            raise FormatError("a storage id with a malformed key or size")
        if key in storages:
            st = storages[key]
            if st.dtype != dt or st.nbytes != numel * item:
                raise FormatError(f"storage {key!r} is named twice with different types or sizes")
            return st
        member = members.get(f"{prefix}data/{key}")
        if member is None:
            raise FormatError(f"storage {key!r} has no member {prefix}data/{key} in the archive")
        if member[1] != numel * item:
            raise LayoutError(
                f"storage {key!r} holds {member[1]} bytes, its id says {numel} x {item}"
            )
        storages[key] = Storage(
            key, dt, buf, member[0], member[1], member[2], f"{prefix}data/{key}"
        )
        return storages[key]

    return _unpickle.load(
        data, TABLE, what=what, path=path, torch_only=TORCH_ONLY, persistent_load=persistent_load
    )


# -- the legacy format ---------------------------------------------------------------------

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C
PROTOCOL_VERSION = 1001


def read_legacy(path: str) -> Any:
    """The object a legacy (non-zip) ``torch.save`` file holds."""
    buf = np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    keys_seen: dict[str, tuple[str, int]] = {}
    storages: dict[str, Storage] = {}

    def persistent_load(pid: Any) -> Any:
        if not (type(pid) is tuple and len(pid) == 6 and pid[0] in ("storage", b"storage")):
            raise UnsafePickleError("holds a persistent id that is not a storage")
        _, cls, key, _location, numel, view = pid
        if not (isinstance(cls, Const) and cls.qualname.removeprefix("torch.") in STORAGE_CLASSES):
            raise UnsafePickleError(f"a storage of class {_unpickle._what(cls)}")
        if view is not None:
            raise NeedsTorch("a storage view (torch < 0.4)")
        if type(key) is not str or type(numel) is not int or numel < 0:
            raise FormatError("a storage id with a malformed key or size")
        if key not in storages:
            keys_seen[key] = (cls.value, numel)
            storages[key] = Storage(
                key, cls.value, buf, 0, numel * DTYPES[cls.value][0], None, f"storage {key}"
            )
        elif keys_seen[key] != (cls.value, numel):
            raise FormatError(f"storage {key!r} is named twice with different types or sizes")
        return storages[key]

    with open(path, "rb") as raw_file:
        f = _Capped(raw_file, buf.size)
        head = []
        for what in ("magic number", "protocol version", "system info"):
            head.append(_unpickle.load(f, BASE_TABLE, what=f"the {what} pickle", path=path))
        if head[0] != MAGIC_NUMBER or head[1] != PROTOCOL_VERSION:
            raise FormatError("not a torch.save file (magic number or protocol differs)", path=path)
        info = head[2]
        if not (isinstance(info, Mapping) and info.get("little_endian") is True):
            raise NeedsTorch("a big-endian file")
        obj = _unpickle.load(f, TABLE, what="the object pickle", path=path,
                             torch_only=TORCH_ONLY, persistent_load=persistent_load)  # fmt: skip
        keys = _unpickle.load(f, BASE_TABLE, what="the storage-key pickle", path=path)
        pos = f.tell()
    if not (isinstance(keys, list) and all(type(k) is str for k in keys)):
        raise FormatError("the storage-key pickle is not a list of keys", path=path)
    for key in keys:
        st = storages.get(key)
        if st is None:
            raise FormatError(f"storage {key!r} is listed but no tensor uses it", path=path)
        if pos + 8 > buf.size:
            raise TruncatedError(f"storage {key!r} lies past the end of the file", path=path)
        (count,) = struct.unpack("<q", bytes(buf[pos : pos + 8]))
        item = DTYPES[st.dtype or "uint8"][0]
        if count * item != st.nbytes or pos + 8 + st.nbytes > buf.size:
            raise LayoutError(
                f"storage {key!r}: {count} elements at {pos}, its id says {st.nbytes // item}",
                path=path,
            )
        st._start = pos + 8
        pos += 8 + st.nbytes
    if len(set(keys)) != len(storages):
        raise FormatError("a storage used by a tensor is not in the file", path=path)
    return obj


class _Capped:
    """A file read by the unpickler: no read asks for more than the file still holds (a
    pickle declaring a 2**60-byte string would otherwise have the buffer allocate it)."""

    def __init__(self, f: Any, size: int) -> None:
        self._f, self._size = f, size

    def _left(self, n: int) -> int:
        left = max(self._size - self._f.tell(), 0)
        return left if n is None or n < 0 else min(n, left)

    def read(self, n: int = -1) -> bytes:
        return self._f.read(self._left(n))

    def readline(self, n: int = -1) -> bytes:
        return self._f.readline(self._left(n))

    def readinto(self, b: Any) -> int:
        return self._f.readinto(memoryview(b)[: self._left(len(b))])

    def tell(self) -> int:
        return self._f.tell()


__all__ = ["NeedsTorch", "NumpyArray", "Storage", "StoredTensor", "read_legacy", "read_zip"]
