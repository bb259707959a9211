"""The ``[adapters]`` section of a study: LoRA runs' per-step gradients, and the gradient
group whose global relative L2 the adapters notebook draws::

    [adapters]
    group = "adapter"        # the group of :func:`dmlib.group_l2`: all, adapter (default), a pattern
    control = "seed8"        # optional: the run expected to differ (default: the study's control)
    [adapters.gradients]     # label = a glob or a list of per-step gradient files
    base = "grads/base/step_*.safetensors"
    repeat = "grads/repeat/step_*.safetensors"
    seed8 = "grads/seed8/step_*.safetensors"

Each gradient file's step is the last number of its name. The adapters themselves are
the study's ``[runs]`` whose checkpoints are LoRA adapters (a PEFT ``save_pretrained``
folder per step, or ``adapter_model.safetensors`` beside its ``adapter_config.json``):
no key is needed for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmlib.errors import DmlibError
from dmlib.report.study_logprobs import step_files

__all__ = ["AdapterRuns", "adapter_runs", "adapters_toml"]

_KEYS = {"group", "control", "gradients"}


@dataclass
class AdapterRuns:
    """Per run: ``{step: gradient file}``; the gradient group; the control's label."""

    gradients: dict[str, dict[int, Path]] = field(default_factory=dict)
    group: str = "adapter"
    control: str | None = None

    def files(self) -> list[Path]:
        """Every file the section reads."""
        return [p for steps in self.gradients.values() for p in steps.values()]


def adapter_runs(spec: Mapping[str, Any], root: Path, where: Path) -> AdapterRuns | None:
    """The ``[adapters]`` table resolved (None when the study has none)."""
    if not spec:
        return None
    bad = sorted(set(spec) - _KEYS)
    if bad:
        raise DmlibError(f"[adapters]: unknown key {bad[0]!r}; valid: {', '.join(sorted(_KEYS))}",
                         path=where)  # fmt: skip
    table = spec.get("gradients", {})
    if not isinstance(table, dict):
        raise DmlibError("[adapters.gradients] must be a table: label = FILES", path=where)
    grads = {
        str(k): step_files(root, v, f"adapters.gradients.{k}", where) for k, v in table.items()
    }
    group = spec.get("group", "adapter")
    if not isinstance(group, str) or not group:
        raise DmlibError(f"adapters.group must be a string, got {group!r}", path=where)
    control = spec.get("control")
    if control is not None and control not in grads:
        raise DmlibError(f"adapters.control {control!r} is not one of [adapters.gradients] "
                         f"({', '.join(grads) or 'none'})", path=where)  # fmt: skip
    return AdapterRuns(grads, group, control)


def adapters_toml(ad: AdapterRuns, rel: Any, value: Any, key: Any) -> list[str]:
    """The section as study-file lines, every file listed (``rel``, ``value`` and ``key``:
    the study writer's path, value and key formatting)."""
    lines = ["", "[adapters]", f"group = {value(ad.group)}"]
    if ad.control is not None:
        lines.append(f"control = {value(ad.control)}")
    lines += ["", "[adapters.gradients]"]
    for label, steps in ad.gradients.items():
        lines.append(f"{key(label)} = {value([rel(p) for p in steps.values()])}")
    return lines
