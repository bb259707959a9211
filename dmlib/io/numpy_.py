"""numpy ``.npy`` (memory-mapped) and ``.npz`` archives."""

from __future__ import annotations

import os
import zipfile

import numpy as np

from dmlib.errors import FormatError, UnsupportedError
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


def open_npy(path: str | os.PathLike[str]) -> TensorSet:
    path = os.fspath(path)
    name = os.path.splitext(os.path.basename(path))[0]
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise FormatError(f"not a readable .npy file ({err})", path=path) from None
    offset = getattr(arr, "offset", None)
    if not arr.flags.c_contiguous:  # Fortran order: hand out a C-order copy, said in layout
        arr = np.ascontiguousarray(arr)
        offset = None
    return TensorSet({name: _tensor(name, arr, path, offset)}, path=path, format="npy")


def open_npz(path: str | os.PathLike[str]) -> TensorSet:
    path = os.fspath(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as err:
        raise FormatError(f"not a readable .npz archive ({err})", path=path) from None
    return TensorSet({k: _tensor(k, a, path, None) for k, a in arrays.items()}, path=path, format="npz")
