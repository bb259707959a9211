"""Where a report came from: library versions, the CPU, PyTorch's ISA, sha256 of every input."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dmlib.hashing import hash_file
from dmlib.kernels.stream import kernel_name
from dmlib.machine import cpu_flags, cpu_model, machine_line
from dmlib.safepaths import regular_file

__all__ = ["collect", "cpu_flags", "cpu_model", "machine_line", "torch_facts"]

LIBRARIES = (
    "dmlib",
    "numpy",
    "pandas",
    "matplotlib",
    "seaborn",
    "ml_dtypes",
    "nbclient",
    "nbconvert",
    "ipykernel",
    "torch",
)


_TORCH_PROBE = (
    "import json, torch; print(json.dumps({'torch': torch.__version__, "
    "'cpu_capability': torch.backends.cpu.get_cpu_capability(), "
    "'threads': torch.get_num_threads()}))"
)


def torch_facts(timeout: float = 120) -> dict[str, Any] | None:
    """PyTorch's version and the ISA its ATen kernels dispatch to here; None without torch.

    Asked in a child process, so the report's own process never imports torch.
    """
    if importlib.util.find_spec("torch") is None:
        return None
    import json

    try:
        out = subprocess.run(
            [sys.executable, "-c", _TORCH_PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        )
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))
    except (subprocess.SubprocessError, ValueError, IndexError) as err:
        return {"error": f"could not ask torch: {type(err).__name__}"}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def collect(
    inputs: Iterable[Path], root: Path, *, torch: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Provenance as a JSON-ready dict; input paths are relative to ``root`` (the study)."""
    files = []
    for p in inputs:
        regular_file(p)  # never a FIFO, a device or a /proc file
        files.append(
            {
                "path": os.path.relpath(p, root).replace(os.sep, "/"),
                "bytes": p.stat().st_size,
                "sha256": hash_file(p),
            }
        )
    return {
        "versions": {
            "python": platform.python_version(),
            **{k: v for k in LIBRARIES if (v := _version(k)) is not None},
        },
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        # float32/float64 comparison sums: the compiled kernel's order or numpy's (their
        # last bits may differ; dmlib/kernels/stream.py)
        "comparison_kernels": kernel_name(),
        "torch": torch,
        "inputs": files,
    }
