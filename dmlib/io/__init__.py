"""Readers: one module per format, and a registry (:data:`REGISTRY`, one :class:`Format`
row per format) that recognises a checkpoint folder, then a file by its magic bytes, then
by its suffix. ``format=`` overrides detection. A new format is one reader module and one
row.

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
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from dmlib.errors import DmlibError, FormatError, TruncatedError, UnknownFormatError

if TYPE_CHECKING:
    import numpy as np

    from dmlib.tensor import TensorSet


@dataclass(frozen=True)
class Format:
    """One row of the format registry: how a format is recognised and opened.

    Function fields name functions of ``dmlib.io.<module>``, imported only when they run.
    ``sniff(head, path) -> bool`` looks at a file's first 64 bytes; ``folder_sniff(path)``
    is truthy for a checkpoint folder (or for one of ``folder_files``, the files inside it
    that stand for it) and runs only on a folder or such a file, so detection of a plain
    file imports no folder reader. ``rank`` orders the sniffs of one kind (weak signatures
    last). ``locate(path) -> path`` gives the folder a folder format opens, or raises the
    error that names the file; without one a folder format opens a folder as given.
    ``options`` are the keyword arguments of ``open_tensors`` the opener takes, and
    ``sharded`` says that the format also comes as a Hugging Face shard index.
    """

    name: str
    module: str
    opener: str
    description: str
    suffixes: tuple[str, ...] = ()
    sniff: str | None = None
    rank: int = 0
    folder: bool = False
    folder_sniff: str | None = None
    folder_files: tuple[str, ...] = ()
    locate: str | None = None
    options: tuple[str, ...] = ()
    sharded: bool = False


#: every format, in the order messages and ``--format`` list them
REGISTRY: tuple[Format, ...] = (
    Format("burnpack", "burnpack", "open_burnpack", "Burn's burnpack records",
           (".bpk", ".burnpack"), "can_open", rank=0, options=("record",)),
    Format("safetensors", "safetensors", "open_safetensors", "Hugging Face safetensors",
           (".safetensors",), "can_open", rank=6, sharded=True),
    Format("npy", "numpy_", "open_npy", "one numpy array", (".npy",), "can_open_npy", rank=1),
    Format("npz", "numpy_", "open_npz", "a numpy .npz archive", (".npz",), "can_open_npz",
           rank=2),
    Format("torch", "torch_", "open_torch", "a torch.save file (zip or legacy pickle)",
           (".pt", ".pth", ".bin", ".ckpt"), "can_open", rank=3, sharded=True),
    Format("dcp", "dcp", "open_dcp", "a PyTorch Distributed Checkpoint folder", rank=1,
           folder=True, folder_sniff="can_open", folder_files=(".metadata",), locate="locate"),
    Format("gguf", "gguf", "open_gguf", "a GGUF file (llama.cpp)", (".gguf",), "can_open",
           rank=4),
    Format("burn-mpk", "burn_mpk", "open_mpk", "a Burn named MessagePack record", (".mpk",),
           "can_open", rank=5),
    Format("orbax", "orbax", "open_orbax", "an Orbax step or item folder (JAX)", rank=2,
           folder=True, folder_sniff="checkpoint_folder",
           folder_files=("_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", "orbax.checkpoint"),
           locate="locate"),
    Format("flax-msgpack", "flax_msgpack", "open_flax_msgpack", "flax.serialization msgpack",
           (".msgpack",), "can_open", rank=7),
    Format("hf-trainer", "hf_trainer", "open_trainer",
           "a Hugging Face Trainer checkpoint-N/ or Accelerate state folder", rank=0,
           folder=True, folder_sniff="can_open"),
    Format("hf-model", "hf_pretrained", "open_model",
           "a transformers save_pretrained folder (config.json + weights)", rank=3,
           folder=True, folder_sniff="can_open_model"),
    Format("peft-adapter", "hf_pretrained", "open_adapter",
           "a PEFT save_pretrained adapter folder (adapter_config.json + weights)", rank=4,
           folder=True, folder_sniff="can_open_adapter"),
)  # fmt: skip

FORMATS = tuple(f.name for f in REGISTRY)
_BY_NAME = {f.name: f for f in REGISTRY}
_BY_SUFFIX = {s: f for f in REGISTRY for s in f.suffixes}
# file formats by their content, folder formats by their folder, each in detection order
_SNIFFED = sorted((f for f in REGISTRY if f.sniff), key=lambda f: f.rank)
_FOLDERS = sorted((f for f in REGISTRY if f.folder), key=lambda f: f.rank)
# a Hugging Face shard index names shards of one format (dmlib.io.sharded)
_SHARD_INDEX = ".index.json"
# modules that read no format of their own but are reachable as ``dmlib.io.<name>``
_HELPERS = ("ocdbt", "sharded", "zarr_")
_MODULES = tuple(sorted({f.module for f in REGISTRY} | set(_HELPERS)))


def _reader(module: str) -> ModuleType:
    """The reader module ``dmlib.io.<module>``, imported on first use."""
    return importlib.import_module(f"dmlib.io.{module}")


def _call(row: Format, function: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``function`` of the row's reader module."""
    return getattr(_reader(row.module), function)(*args, **kwargs)


def format_for_suffix(path: str | os.PathLike[str]) -> str | None:
    """The format a file's suffix names (``".safetensors"`` -> ``"safetensors"``), or None."""
    row = _BY_SUFFIX.get(os.path.splitext(os.fspath(path))[1].lower())
    return None if row is None else row.name


def format_info(name: str) -> Format:
    """The registry row of format ``name`` (:class:`UnknownFormatError` for another name)."""
    if name not in _BY_NAME:
        raise UnknownFormatError(f"unknown format {name!r}; expected one of {', '.join(FORMATS)}")
    return _BY_NAME[name]


def is_folder_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True for a folder (or a file standing for one) a folder format opens as one checkpoint."""
    return _folder_format(os.fspath(path)) is not None


def is_dcp_folder(path: str | os.PathLike[str]) -> bool:
    """True for a folder the DCP reader opens as one checkpoint."""
    return bool(_call(_BY_NAME["dcp"], "can_open", os.fspath(path)))


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
        pretrained = _reader("hf_pretrained")
        why = pretrained.near_miss(path)
        if why:
            raise FormatError(f"is a directory that {why}", path=path)
        raise FormatError(
            f"is a directory no folder format takes (looked for {pretrained.looked_for()}, "
            "trainer_state.json (Trainer), .metadata (DCP), _METADATA (Orbax); a capture: "
            "dmlib.open_capture)",
            path=path,
        )
    if not os.path.isfile(path):
        raise FormatError("is not a regular file (a device, socket or pipe?)", path=path)
    if os.path.getsize(path) == 0:
        raise TruncatedError("empty file (0 bytes)", path=path)


def detect_format(path: str | os.PathLike[str]) -> str:
    """The format of a file: a checkpoint folder, a shard index, then magic bytes, then suffix."""
    path = os.fspath(path)
    # cheap tests on the path first: the reader modules load only for their own files
    folder = _folder_format(path)
    if folder is not None:
        return folder.name
    if path.endswith(_SHARD_INDEX) and _reader("sharded").can_open(path):
        _check_file(path)
        return _reader("sharded").shard_format(path)
    _check_file(path)
    return _file_format(path, _head(path))


def _folder_format(path: str) -> Format | None:
    """The folder format whose folder ``path`` is (or names by one of its files), or None."""
    is_dir, base = os.path.isdir(path), os.path.basename(path)
    for row in _FOLDERS:
        if (is_dir or base in row.folder_files) and _call(row, row.folder_sniff or "", path):
            return row
    return None


def _head(path: str) -> bytes:
    """The first 64 bytes of a file (a read error as one line naming it)."""
    try:
        with open(path, "rb") as f:
            return f.read(64)
    except OSError as err:
        raise DmlibError(f"cannot read ({err.strerror or err})", path=path) from None


def _file_format(path: str, head: bytes) -> str:
    """A file's format by its content (``head``: its first bytes), then by its suffix."""
    if head.startswith(b"PK"):  # a zip under any name: torch.save's, or numpy's .npz
        kind = _zip_kind(path)
        if kind is not None:
            return kind
    named = _BY_SUFFIX.get(os.path.splitext(path)[1].lower())
    # the format the suffix names, when its magic agrees (the signatures are disjoint, so
    # this is the answer of the ordered scan below, without importing every reader)
    hinted = [named] if named is not None and named.sniff else []
    for row in hinted + _SNIFFED:
        if _call(row, row.sniff or "", head, path):
            return row.name
    if named is not None:
        return named.name
    raise UnknownFormatError(
        f"unrecognised file (first bytes {head[:8]!r}); pass format= one of {', '.join(FORMATS)}",
        path=path,
    )


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
        ``save_state`` folder: :mod:`dmlib.io.hf_trainer`), or a ``save_pretrained``
        folder: a transformers model (``config.json`` + weights) or a PEFT adapter
        (``adapter_config.json`` + weights; :mod:`dmlib.io.hf_pretrained`).
    format
        Skip detection and read as this format.
    record
        For burnpack files holding several records: open record ``record`` alone.
    """
    path = os.fspath(path)
    fmt = format or _ASSUMED.get() or detect_format(path)
    if fmt not in _BY_NAME:
        raise UnknownFormatError(
            f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}", path=path
        )
    row = _BY_NAME[fmt]
    if record is not None and "record" not in row.options:
        takers = " and ".join(f.name for f in REGISTRY if "record" in f.options)
        raise FormatError(f"record= applies to {takers} files only, not {fmt}", path=path)
    path = _opened_path(row, path)
    try:
        if row.sharded and path.endswith(_SHARD_INDEX):  # sharded.can_open
            return _reader("sharded").open_index(path)
        options = {"record": record} if "record" in row.options else {}
        return _call(row, row.opener, path, **options)
    except OSError as err:  # unreadable (permissions, I/O error): still one line naming the file
        raise DmlibError(f"cannot read ({err.strerror or err})", path=path) from None


def _opened_path(row: Format, path: str) -> str:
    """The path the row's opener reads: the file after the checks every file passes, or
    the checkpoint folder (an error naming ``path`` when it is not one of this format)."""
    if not row.folder:
        _check_file(path)
        return path
    if row.locate is not None:
        return str(_call(row, row.locate, path))
    if not os.path.isdir(path):
        _check_file(path)
        raise FormatError(f"format {row.name} names a folder, not a file", path=path)
    return path


def load(
    path: str | os.PathLike[str], names: Iterable[str] | None = None, *, format: str | None = None
) -> dict[str, np.ndarray]:
    """Read tensors eagerly into (writable, in-memory) numpy arrays."""
    import numpy as np

    with open_tensors(path, format=format) as ts:
        wanted = list(ts) if names is None else list(names)
        return {n: np.array(ts[n].load()) for n in wanted}


__all__ = [
    "FORMATS", "REGISTRY", "Format", "assumed_format", "detect_format", "format_for_suffix",
    "format_info", "is_dcp_folder", "is_folder_checkpoint", "load", "open_tensors",
]  # fmt: skip
