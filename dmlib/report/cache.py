"""One matrix of runs per report: computed once, read back by every notebook that needs it.

``run_matrix`` and ``ulp_distributions`` compare the same runs with :func:`dmlib.matrix`;
they run in separate kernels, possibly at the same time. :func:`study_matrix` computes
the matrix once and keeps it in ``<figure folder>/../cache/`` (the report's staging
folder when ``dmlib report`` runs the notebooks) as a JSON file: the matrix's rows and its
verdict, never code (no pickle). A kernel that finds the file reads it when its key
matches, else computes and writes it atomically; a lock file makes a second kernel wait
for the first rather than compute the same matrix again.

The key covers everything the result depends on: the study file's SHA-256, the runs and
their order, the control, the options, dmlib's version, and the stamp (path, size,
modification time in nanoseconds) of every file read: each run's checkpoint (every file
of a checkpoint folder) and each mapping file. A changed input gives another key, so a
stale matrix is never returned.

An entry is trusted only if dmlib wrote it for this key: its first line carries an
HMAC-SHA256 of the key and the entry's bytes under a per-user secret
(:func:`secret_path`: ``$DMLIB_CACHE_DIR/matrix-cache.key``, else
``~/.cache/dmlib/matrix-cache.key``; 32 random bytes, created ``0600`` in a ``0700``
folder, used only while it is a regular file of this user that no one else may read). The
signature is checked before the entry is parsed; a file without it (a crafted
``matrix-*.json`` in a shared study or an output folder, any earlier format) is ignored
and the matrix computed again. Where there is no usable secret (``DMLIB_CACHE_DIR=off``,
a key file that is not private, or one lying inside the study, one of its inputs'
folders or the cache folder itself), nothing is read or written: every kernel computes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dmlib._atomic import atomic_write_text
from dmlib.errors import DmlibError

__all__ = ["CACHE_FORMAT", "cache_dir", "matrix_key", "secret_path", "study_matrix"]

CACHE_FORMAT = "dmlib-matrix-cache-v2"
KEY_FILE = "matrix-cache.key"
_SECRET_BYTES = 32
_NOFOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def cache_dir(folder: str | os.PathLike[str] | None = None) -> Path:
    """``<figure folder>/../cache`` (the figure folder as :func:`dmlib.report.figure_dir`)."""
    from dmlib.report.notebook import figure_dir

    return figure_dir(folder).parent / "cache"


def _stamps(path: Path) -> list[list[Any]]:
    """``[path, size, mtime_ns]`` of a file, or of every file under a folder."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    out = []
    for p in files:
        st = p.stat()
        out.append([str(p.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _installed_version() -> str | None:
    """dmlib's installed version (None when it runs from a source tree not installed)."""
    import importlib.metadata

    try:
        return importlib.metadata.version("dmlib")
    except importlib.metadata.PackageNotFoundError:
        return None


def _study_hash(study: Any) -> str | None:
    if study.path is None:
        return None
    return hashlib.sha256(Path(study.path).read_bytes()).hexdigest()


def matrix_key(study: Any, files: Mapping[str, Path], options: Mapping[str, Any]) -> str:
    """The cache key (hex SHA-256) of the matrix of ``files`` (``{run: checkpoint}``)
    of ``study`` with ``options`` (the control and the comparison settings)."""
    inputs = {k: _stamps(Path(p)) for k, p in files.items()}
    mappings = {k: _stamps(Path(study.mappings[k])) for k in files if k in study.mappings}
    desc = {
        "format": CACHE_FORMAT,
        "dmlib": _installed_version(),
        "study_sha256": _study_hash(study),
        "runs": list(files),
        "inputs": inputs,
        "mappings": mappings,
        "names": {k: study.names[k] for k in files if k in study.names},
        "options": dict(options),
    }
    text = json.dumps(desc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (none where ``fcntl`` is missing, or where ``path`` is
    a symbolic link: it is never followed, so no file is created where it points)."""
    try:
        import fcntl
    except ImportError:  # Windows: two kernels may both compute; the writes stay atomic
        yield
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    except OSError:
        yield  # not ours to lock: at worst two kernels compute the same matrix
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def secret_path() -> Path | None:
    """Where this user's cache secret is kept: ``$DMLIB_CACHE_DIR/matrix-cache.key``
    (``off``: nowhere), else ``$XDG_CACHE_HOME/dmlib/...``, else ``~/.cache/dmlib/...``."""
    root = os.environ.get("DMLIB_CACHE_DIR")
    if root is not None and root.strip().lower() in ("off", "0", "none", ""):
        return None
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "dmlib")
    return Path(root) / KEY_FILE


def _read_secret(path: Path) -> bytes | None:
    """The secret, when ``path`` is a regular file of this user, private, of 32 bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        private = st.st_uid == os.getuid() and not st.st_mode & 0o077
        if not (stat.S_ISREG(st.st_mode) and private and st.st_size == _SECRET_BYTES):
            return None
        data = os.read(fd, _SECRET_BYTES + 1)
    finally:
        os.close(fd)
    return data if len(data) == _SECRET_BYTES else None


def _new_secret(path: Path) -> bytes | None:
    """Make the secret (written whole, then linked into place: a kernel racing this one
    finds either no file or the whole key); None where the folder cannot be written."""
    import secrets

    tmp = path.parent / f".{KEY_FILE}.{os.getpid()}.tmp"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600)
        try:
            os.write(fd, secrets.token_bytes(_SECRET_BYTES))
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another kernel made it first
            os.link(tmp, path)
    except OSError:
        return None
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    return _read_secret(path)


def _secret(study: Any, files: Mapping[str, Path], where: Path) -> bytes | None:
    """This user's secret, or None where none may be used (see the module docstring)."""
    from dmlib.safepaths import contained

    path = secret_path()
    if path is None:
        return None
    inputs = [where, *(Path(p).parent for p in files.values())]
    if study.path is not None:
        inputs.append(Path(study.path).parent)
    if any(contained(folder, path.parent) for folder in inputs):
        return None  # a key beside the entries it signs, or in a shared input, signs nothing
    if not os.path.lexists(path):
        return _new_secret(path)
    return _read_secret(path)


def _signature(secret: bytes, key: str, body: bytes) -> str:
    return hmac.new(secret, key.encode("ascii") + b"\n" + body, hashlib.sha256).hexdigest()


def _signed(entry: dict[str, Any], key: str, secret: bytes) -> str:
    """The cache file's text: the format and signature on the first line, then the entry."""
    body = json.dumps(entry, default=_json_default)
    return f"{CACHE_FORMAT} {_signature(secret, key, body.encode('utf-8'))}\n{body}"


def _json_default(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")


def _read(path: Path, key: str, secret: bytes) -> dict[str, Any] | None:
    """The cached entry at ``path`` when dmlib signed it for ``key`` with ``secret``, else
    None (absent, not a regular file, unsigned, signed for another key or by another
    secret, damaged, larger than :func:`dmlib._limits.max_decompressed`, changing while
    read): the signature is checked before a byte of the entry is parsed."""
    from dmlib import _limits
    from dmlib.safepaths import read_regular

    try:  # not through a final link, no FIFO waited on, bounded, not changed while read
        raw = read_regular(
            os.fspath(path), where=path, limit=_limits.max_decompressed(), kind="a cache entry"
        )
    except DmlibError:
        return None  # absent, not a regular file, too large: computed again
    head, _, body = raw.partition(b"\n")
    fmt, _, mac = head.decode("ascii", "replace").partition(" ")
    if fmt != CACHE_FORMAT or not hmac.compare_digest(mac, _signature(secret, key, body)):
        return None  # not written by dmlib for these inputs: never trusted
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or data.get("key") != key:
        return None
    return data


def _frame(rows: list[dict[str, Any]], verdict: Mapping[str, Any], attrs: Mapping[str, Any]) -> Any:
    """The matrix frame from its rows: :func:`dmlib.matrix`'s columns and dtypes."""
    import pandas as pd

    from dmlib.kernels.pair import NULLABLE_INT
    from dmlib.stats.compare import COLUMNS
    from dmlib.stats.verdicts import MatrixVerdict

    for r in rows:  # JSON has no tuples: the first differing index is one
        if isinstance(r.get("first_diff"), list):
            r["first_diff"] = tuple(r["first_diff"])
    out = pd.DataFrame(rows, columns=["a", "b", *COLUMNS])
    for col in NULLABLE_INT:
        out[col] = out[col].astype("UInt64" if col == "max_ulp" else "Int64")
    out.attrs = {
        "runs": attrs["runs"],
        "control": attrs["control"],
        "verdict": MatrixVerdict(**verdict),
    }
    return out


def study_matrix(
    study: Any,
    files: Mapping[str, Path],
    *,
    control: str | None = None,
    folder: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
) -> Any:
    """:func:`dmlib.matrix` of the study's runs ``files`` (``{run: checkpoint}``), once per report.

    The frame has :func:`dmlib.matrix`'s columns; its attrs keep ``runs``, ``control``
    and ``verdict`` (the per-pair compare reports are not kept). The first call computes
    it and writes ``cache_dir(folder)/matrix-<key>.json``, signed; a later call with the same
    key (the same study file, runs, control and unchanged input files) reads that file when
    its signature holds. ``use_cache=False``, or no usable secret, computes without reading
    or writing the cache.
    """
    where = cache_dir(folder)
    secret = _secret(study, files, where) if use_cache else None
    if secret is None:
        return _compute(study, files, control)[0]
    key = matrix_key(study, files, {"control": control})
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"matrix-{key[:32]}.json"
    with _locked(where / f"matrix-{key[:32]}.lock"):
        cached = _rebuild(_read(path, key, secret))
        if cached is not None:
            return cached
        frame, entry = _compute(study, files, control)
        entry.update(format=CACHE_FORMAT, key=key)
        atomic_write_text(path, _signed(entry, key, secret))
    return frame


def _rebuild(data: dict[str, Any] | None) -> Any:
    """The frame of a cache entry, or None when there is none or it does not rebuild
    (a damaged entry is computed again, never half used)."""
    if data is None:
        return None
    try:
        return _frame(data["rows"], data["verdict"], data["attrs"])
    except (KeyError, TypeError, ValueError):
        return None


def _compute(
    study: Any, files: Mapping[str, Path], control: str | None
) -> tuple[Any, dict[str, Any]]:
    """The matrix computed, and the cache entry that rebuilds the same frame."""
    from dmlib.stats.matrix import matrix_records

    rows, attrs = matrix_records(study.sources(files), control=control)
    verdict = attrs.get("verdict")
    if verdict is None:
        raise DmlibError("matrix returned no verdict", path=study.path)
    entry = {
        "rows": rows,
        "verdict": verdict.to_dict(),
        "attrs": {"runs": list(attrs["runs"]), "control": attrs["control"]},
    }
    # the frame is rebuilt from the entry's JSON, so a computed and a read matrix are equal
    data = json.loads(json.dumps(entry, default=_json_default))
    return _frame(data["rows"], data["verdict"], data["attrs"]), entry
