"""numpy ``.npy`` (memory-mapped) and ``.npz`` archives."""

from __future__ import annotations

import math
import os
import struct
import threading
import tokenize
import weakref
import zipfile
import zlib
from typing import IO, Any

import numpy as np

from dmlib import _limits
from dmlib.errors import DmlibError, FormatError, LayoutError, TruncatedError, UnsupportedError
from dmlib.io import _zips
from dmlib.io._checks import shape_problem, short_repr
from dmlib.tensor import FileStamp, Tensor, TensorSet

NPY_MAGIC = b"\x93NUMPY"

# numpy parses an .npy header with ast.literal_eval, and CPython 3.11's AST construction keeps
# its recursion count in state shared by all threads: two threads parsing at once can fail
# with "SystemError: AST constructor recursion depth mismatch" (python/cpython gh-106905).
# Headers are parsed once, at open, under this lock; a member's load only compares bytes.
_HEADER_LOCK = threading.Lock()


def can_open_npy(head: bytes, path: str) -> bool:
    """A file starting with the ``.npy`` magic ``\\x93NUMPY`` (any name)."""
    return head.startswith(NPY_MAGIC)


def can_open_npz(head: bytes, path: str) -> bool:
    """A zip archive (starting ``PK``) whose name ends in ``.npz``."""
    return head.startswith(b"PK") and path.endswith(".npz")


def _tensor(name: str, arr: np.ndarray, path: str, offset: int | None) -> Tensor:
    if arr.dtype.hasobject:
        raise UnsupportedError(f"{name!r} holds Python objects, not a numeric array", path=path)
    a = np.ascontiguousarray(arr) if not arr.flags.c_contiguous else arr
    return Tensor(name, a.dtype, a.shape, nbytes=a.nbytes, offset=offset, source=a, path=path)


def _read_header(f: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of the .npy stream ``f``, left at the first data byte."""
    fmt = np.lib.format
    with _HEADER_LOCK:
        version = fmt.read_magic(f)
        if version == (1, 0):
            return fmt.read_array_header_1_0(f)
        if version in ((2, 0), (3, 0)):  # 3.0 differs only in allowing UTF-8 field names
            return fmt.read_array_header_2_0(f)
    raise ValueError(f"unsupported .npy format version {version}")


def _check_size(where: str, shape: Any, dtype: np.dtype, available: int, path: str) -> None:
    """Refuse a header whose shape x dtype does not match the bytes actually there.

    numpy itself allocates ``shape x dtype`` before reading an npz member, so a header
    claiming terabytes would be a MemoryError (or a huge allocation) instead of an error.
    """
    if dtype.hasobject:
        raise UnsupportedError(f"{where} holds Python objects, not a numeric array", path=path)
    problem = shape_problem(list(shape), dtype.itemsize)
    if problem is not None:
        raise FormatError(f"{where}: {problem}", path=path)
    need = math.prod(shape) * dtype.itemsize
    if need > available:
        raise TruncatedError(
            f"{where}: {dtype} x {list(shape)} needs {need} bytes but {available} are there",
            path=path,
        )
    if need < available:
        raise LayoutError(
            f"{where}: {available - need} bytes after the array data ({dtype} x {list(shape)})",
            path=path,
        )


# what a damaged archive can raise from inside zipfile and its decompressors
_ZIP_ERRORS: tuple[type[BaseException], ...] = (
    zipfile.BadZipFile,
    zlib.error,
    struct.error,
    KeyError,
    NotImplementedError,  # compression method
    RuntimeError,  # encrypted member
    OverflowError,  # a zip64 offset past what a seek takes
)
try:
    import lzma

    _ZIP_ERRORS += (lzma.LZMAError,)
except ImportError:  # Python built without lzma: zipfile cannot open such members anyway
    pass

# numpy parses the header dict with ast.literal_eval, which can raise any of these
_NPY_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    OSError,
    EOFError,
    SyntaxError,
    TypeError,
    MemoryError,
    RecursionError,
    UnicodeDecodeError,
    tokenize.TokenError,
)


def open_npy(path: str | os.PathLike[str]) -> TensorSet:
    """Open one ``.npy`` file, memory-mapped, as a TensorSet of one tensor named after the file.

    The tensor's name is the file name without its extension. The header's shape x dtype
    is checked against the bytes after it before anything is mapped; a Fortran-order array
    is handed out as a C-order copy.
    """
    path = os.fspath(path)
    name = os.path.splitext(os.path.basename(path))[0]
    stamp = FileStamp.take(path)
    try:
        with open(path, "rb") as f:
            shape, _, dtype = _read_header(f)
            header_end = f.tell()
    except _NPY_ERRORS as err:
        raise FormatError(
            f"not a readable .npy file ({type(err).__name__}: {short_repr(str(err), 200)})",
            path=path,
        ) from None
    _check_size(f"array {name!r}", shape, dtype, os.path.getsize(path) - header_end, path)
    try:
        with _HEADER_LOCK:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except _NPY_ERRORS as err:
        raise FormatError(
            f"not a readable .npy file ({type(err).__name__}: {short_repr(str(err), 200)})",
            path=path,
        ) from None
    offset = getattr(arr, "offset", None)
    if not arr.flags.c_contiguous:  # Fortran order: hand out a C-order copy, said in layout
        arr = np.ascontiguousarray(arr)
        offset = None
    return TensorSet({name: _tensor(name, arr, path, offset)}, path=path, format="npy", stamp=stamp)


def _archive_problem(infos: list[zipfile.ZipInfo], size: int) -> str | None:
    """Why the archive's directory declares more work than its bytes can honestly hold.

    Checked before any member is decompressed: compressed lengths that add up to more
    than the file (members that overlap: one compressed run inflated many times), a member
    larger than :func:`dmlib._limits.max_decompressed`, or members inflating more than
    :func:`dmlib._limits.allowed_output` allows (alone, or all together).
    """
    packed = [i for i in infos if i.compress_type != zipfile.ZIP_STORED]
    if sum(i.compress_size for i in infos) > size:
        return (
            f"members declare {_limits.human(sum(i.compress_size for i in infos))} of "
            f"compressed data in a {_limits.human(size)} file (overlapping members)"
        )
    cap = _limits.max_decompressed()
    for info in infos:
        if info.file_size > cap:
            return (
                f"member {info.filename!r} declares {_limits.human(info.file_size)}, more than "
                f"the {_limits.human(cap)} one member may take on this machine"
            )
        if info.compress_type != zipfile.ZIP_STORED and info.file_size > _limits.allowed_output(
            info.compress_size
        ):
            return (
                f"member {info.filename!r} would inflate {_limits.human(info.compress_size)} "
                f"to {_limits.human(info.file_size)}, more than the "
                f"{_limits.human(_limits.allowed_output(info.compress_size))} allowed"
            )
    total, packed_in = sum(i.file_size for i in packed), sum(i.compress_size for i in packed)
    if total > _limits.allowed_output(packed_in):
        return (
            f"members would inflate {_limits.human(packed_in)} to {_limits.human(total)}, "
            f"more than the {_limits.human(_limits.allowed_output(packed_in))} allowed"
        )
    return None


def _member_reader(
    zf: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    header: bytes,
    layout: tuple[tuple[int, ...], bool, np.dtype],
    path: str,
) -> Any:
    """A loader of one member's bytes (C order), decompressed when it is called.

    ``header`` is the member's ``.npy`` header as read at open and ``layout`` what it said
    (shape, Fortran order, dtype). A load reads the header's bytes again and compares them
    (a member rewritten since open is refused, and nothing is parsed in the worker threads
    that load), then reads exactly the data bytes the header declares.

    The last array read is kept through a weak reference only: while a caller holds it,
    a second load of the same member costs nothing; memory is never held for it here.
    """
    shape, fortran, dtype = layout
    nbytes = math.prod(shape) * dtype.itemsize
    last: list[weakref.ref[np.ndarray]] = []

    def problem(text: str) -> FormatError:
        return FormatError(f"member {info.filename!r} {text}", path=path)

    def load() -> np.ndarray:
        held = last[0]() if last else None
        if held is not None:
            return held
        if zf.fp is None:  # the set was closed
            raise DmlibError(
                f"member {info.filename!r} has no data source (file closed?)", path=path
            )
        try:
            with zf.open(info) as f:
                if f.read(len(header)) != header:
                    raise problem("changed while reading (its .npy header is not the one opened)")
                data = f.read(nbytes)
                extra = f.read(1)
        except _ZIP_ERRORS as err:
            raise problem(
                f"is not readable ({type(err).__name__}: {short_repr(str(err), 200)})"
            ) from None
        if len(data) != nbytes or extra:
            raise problem(f"changed while reading (holds other than the {nbytes} data bytes)")
        arr = np.frombuffer(data, dtype=dtype)
        if fortran:  # stored column-major: hand out the C-order bytes
            arr = np.ascontiguousarray(arr.reshape(shape[::-1]).T)
        out = arr.reshape(-1).view(np.uint8)
        out.flags.writeable = False  # handed out as is by Tensor.raw(), so the weak ref holds
        last[:] = [weakref.ref(out)]
        return out

    return load


def _size_of(f: IO[bytes]) -> int:
    """The size of the open file ``f``."""
    return os.fstat(f.fileno()).st_size


def open_npz(path: str | os.PathLike[str]) -> TensorSet:
    """Open an ``.npz`` archive lazily: each member is decompressed when its tensor is loaded.

    At open only the zip directory and each member's ``.npy`` header are read; the
    archive is checked to have one reading (:func:`dmlib.io._zips.check`: no name twice,
    local headers agreeing with the central directory) and its directory against the
    limits of :mod:`dmlib._limits` first, so a small archive declaring gigabytes is
    refused before anything is inflated.
    """
    path = os.fspath(path)
    stamp = FileStamp.take(path)
    tensors: dict[str, Tensor] = {}
    zf: zipfile.ZipFile | None = None
    try:
        zf = zipfile.ZipFile(path)
        with open(path, "rb") as raw:  # one reading: the checks every zip reader makes
            _zips.check(
                zf, lambda at, n: os.pread(raw.fileno(), n, at), _size_of(raw), "the archive", path
            )
        infos = [i for i in zf.infolist() if not i.is_dir()]
        problem = _archive_problem(infos, os.path.getsize(path))
        if problem is not None:
            raise FormatError(f"refused: {problem}; {_limits.limit_hint()}", path=path)
        for info in infos:
            key = info.filename.removesuffix(".npy")
            if key in tensors:
                raise FormatError(f"archive holds {key!r} twice", path=path)
            # check the member's header against its declared size before numpy
            # allocates what the header claims
            with zf.open(info) as f:
                shape, fortran, dtype = _read_header(f)
                header_end = f.tell()
            with zf.open(info) as f:
                header = f.read(header_end)
            where = f"member {info.filename!r}"
            _check_size(where, shape, dtype, info.file_size - header_end, path)
            shape = tuple(int(n) for n in shape)
            tensors[key] = Tensor(
                key, dtype, shape, nbytes=math.prod(shape) * dtype.itemsize, path=path,
                source=_member_reader(zf, info, header, (shape, fortran, dtype), path),
            )  # fmt: skip
    except DmlibError:
        if zf is not None:
            zf.close()
        raise
    except (*_NPY_ERRORS, *_ZIP_ERRORS) as err:
        if zf is not None:
            zf.close()
        raise FormatError(
            f"not a readable .npz archive ({type(err).__name__}: {short_repr(str(err), 200)})",
            path=path,
        ) from None
    return TensorSet(tensors, path=path, format="npz", closer=zf.close, stamp=stamp)
