"""Execute the report notebooks headless and write them out as HTML.

``python -m dmlib.report --notebooks notebooks --out reports [--small] [--only NAME ...]``

For each notebook: the first code cell tagged ``parameters`` keeps its defaults and a
cell inserted after it (tagged ``injected-parameters``) overrides them, papermill-style:
``FIGURE_DIR`` (``<out>/figures``), ``DATA_DIR`` (absolute), ``SMALL`` and any ``--param
NAME=VALUE``. The notebook runs in a fresh kernel of *this* interpreter (a kernelspec
pointing at ``sys.executable``, so the kernel sees the same packages), and the executed
notebook and its HTML are written to ``<out>/<name>.ipynb`` and ``<out>/<name>.html``,
with ``<out>/index.html`` linking them. A failing cell makes the exit status 1 and the
message names the notebook and the cell; the other notebooks still run.
"""

from __future__ import annotations

import argparse
import ast
import html
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmlib._atomic import atomic_write_text
from dmlib.errors import DmlibError

__all__ = [
    "NotebookResult",
    "inject_parameters",
    "main",
    "run_notebook",
    "run_notebooks",
    "write_index",
]

KERNEL_NAME = "dmlib-python3"
INJECTED_TAG = "injected-parameters"


@dataclass
class NotebookResult:
    """What happened to one notebook."""

    name: str
    ok: bool
    seconds: float
    html: Path | None = None
    executed: Path | None = None
    failed_cell: int | None = None
    error: str | None = None
    figures: list[Path] = field(default_factory=list)

    def describe(self) -> str:
        if self.ok:
            return f"{self.name}: ok in {self.seconds:.1f} s"
        where = (
            f" at cell {self.failed_cell} (counting from 0)" if self.failed_cell is not None else ""
        )
        return f"{self.name}: FAILED{where}: {self.error}"


# ---------------------------------------------------------------------------
# parameters


def inject_parameters(nb: Any, params: Mapping[str, Any]) -> int:
    """Insert a cell assigning ``params`` after the first code cell tagged ``parameters``.

    Without such a cell the assignments go first. A previously injected cell is replaced.
    Returns the index of the injected cell.
    """
    import nbformat

    for k in params:
        if not k.isidentifier():
            raise DmlibError(f"parameter name {k!r} is not a Python identifier")
    nb.cells = [c for c in nb.cells if INJECTED_TAG not in c.get("metadata", {}).get("tags", [])]
    lines = ["# Parameters injected by dmlib.report"]
    lines += [f"{k} = {_literal(k, v)}" for k, v in params.items()]
    cell = nbformat.v4.new_code_cell("\n".join(lines), metadata={"tags": [INJECTED_TAG]})
    at = 0
    for i, c in enumerate(nb.cells):
        if c.cell_type == "code" and "parameters" in c.get("metadata", {}).get("tags", []):
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


# ---------------------------------------------------------------------------
# kernel


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


def _kernel_manager(kernel_dir: Path) -> Any:
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    ksm = KernelSpecManager(kernel_dirs=[str(kernel_dir)], ensure_native_kernel=False)
    # IPC sockets in the private kernel folder: nothing listens on the network
    return AsyncKernelManager(
        kernel_name=KERNEL_NAME,
        kernel_spec_manager=ksm,
        transport="ipc",
        ip=str(kernel_dir.parent / "ipc"),
    )


# ---------------------------------------------------------------------------
# one notebook


def _failed_cell(nb: Any) -> tuple[int | None, str | None]:
    """(index of the failing cell in the notebook file as stored, "its first line -> error")."""
    injected_before = 0
    for i, c in enumerate(nb.cells):
        if INJECTED_TAG in c.get("metadata", {}).get("tags", []):
            injected_before = 1
            continue
        for out in c.get("outputs", []) if c.cell_type == "code" else []:
            if out.get("output_type") == "error":
                first = next((ln for ln in c.source.splitlines() if ln.strip()), "")
                return (
                    i - injected_before,
                    f"`{first.strip()}` raised {out.get('ename')}: {out.get('evalue')}",
                )
    return None, None


def _to_html(nb: Any) -> str:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nb)
    return body


def run_notebook(
    path: str | os.PathLike[str],
    out: str | os.PathLike[str],
    params: Mapping[str, Any],
    *,
    kernel_dir: Path,
    timeout: int = 600,
) -> NotebookResult:
    """Execute one notebook with ``params`` injected; write ``<out>/<stem>.ipynb`` and ``.html``."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    path, out = Path(path), Path(out)
    name = path.stem
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as err:  # nbformat raises several unrelated types for a bad file
        raise DmlibError(f"cannot read notebook: {err}", path=path) from None
    inject_parameters(nb, params)
    env = dict(os.environ)
    env.setdefault("MPLBACKEND", "Agg")
    env["DMLIB_FIGURE_DIR"] = str(params.get("FIGURE_DIR", out / "figures"))
    env["DMLIB_NOTEBOOK"] = name
    # numbers are merged key by key: start from none, so no key of an earlier run survives
    stale = Path(env["DMLIB_FIGURE_DIR"]).parent / "numbers" / f"{name}.json"
    stale.unlink(missing_ok=True)
    client = NotebookClient(
        nb,
        km=_kernel_manager(kernel_dir),
        timeout=timeout,
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    t0 = time.perf_counter()
    error = None
    cell = None
    try:
        client.execute(cleanup_kc=True, env=env)
    except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
        cell, error = _failed_cell(nb)
        if error is None:
            text = str(err).strip()
            error = text.splitlines()[-1] if text else type(err).__name__
    seconds = time.perf_counter() - t0
    out.mkdir(parents=True, exist_ok=True)
    executed = out / f"{name}.ipynb"
    atomic_write_text(executed, nbformat.writes(nb))
    html_path = out / f"{name}.html"
    atomic_write_text(html_path, _to_html(nb))
    return NotebookResult(
        name=name,
        ok=error is None,
        seconds=seconds,
        html=html_path,
        executed=executed,
        failed_cell=cell,
        error=error,
    )


# ---------------------------------------------------------------------------
# a folder of notebooks


def find_notebooks(folder: str | os.PathLike[str], only: Sequence[str] | None = None) -> list[Path]:
    """The ``*.ipynb`` of ``folder`` in name order, restricted to the stems in ``only``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DmlibError("notebook folder not found", path=folder)
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
        raise DmlibError("no notebooks (*.ipynb) to run", path=folder)
    return found


def run_notebooks(
    notebooks: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    small: bool = False,
    only: Sequence[str] | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    timeout: int = 600,
    log: Any = None,
) -> list[NotebookResult]:
    """Execute every notebook of the folder in turn and write ``<out>/index.html``.

    ``data_dir`` defaults to ``data`` beside the notebook folder (the repository's).
    """
    paths = find_notebooks(notebooks, only)
    out = Path(out).resolve()
    data = Path(data_dir) if data_dir is not None else Path(notebooks).resolve().parent / "data"
    params: dict[str, Any] = {
        "FIGURE_DIR": str(out / "figures"),
        "DATA_DIR": str(data.resolve()),
        "SMALL": bool(small),
        **dict(overrides or {}),
    }
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="dmlib-kernel-"))
    try:
        kernel_dir = _kernel_dir(tmp)
        for p in paths:
            res = run_notebook(p, out, params, kernel_dir=kernel_dir, timeout=timeout)
            results.append(res)
            if log is not None:
                print(res.describe(), file=log, flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_index(out, results, params)
    return results


def write_index(
    out: str | os.PathLike[str], results: Sequence[NotebookResult], params: Mapping[str, Any]
) -> Path:
    """``<out>/index.html``: one line per notebook with its status, time and link."""
    out = Path(out)
    rows = []
    for r in results:
        status = "ok" if r.ok else f"FAILED at cell {r.failed_cell}: {html.escape(r.error or '')}"
        link = (
            f'<a href="{html.escape(r.html.name)}">{html.escape(r.name)}</a>'
            if r.html
            else html.escape(r.name)
        )
        rows.append(f"<tr><td>{link}</td><td>{status}</td><td>{r.seconds:.1f} s</td></tr>")
    shown = ", ".join(f"{k}={html.escape(repr(v))}" for k, v in params.items())
    text = (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>dmlib reports</title></head><body>\n'
        "<h1>dmlib reports</h1>\n"
        f"<p>Parameters: {shown}</p>\n"
        "<table>\n<tr><th>notebook</th><th>status</th><th>time</th></tr>\n"
        + "\n".join(rows)
        + "\n</table>\n</body></html>\n"
    )
    out.mkdir(parents=True, exist_ok=True)
    path = out / "index.html"
    atomic_write_text(path, text)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dmlib.report",
        description="Execute the report notebooks headless; write executed notebooks, HTML and an index.",
        epilog="Exit status: 0 every notebook ran, 1 a notebook failed (named, with its cell), 2 bad input.",
    )
    parser.add_argument(
        "--notebooks", default="notebooks", help="folder of *.ipynb (default: notebooks)"
    )
    parser.add_argument("--out", default="reports", help="output folder (default: reports)")
    parser.add_argument(
        "--small", action="store_true", help="set SMALL=True: a quick run on a subset"
    )
    parser.add_argument(
        "--only", nargs="+", metavar="NAME", help="run only these notebooks (stems)"
    )
    parser.add_argument(
        "--data", default=None, help="data folder (default: data beside the notebook folder)"
    )
    parser.add_argument(
        "--param", action="append", default=[], metavar="NAME=VALUE", help="extra parameter"
    )
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell (default: 600)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        overrides = dict(parse_param(p) for p in args.param)
        results = run_notebooks(
            args.notebooks,
            args.out,
            small=args.small,
            only=args.only,
            data_dir=args.data,
            overrides=overrides,
            timeout=args.timeout,
            log=sys.stdout,
        )
    except DmlibError as err:
        print(f"dmlib.report: {err}", file=sys.stderr)
        return 2
    failed = [r for r in results if not r.ok]
    total = time.perf_counter() - t0
    print(
        f"{len(results) - len(failed)}/{len(results)} notebooks ok in {total:.1f} s; index: {Path(args.out) / 'index.html'}"
    )
    for r in failed:
        print(
            f"dmlib.report: notebook {r.name} failed at cell {r.failed_cell} (counting from 0): {r.error}",
            file=sys.stderr,
        )
    return 1 if failed else 0
