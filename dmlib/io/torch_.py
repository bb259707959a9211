"""PyTorch state dicts (``.pt``, ``.pth``, ``.bin``), through torch when it is installed.

Only ``weights_only=True`` loading: dmlib never unpickles arbitrary objects.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from dmlib.errors import FormatError, MissingDependencyError, UnsupportedError
from dmlib.tensor import Tensor, TensorSet

SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def can_open(head: bytes, path: str) -> bool:
    return path.endswith(SUFFIXES) and (head.startswith(b"PK") or head[:2] == b"\x80\x02")


def _flatten(obj: Any, prefix: str, out: dict[str, Any]) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten(v, f"{prefix}.{i}" if prefix else str(i), out)


def _to_numpy(t: Any) -> np.ndarray:
    import ml_dtypes
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    if t.dtype == torch.float8_e5m2:
        return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e5m2)
    return t.numpy()


def _check_archive(path: str) -> None:
    """Refuse a damaged archive before torch reads it.

    torch locates each storage through the member's local header and checks no CRC, so
    one damaged header byte yields a tensor read from a shifted window of the file.
    zipfile finds the data the same way and checks it against the central directory's
    CRC; this costs one read of the file.
    """
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError, RuntimeError) as err:
        raise FormatError(f"damaged zip archive ({type(err).__name__}: {err})", path=path) from None
    if bad is not None:
        raise FormatError(
            f"damaged zip archive: member {bad!r} does not match its central-directory entry (header or CRC)",
            path=path,
        )


def _why(err: Exception) -> str:
    """The gist of a torch.load failure; its own messages run to paragraphs of advice."""
    text = str(err)
    if "WeightsUnpickler error:" in text:  # the advice to drop weights_only is not ours to give
        text = text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation", 1)[0]
    text = " ".join(text.split())
    return f"{type(err).__name__}: {text if len(text) <= 200 else text[:197] + '...'}"


def open_torch(path: str | os.PathLike[str]) -> TensorSet:
    path = os.fspath(path)
    try:
        import torch
    except ImportError:
        raise MissingDependencyError(
            "reading PyTorch checkpoints needs torch: pip install 'dmlib[torch]'", path=path
        ) from None
    try:
        is_zip = zipfile.is_zipfile(path)
    except zipfile.BadZipFile as err:  # is_zipfile itself raises on some damaged end records
        raise FormatError(f"damaged zip archive ({err})", path=path) from None
    if is_zip:
        _check_archive(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
    except Exception as err:  # torch raises many types for corrupt or unsafe files
        raise FormatError(f"not a loadable PyTorch state dict ({_why(err)})", path=path) from None
    flat: dict[str, Any] = {}
    _flatten(obj, "", flat)
    if not flat and not isinstance(obj, Mapping):
        raise UnsupportedError(f"holds a {type(obj).__name__}, not a state dict of tensors", path=path)
    tensors = {}
    for name, t in flat.items():
        try:
            arr = _to_numpy(t)
        except (TypeError, RuntimeError) as err:
            raise UnsupportedError(f"tensor {name!r}: dtype {t.dtype} has no numpy equivalent ({err})", path=path) from None
        tensors[name] = Tensor(name, arr.dtype, arr.shape, nbytes=arr.nbytes, source=arr, path=path, dtype_name=str(t.dtype).removeprefix("torch."))
    return TensorSet(tensors, path=path, format="torch")
