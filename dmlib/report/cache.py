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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from dmlib._atomic import atomic_write_text
from dmlib.errors import DmlibError

__all__ = ["CACHE_FORMAT", "cache_dir", "matrix_key", "study_matrix"]

CACHE_FORMAT = "dmlib-matrix-cache-v1"


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
    """An exclusive lock on ``path`` (a no-op where ``fcntl`` is missing)."""
    try:
        import fcntl
    except ImportError:  # Windows: two kernels may both compute; the writes stay atomic
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _json_default(value: Any) -> Any:
    import numpy as np

    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"not JSON: {type(value).__name__}")


def _read(path: Path, key: str) -> dict[str, Any] | None:
    """The cached entry at ``path`` when it exists and its key is ``key``, else None."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # not ours or damaged: computed again and rewritten
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
    it and writes ``cache_dir(folder)/matrix-<key>.json``; a later call with the same key
    (the same study file, runs, control and unchanged input files) reads that file.
    ``use_cache=False`` computes without reading or writing the cache.
    """
    if not use_cache:
        return _compute(study, files, control)[0]
    key = matrix_key(study, files, {"control": control})
    where = cache_dir(folder)
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"matrix-{key[:32]}.json"
    with _locked(where / f"matrix-{key[:32]}.lock"):
        cached = _rebuild(_read(path, key))
        if cached is not None:
            return cached
        frame, entry = _compute(study, files, control)
        entry.update(format=CACHE_FORMAT, key=key)
        text = json.dumps(entry, default=_json_default)
        atomic_write_text(path, text)
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
