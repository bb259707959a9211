"""What ``dmlib report`` may replace or delete: only what it can prove it wrote.

* A finished report folder holds :data:`MARKER` (``.dmlib-report.json``), written last:
  it names the study and lists every file and folder of the report. ``--out DIR`` is
  replaced only when DIR is new, empty, or holds that marker and nothing the marker does
  not list; and never when DIR is, holds, or lies inside an input of the study.
* A folder of several reports holds :data:`COLLECTION_MARKER`; its ``index.html`` is
  written only into a folder dmlib creates, an empty one, or one holding that marker.
* A temporary folder (the hidden ``.OUT.partial-*`` sibling a report is built in,
  ``.OUT.old-*`` while an older report is removed, ``dmlib-kernel-*`` in the temporary
  folder) holds :data:`OWNER` (pid and host of the process using it). One left behind by
  a killed process is removed by the next run only when it is a real folder (not a
  link) of this user, its owner file names this host, and that process is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dmlib.errors import DmlibError

__all__ = [
    "COLLECTION_MARKER",
    "MARKER",
    "OWNER",
    "check_collection",
    "check_out",
    "clean_stale",
    "listing",
    "read_marker",
    "write_marker",
    "write_owner",
]

MARKER = ".dmlib-report.json"
COLLECTION_MARKER = ".dmlib-reports.json"
OWNER = ".dmlib-owner.json"


def listing(folder: Path) -> list[str]:
    """Every file and folder under ``folder`` (``/``-separated, folders ending in ``/``),
    links not followed."""
    out: list[str] = []
    for here, dirs, files in os.walk(folder):
        rel = Path(here).relative_to(folder)
        out += [(rel / d).as_posix() + "/" for d in dirs]
        out += [(rel / f).as_posix() for f in files]
    return sorted(out)


def write_marker(folder: Path, kind: str, facts: dict[str, Any]) -> None:
    """Write ``folder``'s marker last: ``facts`` and the listing of everything in it."""
    name = MARKER if kind == "report" else COLLECTION_MARKER
    files = sorted({*listing(folder), name})
    body = {"dmlib": kind, **facts, "files": files}
    (folder / name).write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")


def read_marker(folder: Path, kind: str = "report") -> dict[str, Any] | None:
    """``folder``'s marker of ``kind`` ("report" or "collection"), or None when it has none."""
    path = folder / (MARKER if kind == "report" else COLLECTION_MARKER)
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = (
        isinstance(data, dict)
        and data.get("dmlib") == kind
        and isinstance(data.get("files"), list)
        and all(isinstance(f, str) for f in data["files"])
    )
    return data if ok else None


def _resolved(p: Path) -> Path:
    try:
        return p.resolve()
    except (OSError, RuntimeError):
        return p.absolute()


def check_inputs(out: Path, holds: Iterable[Path], contains: Iterable[Path]) -> None:
    """Refuse ``out`` when it is or holds a path of ``holds``, or lies inside ``contains``."""
    out = _resolved(out)
    for p in holds:
        q = _resolved(Path(p))
        if q == out or out in q.parents:
            raise DmlibError(
                f"--out would replace the study's own input {q.name!r}: pass a folder "
                "outside the study's inputs (nothing was written or deleted)",
                path=out,
            )
    for folder in contains:
        f = _resolved(Path(folder))
        if f in out.parents:
            raise DmlibError(
                f"--out lies inside the study's input folder {f.name!r}: pass a folder "
                "outside it (nothing was written or deleted)",
                path=out,
            )


def check_out(
    out: str | os.PathLike[str],
    holds: Iterable[Path] = (),
    contains: Iterable[Path] = (),
) -> None:
    """Refuse a report folder dmlib may not replace (see the module docstring)."""
    out = Path(out)
    check_inputs(out, holds, contains)
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_dir():
        raise DmlibError(
            "exists and is not a folder; pass a new or empty folder to --out", path=out
        )
    if not any(out.iterdir()):
        return
    marker = read_marker(out)
    if marker is None:
        raise DmlibError(
            f"exists and is not a report dmlib wrote (no {MARKER}): dmlib replaces only "
            "its own reports; pass a new or empty folder to --out (nothing was deleted)",
            path=out,
        )
    # files first: the one to name is what the user would lose
    extra = sorted(set(listing(out)) - set(marker["files"]), key=lambda f: (f.endswith("/"), f))
    if extra:
        raise DmlibError(
            f"holds {extra[0]!r}{f' and {len(extra) - 1} more' if len(extra) > 1 else ''}, "
            "which dmlib did not write: move it out of the report or pass another --out "
            "(nothing was deleted)",
            path=out,
        )


def check_collection(out: Path) -> None:
    """Refuse to write a collection's ``index.html`` into a folder that is not dmlib's."""
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_dir():
        raise DmlibError(
            "exists and is not a folder; pass a new or empty folder to --out", path=out
        )
    if any(out.iterdir()) and read_marker(out, "collection") is None:
        raise DmlibError(
            f"exists and is not a folder of reports dmlib wrote (no {COLLECTION_MARKER}): "
            "its index.html would be overwritten; pass a new or empty folder to --out "
            "(nothing was written)",
            path=out,
        )


# ---------------------------------------------------------------------------
# temporary folders


def write_owner(folder: Path) -> None:
    """Record in ``folder`` which process uses it (for :func:`clean_stale`)."""
    facts = {"pid": os.getpid(), "host": socket.gethostname()}
    (folder / OWNER).write_text(json.dumps(facts) + "\n", encoding="utf-8")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process has that pid
        return True
    except OSError:
        return True
    return True


def _abandoned(folder: Path) -> bool:
    """True only when ``folder`` is provably a temporary folder of a dead dmlib process."""
    try:
        st = folder.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False
        owner = folder / OWNER
        if not stat.S_ISREG(owner.lstat().st_mode):
            return False
        facts = json.loads(owner.read_text(encoding="utf-8"))
        pid = facts["pid"]
        if facts["host"] != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
            return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return pid != os.getpid() and not _alive(pid)


def clean_stale(parent: Path, pattern: str) -> list[Path]:
    """Remove the folders ``parent/pattern`` left by killed dmlib processes; return them."""
    removed = []
    try:
        candidates = sorted(parent.glob(pattern))
    except OSError:
        return []
    for folder in candidates:
        if _abandoned(folder):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
