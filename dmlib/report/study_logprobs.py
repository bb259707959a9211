"""The ``[logprobs]`` section of a study: per-step log-prob files of two sides (a sampler's
and a trainer's) for each run, and the lr=0 run that is their control::

    [logprobs]
    control = "lr0"                        # the run whose weights never move (lr=0)
    mask = "lp/response_mask.safetensors"  # optional: applied to every file
    [logprobs.runs]                        # label = { a = FILES, b = FILES }
    policy = { a = "lp/policy/sampler_*.safetensors", b = "lp/policy/trainer_*.safetensors" }
    lr0 = { a = "lp/lr0/sampler_*.jsonl", b = ["lp/lr0/trainer_0.pt", "lp/lr0/trainer_5.pt"] }

``a`` and ``b`` are each a glob or a list of files (relative to the study's root); each
file's step is the last number of its name, and every step needs a file on both sides.
The files are read as ``dmlib logprobs`` reads them (``docs/logprobs.md``).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmlib.errors import DmlibError

__all__ = ["LogprobRuns", "logprob_runs", "logprobs_toml"]

_KEYS = {"control", "mask", "runs"}
_NUMBER = re.compile(r"(\d+)")


@dataclass
class LogprobRuns:
    """Per run: ``{step: (a_file, b_file)}``; the control run's label; a mask file."""

    runs: dict[str, dict[int, tuple[Path, Path]]]
    control: str | None = None
    mask: Path | None = None

    def files(self) -> list[Path]:
        """Every file the section reads."""
        out = [p for steps in self.runs.values() for pair in steps.values() for p in pair]
        return out + ([self.mask] if self.mask is not None else [])


def _path(root: Path, text: Any, key: str, where: Path) -> Path:
    if not isinstance(text, str) or not text:
        raise DmlibError(f"{key} must be a path (a string), got {text!r}", path=where)
    p = Path(os.path.expanduser(text))
    return Path(os.path.normpath(p if p.is_absolute() else root / p))


def step_files(root: Path, spec: Any, key: str, where: Path) -> dict[int, Path]:
    """A glob or a list of files -> ``{step: file}`` in step order, the step the last number
    of the name (``key`` names the entry in messages; also read by ``[adapters]``)."""
    if isinstance(spec, str):
        found = sorted(Path(p) for p in glob.glob(os.fspath(_path(root, spec, key, where))))
        if not found:
            raise DmlibError(
                f"{key} {spec!r} matches no file (paths are relative to the study)", path=where
            )
    elif isinstance(spec, list):
        found = [_path(root, s, key, where) for s in spec]
    else:
        raise DmlibError(f"{key} must be a glob or a list of files", path=where)
    steps: dict[int, Path] = {}
    for f in found:
        if not f.is_file():
            raise DmlibError(f"{key}: {f.name!r} is not a file", path=where)
        numbers = _NUMBER.findall(f.name)
        if not numbers:
            raise DmlibError(
                f"{key}: {f.name!r} has no number in its name to be its step", path=where
            )
        step = int(numbers[-1])
        if step in steps:
            raise DmlibError(
                f"{key}: {steps[step].name!r} and {f.name!r} are both step {step}", path=where
            )
        steps[step] = f
    return dict(sorted(steps.items()))


def logprob_runs(spec: Mapping[str, Any], root: Path, where: Path) -> LogprobRuns | None:
    """The ``[logprobs]`` table resolved (None when the study has none)."""
    if not spec:
        return None
    bad = sorted(set(spec) - _KEYS)
    if bad:
        raise DmlibError(
            f"[logprobs]: unknown key {bad[0]!r}; valid: {', '.join(sorted(_KEYS))}", path=where
        )
    table = spec.get("runs", {})
    if not isinstance(table, dict) or not table:
        raise DmlibError(
            "[logprobs.runs] must name at least one run: label = { a = ..., b = ... }", path=where
        )
    runs: dict[str, dict[int, tuple[Path, Path]]] = {}
    for label, sides in table.items():
        key = f"logprobs.runs.{label}"
        if not isinstance(sides, dict) or set(sides) != {"a", "b"}:
            raise DmlibError(f"{key} must be a table {{ a = FILES, b = FILES }}", path=where)
        a = step_files(root, sides["a"], f"{key}.a", where)
        b = step_files(root, sides["b"], f"{key}.b", where)
        lonely = sorted(set(a) ^ set(b))
        if lonely:
            raise DmlibError(f"{key}: step {lonely[0]} has a file on one side only", path=where)
        runs[str(label)] = {s: (a[s], b[s]) for s in sorted(a)}
    control = spec.get("control")
    if control is not None and control not in runs:
        raise DmlibError(
            f"logprobs.control {control!r} is not one of [logprobs.runs] ({', '.join(runs)})",
            path=where,
        )
    mask = spec.get("mask")
    mask_path = None if mask is None else _path(root, mask, "logprobs.mask", where)
    if mask_path is not None and not mask_path.is_file():
        raise DmlibError(f"logprobs.mask {mask!r} not found", path=where)
    return LogprobRuns(runs, control, mask_path)


def logprobs_toml(lp: LogprobRuns, rel: Any, value: Any, key: Any) -> list[str]:
    """The section as study-file lines, every file listed (``rel``, ``value`` and ``key``:
    the study writer's path, value and key formatting)."""
    lines = ["", "[logprobs]"]
    if lp.control is not None:
        lines.append(f"control = {value(lp.control)}")
    if lp.mask is not None:
        lines.append(f"mask = {value(rel(lp.mask))}")
    lines += ["", "[logprobs.runs]"]
    for label, steps in lp.runs.items():
        a = ", ".join(value(rel(pa)) for pa, _ in steps.values())
        b = ", ".join(value(rel(pb)) for _, pb in steps.values())
        lines.append(f"{key(label)} = {{ a = [{a}], b = [{b}] }}")  # an inline table: one line
    return lines
