"""Execute report notebooks headless, several kernels at a time.

The first code cell tagged ``parameters`` keeps its defaults and a cell inserted after it
(tagged ``injected-parameters``) overrides them: papermill's convention, so the same
notebooks also run under ``papermill nb.ipynb out.ipynb -p STUDY study.toml``. A name
that no notebook's parameters cell assigns is refused. Each notebook runs in a fresh
kernel of *this* interpreter (a private kernelspec pointing at ``sys.executable``, IPC
sockets in a private folder), with the report folder as its working directory, so that
the parameters it sees are relative paths (``STUDY = "study.toml"``) and no absolute
path of this machine appears in what it prints.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmlib.errors import DmlibError, MissingDependencyError

__all__ = [
    "NotebookResult",
    "copy_notebooks",
    "find_notebooks",
    "inject_parameters",
    "notebook_parameters",
    "parse_param",
    "run_notebooks",
]

KERNEL_NAME = "dmlib-python3"
INJECTED_TAG = "injected-parameters"


def _shipped_notebooks() -> Path:
    """The notebook collection: ``dmlib/notebooks/`` in an installed wheel, else the
    top-level ``notebooks/`` of the source checkout dmlib is imported from."""
    package = Path(__file__).resolve().parent.parent
    wheel = package / "notebooks"
    if wheel.is_dir():
        return wheel
    # a source checkout (editable install, or PYTHONPATH): notebooks/ beside dmlib/, only
    # where that folder is this project's (its pyproject.toml names dmlib), never a stray
    # notebooks/ folder of another package beside an installed dmlib
    checkout = package.parent
    try:
        ours = 'name = "dmlib"' in (checkout / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        ours = False
    return checkout / "notebooks" if ours else wheel


PACKAGE_NOTEBOOKS = _shipped_notebooks()
# the inline backend: figures a notebook makes are shown in it even when the caller's
# environment says MPLBACKEND=Agg (as `make` did)
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"


@dataclass
class NotebookResult:
    """What happened to one notebook."""

    name: str
    ok: bool
    seconds: float
    nb: Any = None
    failed_cell: int | None = None
    n_cells: int | None = None
    error: str | None = None
    skipped: str | None = None
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str:
        """``"skipped"``, ``"ok"`` or ``"FAILED"``."""
        if self.skipped:
            return "skipped"
        return "ok" if self.ok else "FAILED"

    def describe(self) -> str:
        """One line: the name, then ``ok in N s``, ``skipped (why)`` or ``FAILED``, cell, error."""
        if self.skipped:
            return f"{self.name}: skipped ({self.skipped})"
        if self.ok:
            return f"{self.name}: ok in {self.seconds:.1f} s"
        where = (
            f" in cell {self.failed_cell} of {self.n_cells}" if self.failed_cell is not None else ""
        )
        return f"{self.name}: FAILED{where}: {self.error}"


# ---------------------------------------------------------------------------
# parameters


def _tags(cell: Any) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def notebook_parameters(nb: Any) -> list[str]:
    """Names assigned in the first code cell tagged ``parameters`` (in order)."""
    for c in nb.cells:
        if c.cell_type == "code" and "parameters" in _tags(c):
            try:
                tree = ast.parse(c.source)
            except SyntaxError:
                return []
            names = []
            for node in tree.body:
                targets = (
                    node.targets
                    if isinstance(node, ast.Assign)
                    else [getattr(node, "target", None)]
                )
                names += [t.id for t in targets if isinstance(t, ast.Name)]
            return list(dict.fromkeys(names))
    return []


def inject_parameters(nb: Any, params: Mapping[str, Any]) -> int:
    """Insert a cell assigning ``params`` after the first code cell tagged ``parameters``.

    Without such a cell the assignments go first. A previously injected cell is replaced.
    Returns the index of the injected cell.
    """
    import nbformat

    for k in params:
        if not k.isidentifier():
            raise DmlibError(f"parameter name {k!r} is not a Python identifier")
    nb.cells = [c for c in nb.cells if INJECTED_TAG not in _tags(c)]
    lines = ["# Parameters injected by dmlib report"]
    lines += [f"{k} = {_literal(k, v)}" for k, v in params.items()]
    cell = nbformat.v4.new_code_cell("\n".join(lines), metadata={"tags": [INJECTED_TAG]})
    at = 0
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code" and "parameters" in _tags(c):
            at = i + 1
            break
    nb.cells.insert(at, cell)
    return at


def _literal(name: str, value: Any) -> str:
    text = repr(value)
    try:
        if ast.literal_eval(text) != value:
            raise ValueError
    except (ValueError, SyntaxError):
        raise DmlibError(
            f"parameter {name}={text} is not a Python literal; pass str, int, float, bool, None, list or dict"
        ) from None
    return text


def parse_param(text: str) -> tuple[str, Any]:
    """``NAME=VALUE``: VALUE as a Python literal where it parses as one, else as a string."""
    name, sep, raw = text.partition("=")
    if not sep or not name.isidentifier():
        raise DmlibError(f"--param {text!r}: expected NAME=VALUE with NAME a Python identifier")
    try:
        return name, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return name, raw


def require_jupyter() -> None:
    """Refuse early, in one line, when the ``report`` extra is not installed."""
    import importlib.util

    missing = [
        m
        for m in ("nbclient", "nbconvert", "nbformat", "ipykernel", "nh3")
        if importlib.util.find_spec(m) is None
    ]
    if missing:
        raise MissingDependencyError(
            f"running the report notebooks needs {', '.join(missing)}: pip install 'dmlib[report]'"
        )


# ---------------------------------------------------------------------------
# finding notebooks


def find_notebooks(
    folder: str | os.PathLike[str] | None = None, only: Sequence[str] | None = None
) -> list[Path]:
    """The ``*.ipynb`` of ``folder`` (default: the collection shipped with dmlib), by name."""
    require_jupyter()
    folder = PACKAGE_NOTEBOOKS if folder is None else Path(folder)
    if not folder.is_dir():
        raise DmlibError(
            f"notebook folder not found (looked in {folder}); pass --notebooks FOLDER, or leave "
            "it out to use the notebooks shipped with dmlib",
            path=folder,
        )
    found = sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))
    if only:
        wanted = [Path(n).stem for n in only]
        missing = sorted(set(wanted) - {p.stem for p in found})
        if missing:
            raise DmlibError(
                f"no notebook named {', '.join(missing)}; available: {', '.join(p.stem for p in found)}",
                path=folder,
            )
        found = [p for p in found if p.stem in wanted]
    if not found:
        raise DmlibError("no notebooks (*.ipynb) in this folder", path=folder)
    return found


def copy_notebooks(
    dest: str | os.PathLike[str],
    study: str | os.PathLike[str],
    *,
    force: bool = False,
    folder: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Copy the notebook collection (or ``folder``'s) into ``dest``, each one's parameters
    cell pointed at ``study`` (``STUDY``, relative to ``dest`` where it can be) and its
    figures at ``dest/figures``; the written paths.

    Nothing is written when a notebook of that name exists in ``dest`` and ``force`` is
    False (:class:`DmlibError` naming it); no other file of ``dest`` is touched. The
    notebooks are JSON edited as data (only the parameters cell's two assignments change).
    """
    src = PACKAGE_NOTEBOOKS if folder is None else Path(folder)
    found = sorted(p for p in src.glob("*.ipynb") if not p.name.startswith("."))
    if not found:
        raise DmlibError("no notebooks (*.ipynb) in this folder", path=src)
    out = Path(dest)
    if out.exists() and not out.is_dir():
        raise DmlibError("exists and is not a folder", path=out)
    taken = [out / p.name for p in found if os.path.lexists(out / p.name)]
    if taken and not force:
        more = f" (and {len(taken) - 1} more of the notebooks)" if len(taken) > 1 else ""
        raise DmlibError(f"exists{more}; pass --force to overwrite the notebooks", path=taken[0])
    study_path = Path(study).resolve()
    try:
        where = os.path.relpath(study_path, out.resolve())
    except ValueError:  # another drive (Windows): the absolute path
        where = str(study_path)
    docs = {p: _pointed(p, where.replace(os.sep, "/")) for p in found}  # all read first
    out.mkdir(parents=True, exist_ok=True)
    from dmlib._atomic import atomic_write_text

    for p, doc in docs.items():
        atomic_write_text(out / p.name, json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    return [out / p.name for p in found]


def _pointed(path: Path, study: str) -> dict[str, Any]:
    """A notebook's JSON with its parameters cell's ``STUDY`` and ``FIGURE_DIR`` set."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        cells = doc["cells"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DmlibError(f"cannot read notebook: {err}", path=path) from None
    values = {"STUDY": repr(study), "FIGURE_DIR": repr("figures")}
    for cell in cells:
        if cell.get("cell_type") != "code" or "parameters" not in _tags(cell):
            continue
        source = cell["source"]
        lines = ("".join(source) if isinstance(source, list) else source).split("\n")
        for i, line in enumerate(lines):
            name = line.split("=", 1)[0].strip()
            if name in values and "=" in line:
                lines[i] = f"{name} = {values.pop(name)}"
        lines += [f"{k} = {v}" for k, v in values.items()]  # a cell that lacked one
        text = "\n".join(lines)
        cell["source"] = [ln + "\n" for ln in text.split("\n")[:-1]] + [text.split("\n")[-1]]
        return dict(doc)
    raise DmlibError("no code cell tagged 'parameters' (STUDY cannot be set)", path=path)


def read_notebook(path: Path) -> Any:
    """The notebook at ``path`` (nbformat version 4); DmlibError if it cannot be read."""
    import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except Exception as err:  # nbformat raises several unrelated types for a bad file
        raise DmlibError(f"cannot read notebook: {err}", path=path) from None


# ---------------------------------------------------------------------------
# kernels


def _kernel_dir(root: Path) -> Path:
    """A kernelspec folder whose kernel is this interpreter (not whatever `python` is on PATH)."""
    spec = root / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (dmlib)",
                "language": "python",
            }
        )
    )
    return root / "kernels"


def _kernel_manager(kernel_dir: Path, n: int) -> Any:
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    ksm = KernelSpecManager(kernel_dirs=[str(kernel_dir)], ensure_native_kernel=False)
    # IPC sockets in the private kernel folder: nothing listens on the network
    return AsyncKernelManager(
        kernel_name=KERNEL_NAME,
        kernel_spec_manager=ksm,
        transport="ipc",
        ip=str(kernel_dir.parent / f"ipc{n}"),
        # the connection file too, so that nothing of a killed run is left elsewhere
        connection_file=str(kernel_dir.parent / f"kernel-{n}.json"),
    )


# ---------------------------------------------------------------------------
# running


def _failed_cell(nb: Any) -> tuple[int | None, str | None]:
    """(number of the failing cell in the notebook as stored, counting from 1; its error)."""
    injected = 0
    for i, c in enumerate(nb.cells):
        if INJECTED_TAG in _tags(c):
            injected = 1
            continue
        for out in c.get("outputs", []) if c.cell_type == "code" else []:
            if out.get("output_type") == "error":
                return i - injected + 1, f"{out.get('ename')}: {out.get('evalue')}"
    return None, None


async def _run_one(
    path: Path,
    cwd: Path,
    params: Mapping[str, Any],
    env: Mapping[str, str],
    kernel_dir: Path,
    n: int,
    timeout: int,
) -> NotebookResult:
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = read_notebook(path)
    n_cells = len(nb.cells)
    accepted = set(notebook_parameters(nb))
    inject_parameters(nb, {k: v for k, v in params.items() if k in accepted})
    client = NotebookClient(
        nb,
        km=_kernel_manager(kernel_dir, n),
        timeout=timeout,
        resources={"metadata": {"path": str(cwd)}},
        shutdown_kernel="immediate",  # the notebook is done (or interrupted): no grace needed
    )
    t0 = time.perf_counter()
    error = cell = None
    try:
        await client.async_execute(cleanup_kc=True, env=dict(env))
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
        cell, error = _failed_cell(nb)
        if error is None:
            text = str(err).strip()
            error = text.splitlines()[-1] if text else type(err).__name__
    finally:
        _drop_exit_hook(client)
    return NotebookResult(
        name=path.stem,
        ok=error is None,
        seconds=time.perf_counter() - t0,
        nb=nb,
        failed_cell=cell,
        n_cells=n_cells,
        error=error,
    )


def _drop_exit_hook(client: Any) -> None:
    """Remove the exit hook nbclient registers for each client's kernel.

    nbclient removes it only when its kernel cleanup runs to its end; a run cancelled by
    Ctrl-C or SIGTERM (the cleanup interrupted, or the kernel still starting) kept it, and
    at exit it failed on the kernel manager it had already dropped: one traceback per
    notebook after "interrupted". The kernel itself is shut down by the cancelled client
    (or, the hook gone, by :func:`_stop_kernel` below).
    """
    import atexit

    hook = getattr(client, "_cleanup_kernel", None)  # nbclient's name for it (7.x-0.10)
    if hook is not None:
        atexit.unregister(hook)
    km = getattr(client, "km", None)
    if km is not None:
        _stop_kernel(km)


def _stop_kernel(km: Any) -> None:
    """Kill a kernel a cancelled client left running (its process, at once)."""
    import contextlib

    with contextlib.suppress(Exception):
        if km.has_kernel and km.provisioner is not None:
            proc = getattr(km.provisioner, "process", None)
            if proc is not None and proc.poll() is None:
                proc.kill()


def run_notebooks(
    paths: Sequence[Path],
    cwd: str | os.PathLike[str],
    params: Mapping[str, Any],
    *,
    jobs: int | None = None,
    timeout: int = 600,
    progress: Callable[[NotebookResult], None] | None = None,
) -> list[NotebookResult]:
    """Execute the notebooks (``jobs`` kernels at a time), working directory ``cwd``.

    Every name in ``params`` must be assigned in the parameters cell of at least one of
    the notebooks; each notebook receives the ones its own cell assigns. Results come back
    in the order of ``paths``; ``progress`` is called as each one finishes.
    """
    known: set[str] = set()
    for p in paths:
        known |= set(notebook_parameters(read_notebook(p)))
    unknown = sorted(set(params) - known)
    if unknown:
        raise DmlibError(
            f"{', '.join(unknown)}: not a parameter of any notebook run; parameters: {', '.join(sorted(known))}"
        )
    cwd = Path(cwd)
    env = dict(os.environ)
    env["MPLBACKEND"] = INLINE_BACKEND
    # the figure folder for notebooks that do not configure one (the rule in notebook.py)
    env["DMLIB_FIGURE_DIR"] = str(params.get("FIGURE_DIR", "figures"))
    jobs = max(1, min(jobs or min(4, os.cpu_count() or 1), len(paths)))
    from dmlib.report import outdir

    outdir.clean_stale(Path(tempfile.gettempdir()), "dmlib-kernel-*")  # left by a killed run
    tmp = Path(tempfile.mkdtemp(prefix="dmlib-kernel-"))
    try:
        outdir.write_owner(tmp)
        kernel_dir = _kernel_dir(tmp)
        stopping = threading.Event()

        async def main() -> list[NotebookResult]:
            gate = asyncio.Semaphore(jobs)

            async def one(i: int, p: Path) -> NotebookResult:
                async with gate:
                    env_i = {**env, "DMLIB_NOTEBOOK": p.stem}
                    res = await _run_one(p, cwd, params, env_i, kernel_dir, i, timeout)
                if progress is not None and not stopping.is_set():  # no "FAILED" on Ctrl-C
                    progress(res)
                return res

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(paths))))

        return _interruptible(main, stopping)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _interruptible(main: Callable[[], Any], stopping: Any) -> Any:
    """``asyncio.run(main())`` in a worker thread; Ctrl-C cancels it cleanly.

    nbclient answers SIGINT in the main thread by killing its kernel under the running
    cell (a traceback, then a failed assertion: exit 4). In a worker thread it installs no
    signal handler; Ctrl-C reaches this thread as KeyboardInterrupt, which cancels the
    notebooks' task (each client shuts its kernel down as it unwinds), waits for that, and
    is raised again for the command line to exit 130.
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    async def wrapped() -> Any:
        box["loop"], box["task"] = asyncio.get_running_loop(), asyncio.current_task()
        return await main()

    def work() -> None:
        try:
            box["value"] = asyncio.run(wrapped())
        except BaseException as err:  # handed to the calling thread
            box["error"] = err
        finally:
            done.set()

    # an Event, not Thread.join: a join interrupted by Ctrl-C can mark a running thread dead
    threading.Thread(target=work, name="dmlib-notebooks", daemon=True).start()
    try:
        while not done.wait(0.25):
            pass
    except KeyboardInterrupt:
        stopping.set()
        if "task" in box:
            box["loop"].call_soon_threadsafe(box["task"].cancel)
        done.wait(30)  # each kernel is shut down as its client unwinds; Ctrl-C again stops waiting
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


# ---------------------------------------------------------------------------
# paths of this machine


def _fixer(replacements: Sequence[tuple[str, str]]) -> Callable[[str], str] | None:
    pairs = sorted({(a, b) for a, b in replacements if a and a != os.sep}, key=lambda x: -len(x[0]))
    if not pairs:
        return None
    rx = re.compile("|".join(re.escape(a) for a, _ in pairs))
    table = dict(pairs)
    return lambda text: rx.sub(lambda m: table[m.group(0)], text)


def scrub_text(text: str, replacements: Sequence[tuple[str, str]]) -> str:
    """``text`` with the absolute paths of ``replacements`` replaced (longest first)."""
    fix = _fixer(replacements)
    return text if fix is None else fix(text)


def scrub(nb: Any, replacements: Sequence[tuple[str, str]]) -> None:
    """Replace absolute paths of this machine in every text output (tracebacks, warnings)."""
    fix = _fixer(replacements)
    if fix is None:
        return

    for c in nb.cells:
        for out in c.get("outputs", []) if c.cell_type == "code" else []:
            if "text" in out:
                out["text"] = fix(out["text"])
            if "traceback" in out:
                out["traceback"] = [fix(t) for t in out["traceback"]]
            if "evalue" in out:
                out["evalue"] = fix(out["evalue"])
            for mime, value in list(out.get("data", {}).items()):
                if mime.startswith("text/") and isinstance(value, str):
                    out["data"][mime] = fix(value)
