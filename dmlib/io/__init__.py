"""Readers: one module per format, and a registry that opens a file by its magic bytes
first, then its suffix. ``format=`` overrides detection.

Reader modules are imported when a file of their format is opened (or detected), not with
this package: ``dmlib compare a.safetensors b.safetensors`` loads the safetensors reader
alone (start-up time is part of every command, benchmarks/README.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dmlib.errors import DmlibError, FormatError, TruncatedError, UnknownFormatError

if TYPE_CHECKING:
    import numpy as np

    from dmlib.tensor import TensorSet

FORMATS = (
    "burnpack", "safetensors", "npy", "npz", "torch", "dcp", "gguf", "burn-mpk", "orbax",
    "flax-msgpack", "hf-trainer",
)  # fmt: skip

# (format, reader module, its magic check) in detection order; suffixes are the fallback
_MAGIC: list[tuple[str, str, str]] = [
    ("burnpack", "burnpack", "can_open"),
    ("npy", "numpy_", "can_open_npy"),
    ("npz", "numpy_", "can_open_npz"),
    ("torch", "torch_", "can_open"),
    ("gguf", "gguf", "can_open"),
    ("burn-mpk", "burn_mpk", "can_open"),
    ("safetensors", "safetensors", "can_open"),
    ("flax-msgpack", "flax_msgpack", "can_open"),
]
_SUFFIX = {
    ".bpk": "burnpack",
    ".burnpack": "burnpack",
    ".safetensors": "safetensors",
    ".npy": "npy",
    ".npz": "npz",
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
    ".ckpt": "torch",
    ".gguf": "gguf",
    ".mpk": "burn-mpk",
    ".msgpack": "flax-msgpack",
}
_MODULES = (
    "burn_mpk", "burnpack", "dcp", "flax_msgpack", "gguf", "hf_trainer", "numpy_", "ocdbt",
    "orbax", "safetensors", "sharded", "torch_", "zarr_",
)  # fmt: skip
# files inside an Orbax folder that stand for the folder itself
_ORBAX_FILES = ("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "orbax.checkpoint")


def _reader(module: str) -> ModuleType:
    """The reader module ``dmlib.io.<module>``, imported on first use."""
    return importlib.import_module(f"dmlib.io.{module}")


def format_for_suffix(path: str | os.PathLike[str]) -> str | None:
    """The format a file's suffix names (``".safetensors"`` -> ``"safetensors"``), or None."""
    return _SUFFIX.get(os.path.splitext(os.fspath(path))[1].lower())


def is_dcp_folder(path: str | os.PathLike[str]) -> bool:
    """True for a folder the DCP reader opens as one checkpoint."""
    return bool(_reader("dcp").can_open(os.fspath(path)))


def __getattr__(name: str) -> Any:  # ``dmlib.io.safetensors`` and friends, loaded on access
    if name in _MODULES:
        return _reader(name)
    raise AttributeError(f"module 'dmlib.io' has no attribute {name!r}")


# the format every open_tensors call without format= assumes (the CLI's --format)
_ASSUMED: contextvars.ContextVar[str | None] = contextvars.ContextVar("dmlib_format", default=None)


@contextlib.contextmanager
def assumed_format(format: str | None) -> Iterator[None]:
    """Within the block, :func:`open_tensors` calls that pass no ``format=`` read as ``format``.

    The command line's ``--format`` applies to every file a command reads through this,
    whichever library function opens them. ``None`` leaves detection on.
    """
    if format is not None and format not in FORMATS:
        raise UnknownFormatError(f"unknown format {format!r}; expected one of {', '.join(FORMATS)}")
    token = _ASSUMED.set(format)
    try:
        yield
    finally:
        _ASSUMED.reset(token)


def _check_file(path: str) -> None:
    if not os.path.exists(path):
        raise DmlibError("no such file", path=path)
    if os.path.isdir(path):
        if _reader("hf_trainer").is_run_folder(path):
            raise FormatError(
                "is a training run's output folder (checkpoint-N/ inside), not one checkpoint: "
                "name one checkpoint-N/ folder, or give the run folder to dmlib report --run / "
                "dmlib ladder LABEL=FOLDER",
                path=path,
            )
        raise FormatError(
            "is a directory, not a checkpoint file or a training checkpoint folder (for a "
            "capture use dmlib.open_capture)",
            path=path,
        )
    if not os.path.isfile(path):
        raise FormatError("is not a regular file (a device, socket or pipe?)", path=path)
    if os.path.getsize(path) == 0:
        raise TruncatedError("empty file (0 bytes)", path=path)


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format of a file: by magic bytes, then by suffix."""
    path = os.fspath(path)
    # cheap tests on the path first: the reader modules load only for their own files
    if os.path.isdir(path) and _reader("hf_trainer").can_open(path):
        return "hf-trainer"
    if (os.path.isdir(path) or os.path.basename(path) == ".metadata") and _reader("dcp").can_open(
        path
    ):
        return "dcp"
    if _orbax_folder(path) is not None:
        return "orbax"
    if path.endswith(".index.json") and _reader("sharded").can_open(path):
        _check_file(path)
        return _reader("sharded").shard_format(path)
    _check_file(path)
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as err:
        raise DmlibError(f"cannot read ({err.strerror or err})", path=path) from None
    if head.startswith(b"PK"):  # a zip under any name: torch.save's, or numpy's .npz
        kind = _zip_kind(path)
        if kind is not None:
            return kind
    suffix = os.path.splitext(path)[1].lower()
    # the format the suffix names, when its magic agrees (the signatures are disjoint, so
    # this is the answer of the ordered scan below, without importing every reader)
    hinted = [m for m in _MAGIC if m[0] == _SUFFIX.get(suffix)]
    for name, module, check in hinted + _MAGIC:
        if getattr(_reader(module), check)(head, path):
            return name
    if suffix in _SUFFIX:
        return _SUFFIX[suffix]
    raise UnknownFormatError(
        f"unrecognised file (first bytes {head[:8]!r}); pass format= one of {', '.join(FORMATS)}",
        path=path,
    )


def _orbax_folder(path: str) -> str | None:
    """The Orbax step or item folder ``path`` is (or names, by one of its metadata files)."""
    if os.path.basename(path) in _ORBAX_FILES and os.path.isfile(path):
        path = os.path.dirname(path) or "."
    if os.path.isdir(path) and _reader("orbax").kind(path) is not None:
        return path
    return None


def _zip_kind(path: str) -> str | None:
    """``"torch"`` for a torch.save archive (``<name>/data.pkl``), ``"npz"`` for one of
    ``.npy`` members only, None otherwise (or when the archive cannot be listed)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError):
        return None
    if _reader("torch_").is_torch_zip(names):
        return "torch"
    if names and all(n.endswith(".npy") for n in names):
        return "npz"
    return None


def open_tensors(
    path: str | os.PathLike[str], *, format: str | None = None, record: int | None = None
) -> TensorSet:
    """Open a checkpoint as a lazy, read-only mapping name -> Tensor.

    Parameters
    ----------
    path
        A burnpack, safetensors, ``.npy``, ``.npz`` or PyTorch file (a torch.save zip
        is recognised by its content under any name), or a Hugging Face shard index
        (``model.safetensors.index.json``, ``pytorch_model.bin.index.json``), or a
        PyTorch Distributed Checkpoint directory (``.metadata`` + ``*.distcp``), or a
        GGUF file (quantized tensors as their blocks; see :func:`dmlib.io.gguf.open_gguf`),
        or a Burn named MessagePack record (``.mpk``, ``.mpk.gz``), or an Orbax step or
        item folder (JAX; see :mod:`dmlib.io.orbax`), or a flax msgpack file, or a Hugging
        Face training checkpoint folder (a Trainer ``checkpoint-N/``, an Accelerate
        ``save_state`` folder: :mod:`dmlib.io.hf_trainer`).
    format
        Skip detection and read as this format.
    record
        For burnpack files holding several records: open record ``record`` alone.
    """
    path = os.fspath(path)
    fmt = format or _ASSUMED.get() or detect_format(path)
    if fmt not in FORMATS:
        raise UnknownFormatError(
            f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}", path=path
        )
    if record is not None and fmt != "burnpack":
        raise FormatError(f"record= applies to burnpack files only, not {fmt}", path=path)
    if fmt == "orbax":
        folder = _orbax_folder(path)
        if folder is None:
            raise FormatError(
                "not an Orbax checkpoint folder (no _METADATA or manifest.ocdbt)", path=path
            )
        path = folder
    elif fmt == "dcp":
        if not _reader("dcp").can_open(path):
            raise FormatError(
                f"not a DCP checkpoint directory (no {_reader('dcp').METADATA} in it)", path=path
            )
    elif fmt == "hf-trainer":
        if not os.path.isdir(path):
            _check_file(path)
            raise FormatError("format hf-trainer names a folder, not a file", path=path)
    else:
        _check_file(path)
    try:
        if fmt == "dcp":
            return _reader("dcp").open_dcp(path)
        if fmt == "orbax":
            return _reader("orbax").open_orbax(path)
        if fmt == "flax-msgpack":
            return _reader("flax_msgpack").open_flax_msgpack(path)
        if fmt == "hf-trainer":
            return _reader("hf_trainer").open_trainer(path)
        if fmt in ("safetensors", "torch") and path.endswith(".index.json"):  # sharded.can_open
            return _reader("sharded").open_index(path)
        if fmt == "burnpack":
            return _reader("burnpack").open_burnpack(path, record=record)
        if fmt == "safetensors":
            return _reader("safetensors").open_safetensors(path)
        if fmt == "npy":
            return _reader("numpy_").open_npy(path)
        if fmt == "npz":
            return _reader("numpy_").open_npz(path)
        if fmt == "gguf":
            return _reader("gguf").open_gguf(path)
        if fmt == "burn-mpk":
            return _reader("burn_mpk").open_mpk(path)
        return _reader("torch_").open_torch(path)
    except OSError as err:  # unreadable (permissions, I/O error): still one line naming the file
        raise DmlibError(f"cannot read ({err.strerror or err})", path=path) from None


def load(
    path: str | os.PathLike[str], names: Iterable[str] | None = None, *, format: str | None = None
) -> dict[str, np.ndarray]:
    """Read tensors eagerly into (writable, in-memory) numpy arrays."""
    import numpy as np

    with open_tensors(path, format=format) as ts:
        wanted = list(ts) if names is None else list(names)
        return {n: np.array(ts[n].load()) for n in wanted}


__all__ = [
    "FORMATS", "assumed_format", "detect_format", "format_for_suffix", "is_dcp_folder", "load",
    "open_tensors",
]  # fmt: skip
