"""Writing a capture: the manifest (compact JSON, one boundary a line), dump files, and the
capture folder (created, or replaced only where it holds a capture).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any, cast

import numpy as np

from dmlib import _atomic
from dmlib.errors import CaptureError
from dmlib.localize.capture import jsonenc
from dmlib.localize.capture.format import (
    FORMAT,
    MANIFEST,
    REQUEST_PREFIX,
    TENSOR_DIR,
    VERSION,
    WHOLE_KEY,
)
from dmlib.localize.capture.rowmap import (
    RowMap,
)

# json.dumps(..., separators=...) without building an encoder per call
_COMPACT = json.JSONEncoder(separators=(",", ":"))


# what the in-progress marker keeps of the manifest
_MARKER_KEYS = ("format", "version", "complete", "hash", "block_rows", "root", "metadata", "error")
# _COMPACT.encode builds its C encoder anew on every call (~5 us, once per boundary): one
# built once, with the same settings (no circular-reference check: a manifest entry is
# plain data dmlib built), gives the same text; CPython always has the C accelerator
_C_ENCODER = getattr(json.encoder, "c_make_encoder", None)
if _C_ENCODER is not None:
    _C_ENCODER = _C_ENCODER(None, _COMPACT.default, json.encoder.encode_basestring_ascii, None,
                            ":", ",", False, False, True)  # fmt: skip


def _encode_compact(obj: Any) -> str:
    """``_COMPACT.encode(obj)`` with the json module's encoder, built once: the manifest's
    head (settings, metadata, ops: floats and NaN as the json module writes them), and
    boundaries :func:`jsonenc.compact_lines` leaves to it."""
    if _C_ENCODER is None:  # pragma: no cover
        return _COMPACT.encode(obj)
    return "".join(_C_ENCODER(obj, 0))


# how every manifest dmlib writes begins (json.dumps and _COMPACT alike: no space)
_HEAD = f'{{"format":"{FORMAT}",'.encode()


class ManifestWriter:
    """The manifest and dump files of a capture (the part of :class:`Recorder` that writes)."""

    # set by Recorder.__init__
    path: Path
    row_map: RowMap | None
    block_rows: int
    scheme: str
    root: str
    layout_inputs: tuple[str, ...]
    metadata: dict[str, Any]
    ops: list[dict[str, Any]] | None
    whole_only: list[str]
    boundaries: list[dict[str, Any]]
    dump_requests: set[str] | None

    def manifest(self, *, complete: bool, error: str | None = None) -> dict[str, Any]:
        """The manifest as a dict: format, version, ``complete``, the host's hash scheme, the
        capture's settings and row map, metadata and boundaries; ``ops`` and ``error`` if any.
        """
        row_map = None if self.row_map is None else self.row_map.to_json()
        return {**self._settings(complete), "row_map": row_map, **self._contents(error),
                "boundaries": self.boundaries}  # fmt: skip

    def _settings(self, complete: bool) -> dict[str, Any]:
        """The manifest's keys before the row map."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "complete": complete,
            "hash": self.scheme,  # the host's scheme; each boundary names its own
            "block_rows": self.block_rows,
            "root": self.root,
            "layout_inputs": list(self.layout_inputs),
        }

    def _contents(self, error: str | None) -> dict[str, Any]:
        """The manifest's keys after the row map, but the boundaries."""
        m: dict[str, Any] = {
            "batch": None if self.row_map is None else self.row_map.batch,
            "whole_only": self.whole_only,
            "metadata": self.metadata,
        }
        if self.ops is not None:
            m["ops"] = self.ops
        if error is not None:
            m["error"] = error
        return m

    def write_manifest(
        self, *, complete: bool, error: str | None = None, durable: bool = True
    ) -> None:
        """Write ``manifest.json``, atomically (a temporary file renamed into place).

        It is fsynced before the rename only where the capture wrote dump files (they
        are durable before a manifest vouches for them; their writer syncs them). A
        manifest that describes no file but itself needs no fsync: after a crash the
        folder holds the in-progress marker, an empty or a cut file, each of which a
        reader refuses, or the complete manifest (measured: 0.2 to 0.7 ms saved per
        capture). ``durable=False``: the in-progress marker, never fsynced.
        """
        if not durable:
            # what the capture is, and that it is not finished: no row map, no boundaries
            # (a reader refuses it whatever it holds; the row map alone is kilobytes)
            full = {**self._settings(complete), "metadata": self.metadata}
            if error is not None:
                full["error"] = error
            marker = {k: full[k] for k in _MARKER_KEYS if k in full}
            _replace(self.path, _COMPACT.encode(marker | {"boundaries": []}))
            return
        # the row map's text is made once per row map; the keys in manifest()'s order
        row_map = "null" if self.row_map is None else self.row_map.json_text()
        contents = _encode_compact(self._contents(error))[1:-1]
        head = f'{_encode_compact(self._settings(complete))[:-1]},"row_map":{row_map},{contents}'
        boundaries = self.boundaries
        # one boundary per line: compact, yet diffable and readable with grep
        lines = jsonenc.compact_lines(boundaries)
        if lines is None:
            lines = ",\n".join(map(_encode_compact, boundaries))
        text = f'{head},"boundaries":[\n{lines}\n]}}\n'
        if any(b["dump"] for b in boundaries) or os.path.isdir(os.path.join(self.path, TENSOR_DIR)):
            _atomic.atomic_write_text(self.path / MANIFEST, text)
        else:
            _replace(self.path, text)

    def _dump_plan(self, index: int, per_request: bool) -> dict[str, Any]:
        """The manifest's ``dump`` entry of boundary ``index`` (the file is written later)."""
        (self.path / TENSOR_DIR).mkdir(exist_ok=True)
        rel = f"{TENSOR_DIR}/{index:05d}.safetensors"
        if not per_request or self.dump_requests is None or self.row_map is None:
            return {"file": rel, "whole": True}
        wanted = [r for r in self.row_map.requests if r in self.dump_requests]
        return {"file": rel, "whole": False, "requests": wanted}

    def _write_dump(self, plan: dict[str, Any], arr: np.ndarray, rows: np.ndarray | None) -> None:
        from dmlib.io.safetensors import write_safetensors

        if plan["whole"]:
            write_safetensors(self.path / plan["file"], {WHOLE_KEY: arr})
            return
        requests = cast(RowMap, self.row_map).requests
        write_safetensors(
            self.path / plan["file"],
            {
                REQUEST_PREFIX + r: np.ascontiguousarray(cast(np.ndarray, rows)[requests[r]])
                for r in plan["requests"]
            },
        )


def _replace(folder: Path, text: str) -> None:
    """``folder/manifest.json`` replaced by ``text`` through a rename, without fsync.

    The manifest it replaces (a capture's own: the in-progress marker, or the capture
    that ``overwrite=True`` replaces) is removed first: renaming over an existing file
    makes ext4 (``auto_da_alloc``) write the new file's data out at once, 0.3 ms a
    manifest (measured), while a reader of the folder sees no difference between no
    manifest and an unfinished one (both are refused). A run stopped between the two
    steps leaves the temporary file, which :func:`_prepare_dir` recognises as a capture.
    """
    tmp = os.path.join(folder, MANIFEST + ".tmp")
    data = memoryview(text.encode())  # (ASCII: the JSON is written with ensure_ascii)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)
    final = os.path.join(folder, MANIFEST)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(final)
    os.replace(tmp, final)


def _prepare_dir(path: Path, overwrite: bool) -> None:
    """Create the capture directory; replace only a capture, and only when asked to.

    A folder that holds no dmlib capture manifest is never emptied: ``overwrite=True``
    on one that holds anything is refused, and so is any folder with a ``tensors``
    entry but no manifest (the dumps would overwrite files dmlib did not write). A
    folder whose only manifest is dmlib's temporary one (a run stopped between the two
    steps of :func:`_replace`) counts as a capture.
    """
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:
        is_dir = None  # nothing there
    except OSError as err:
        raise CaptureError(f"cannot be read ({err.strerror})", path=path) from None
    if is_dir is False:
        raise CaptureError("exists and is not a folder; expected a capture folder", path=path)
    manifest = path / MANIFEST
    # a run stopped inside _replace leaves its manifest under the temporary name alone
    is_capture = _holds_capture(manifest) or (
        not os.path.lexists(manifest) and _holds_capture(path / (MANIFEST + ".tmp"))
    )
    if manifest.exists() and not is_capture:
        raise CaptureError(
            f"{MANIFEST} here is not a {FORMAT} manifest: not a capture, not replaced", path=path
        )
    if is_capture and not overwrite:
        raise CaptureError(
            "a capture already exists here; pass overwrite=True to replace it", path=path
        )
    tensors = path / TENSOR_DIR
    if not is_capture and is_dir:
        if overwrite and any(path.iterdir()):
            raise CaptureError(
                f"overwrite=True replaces only a capture (a folder holding a {FORMAT} "
                f"{MANIFEST}); this folder holds other files: nothing replaced",
                path=path,
            )
        if os.path.lexists(tensors):
            raise CaptureError(
                f"holds {TENSOR_DIR}/ but no capture manifest: not a capture; dmlib writes "
                "no dump over files it did not write",
                path=path,
            )
    if not is_dir:
        path.mkdir(parents=True, exist_ok=True)
    if is_capture and tensors.is_dir() and not tensors.is_symlink():
        for f in tensors.glob("*.safetensors"):  # a capture's own dumps
            if f.is_file() or f.is_symlink():
                f.unlink()


def _holds_capture(manifest: Path) -> bool:
    """Whether ``manifest`` is a regular file holding a dmlib capture manifest (any state).

    A file as dmlib writes it (the ``format`` key first, a whole JSON object: it ends
    in ``}``) is recognised from its first and last bytes, without parsing the rest
    (a capture's manifest is often megabytes; re-capturing into a folder is common);
    any other file is parsed whole, as before.
    """
    try:
        # not through a symbolic link (ELOOP), and without waiting on a FIFO (O_NONBLOCK)
        fd = os.open(manifest, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return False
        head = os.pread(fd, len(_HEAD) + 64, 0)
        tail = os.pread(fd, 8, max(0, st.st_size - 8))
        if head.startswith(_HEAD) and tail.rstrip().endswith(b"}"):
            return True
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        # only the top-level "format" is read: a plain parse, too deep a nesting refused
        # (RecursionError); no walk of the whole document (milliseconds on a big manifest)
        doc = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(doc, dict) and doc.get("format") == FORMAT
