"""numpy ``.npy`` (memory-mapped) and ``.npz`` archives."""

from __future__ import annotations

import math
import os
import struct
import tokenize
import zipfile
import zlib
from typing import IO, Any

import numpy as np

from dmlib.errors import DmlibError, FormatError, LayoutError, TruncatedError, UnsupportedError
from dmlib.io._checks import shape_problem, short_repr
from dmlib.tensor import Tensor, TensorSet

NPY_MAGIC = b"\x93NUMPY"


def can_open_npy(head: bytes, path: str) -> bool:
    return head.startswith(NPY_MAGIC)


def can_open_npz(head: bytes, path: str) -> bool:
    return head.startswith(b"PK") and path.endswith(".npz")


def _tensor(name: str, arr: np.ndarray, path: str, offset: int | None) -> Tensor:
    if arr.dtype.hasobject:
        raise UnsupportedError(f"{name!r} holds Python objects, not a numeric array", path=path)
    a = np.ascontiguousarray(arr) if not arr.flags.c_contiguous else arr
    return Tensor(name, a.dtype, a.shape, nbytes=a.nbytes, offset=offset, source=a, path=path)


def _read_header(f: IO[bytes]) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of the .npy stream ``f``, left at the first data byte."""
    fmt = np.lib.format
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
    path = os.fspath(path)
    name = os.path.splitext(os.path.basename(path))[0]
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
    return TensorSet({name: _tensor(name, arr, path, offset)}, path=path, format="npy")


def open_npz(path: str | os.PathLike[str]) -> TensorSet:
    path = os.fspath(path)
    arrays: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                if info.is_dir():
                    continue
                key = info.filename.removesuffix(".npy")
                if key in arrays:
                    raise FormatError(f"archive holds {key!r} twice", path=path)
                # check the member's header against its real size before numpy
                # allocates what the header claims
                with zf.open(info) as f:
                    shape, _, dtype = _read_header(f)
                    header_end = f.tell()
                _check_size(
                    f"member {info.filename!r}", shape, dtype, info.file_size - header_end, path
                )
                with zf.open(info) as f:
                    arrays[key] = np.lib.format.read_array(f, allow_pickle=False)
    except DmlibError:
        raise
    except (*_NPY_ERRORS, *_ZIP_ERRORS) as err:
        raise FormatError(
            f"not a readable .npz archive ({type(err).__name__}: {short_repr(str(err), 200)})",
            path=path,
        ) from None
    return TensorSet(
        {k: _tensor(k, a, path, None) for k, a in arrays.items()}, path=path, format="npz"
    )
