"""Writing study files: the resolved study of a report, and ``dmlib study init``.

The TOML written here uses only what the study format needs (strings, lists of strings,
tables), so a small writer of our own does, and the result is read back by
:func:`dmlib.report.study.load_study` in the tests.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dmlib.errors import DmlibError
from dmlib.report.study import Study

__all__ = ["init_from_folder", "init_from_runs", "resolved_toml"]

_BARE = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(k: str) -> str:
    return k if _BARE.match(k) else json.dumps(k)


def _string(v: str) -> str:
    """A TOML basic string: JSON's escapes (valid TOML) plus DEL, which TOML also forbids
    raw (a title holding U+007F made an invalid study.toml)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise DmlibError(
            f"cannot write {v!r} into a study file: it is not valid Unicode (a lone surrogate)"
        ) from None
    return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        if len(v) > 3:
            return "[\n" + "".join(f"    {_value(x)},\n" for x in v) + "]"
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise DmlibError(f"cannot write {type(v).__name__} into a study file")


def _rel(path: Path, base: Path) -> str:
    return os.path.relpath(path, base).replace(os.sep, "/")


def resolved_toml(study: Study, base: Path) -> str:
    """The study with every path resolved to its exact files, for a study file in ``base``.

    ``root`` (the original study's folder) is written relative to ``base``, and every
    other path relative to ``root``, as the original study wrote them.
    """
    root = study.root
    lines = [
        "# The study this report was made from, every run resolved to the exact files read.",
        "# Paths are relative to `root`, itself relative to this file.",
        "# Re-run: dmlib report study.toml --out DIR",
        f"title = {_value(study.title)}",
        f"root = {_value(_rel(root, base))}",
    ]
    if study.made_on:
        lines.append(f"made_on = {_value(study.made_on)}")
    base = root
    if study.control:
        lines.append(f"control = {_value(study.control)}")
    if study.reference:
        lines.append(f"reference = {_value(study.reference)}")
    lines += ["", "[runs]"]
    for label, run in study.runs.items():
        files = [_rel(p, base) for p in run.checkpoints.values()]
        where = _value(files if len(files) > 1 else files[0])
        if label in study.mappings:  # a converted run: its mapping file, relative to root
            where = f"{{ path = {where}, mapping = {_value(_rel(study.mappings[label], base))} }}"
        lines.append(f"{_key(label)} = {where}")
    if study.repeats:
        lines += ["", "[repeats]", *(f"{_key(k)} = {_value(v)}" for k, v in study.repeats.items())]
    for g in study.factor_groups:
        lines += ["", "[[factor_groups]]", *(f"{_key(k)} = {_value(v)}" for k, v in g.items())]
    if study.names:
        lines += ["", "[names]", *(f"{_key(k)} = {_value(v)}" for k, v in study.names.items())]
    if study.groups:
        lines += ["", "[groups]", *(f"{_key(k)} = {_value(v)}" for k, v in study.groups.items())]
    if study.anatomy:
        lines += ["", "[anatomy]", f"files = {_value([_rel(p, base) for p in study.anatomy])}"]
    c = study.captures
    if c is not None:
        lines += ["", "[captures]"]
        if c.request is not None:
            lines.append(f"request = {_value(c.request)}")
        if c.reference is not None:
            lines.append(f"reference = {_value(c.reference)}")
        if c.negative is not None:
            lines.append(f"negative = {_value(_rel(c.negative, base))}")
        lines += ["", "[captures.folders]"]
        lines += [f"{_key(k)} = {_value(_rel(v, base))}" for k, v in c.folders.items()]
        if c.repeats:
            lines += ["", "[captures.repeats]"]
            lines += [f"{_key(k)} = {_value(_rel(v, base))}" for k, v in c.repeats.items()]
        if c.ops:
            lines += ["", "[captures.ops]"]
            lines += [f"{_key(k)} = {_value(_rel(v, base))}" for k, v in c.ops.items()]
            if c.op_findings is not None:
                lines.append(f"findings = {_value(_rel(c.op_findings, base))}")
    if study.logprobs is not None:
        from dmlib.report.study_logprobs import logprobs_toml

        lines += logprobs_toml(study.logprobs, lambda p: _rel(p, base), _value, _key)
    if study.adapters is not None:
        from dmlib.report.study_adapters import adapters_toml

        lines += adapters_toml(study.adapters, lambda p: _rel(p, base), _value, _key)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# dmlib study init


def init_from_runs(
    runs: Mapping[str, str],
    base: Path,
    *,
    control: str | None = None,
    captures: Mapping[str, str] | None = None,
    request: str | None = None,
    title: str | None = None,
) -> str:
    """A study file from ``label=path`` pairs given on the command line (paths made relative)."""

    def rel(p: str) -> str:
        return _rel(Path(p).resolve(), base.resolve())

    lines = [
        "# study.toml: what `dmlib report` analyses; paths are relative to this file.",
        f"title = {_value(title or 'A reproducibility study')}",
        _made_on_guess(),
    ]
    guessed = control is None and _guess_control(list(runs))
    if control:
        lines.append(f"control = {_value(control)}")
    elif guessed:
        lines.append(
            f"# control = {_value(guessed)}  # guessed from its name: uncomment if it is another seed"
        )
    else:
        lines.append('# control = "LABEL"  # the run expected to differ (a different seed), if any')
    lines += ["", "[runs]", *(f"{_key(k)} = {_value(rel(v))}" for k, v in runs.items())]
    lines += _repeat_guesses(list(runs))
    if captures:
        lines += ["", "[captures]"]
        lines.append(
            f"request = {_value(request)}"
            if request
            else '# request = "ID"  # default: every request in both captures'
        )
        lines += [
            "",
            "[captures.folders]",
            *(f"{_key(k)} = {_value(rel(v))}" for k, v in captures.items()),
        ]
    return "\n".join(lines) + "\n"


def _orbax_steps(folder: Path) -> list[str] | None:
    from dmlib.io.orbax import checkpoints_in

    return checkpoints_in(folder)


def init_from_folder(folder: Path, *, title: str | None = None) -> str:
    """A study file from what a folder holds, every guess written as a comment to check.

    Checkpoint files directly in ``folder`` are single-checkpoint runs; a subfolder with
    checkpoint files is a step ladder; a Hugging Face Trainer output folder (holding
    ``checkpoint-N/``) is a step ladder, and a ``checkpoint-N/`` or Accelerate state folder
    one checkpoint (the folder itself, when it is one of those, is the one run); a
    subfolder holding ``manifest.json`` of a dmlib capture is a capture.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DmlibError("not a folder", path=folder)
    runs, notes, captures = _scan_folder(folder)
    if not runs and not captures:
        raise DmlibError("no checkpoint files or capture folders found", path=folder)
    lines = [
        "# study.toml written by `dmlib study init`: check every line marked 'guessed'.",
        "# Paths are relative to this file. Format: python -c 'import dmlib.report.study as s; help(s)'",
        f"title = {_value(title or folder.resolve().name)}",
        _made_on_guess(),
    ]
    guessed = _guess_control(list(runs))
    if guessed:
        lines.append(
            f"control = {_value(guessed)}  # guessed from its name: the run expected to differ"
        )
    else:
        lines.append('# control = "LABEL"  # the run expected to differ (a different seed), if any')
    if runs:
        lines += ["", "[runs]"]
        for k, v in runs.items():
            lines.append(f"{_key(k)} = {_value(v)}" + (f"  # {notes[v]}" if v in notes else ""))
        lines += _repeat_guesses(list(runs))
    if captures:
        lines += _capture_lines(captures)
    return "\n".join(lines) + "\n"


def _is_checkpoint(p: Path) -> bool:
    """Whether ``p`` is a (visible) file in a checkpoint format dmlib detects."""
    from dmlib.io import detect_format
    from dmlib.io.hf_pretrained import can_open_adapter, can_open_model

    if p.is_dir() and not p.name.startswith("."):  # a save_pretrained folder is one checkpoint
        return can_open_model(str(p)) or can_open_adapter(str(p))
    if not p.is_file() or p.name.startswith("."):
        return False
    try:
        detect_format(p)
    except DmlibError:
        return False
    return True


def _scan_folder(folder: Path) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """``(runs, notes, captures)``: run label -> path, path -> what it was taken for, and
    capture label -> folder, from what ``folder`` holds."""
    runs: dict[str, str] = {}
    notes: dict[str, str] = {}
    captures: dict[str, str] = {}
    own = _training_note(folder)
    if own is not None:  # the folder is itself one training run (or one checkpoint)
        runs[_label(folder.resolve().name, runs)] = "./"
        notes["./"] = own
    for p in [] if own is not None else sorted(folder.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_dir() and (p / "manifest.json").is_file():
            captures[p.name] = p.name
        elif p.is_dir() and _orbax_steps(p) is not None:  # Orbax: a manager or step folder
            n = len(_orbax_steps(p) or [])
            runs[_label(p.name, runs)] = p.name + "/"
            notes[p.name + "/"] = f"Orbax, {n} step folder{'s' if n > 1 else ''}"
        elif p.is_dir() and _training_note(p) is not None:
            runs[_label(p.name, runs)] = p.name + "/"
            notes[p.name + "/"] = _training_note(p) or ""
        elif p.is_dir():
            n = sum(_is_checkpoint(q) for q in p.iterdir())
            if n:
                runs[_label(p.name, runs)] = p.name + "/"
                notes[p.name + "/"] = (
                    f"{n} checkpoint{'s' if n > 1 else ''}: a step ladder"
                    if n > 1
                    else "1 checkpoint"
                )
        elif _is_checkpoint(p):
            runs[_label(p.stem, runs)] = p.name
    return runs, notes, captures


def _capture_lines(captures: dict[str, str]) -> list[str]:
    """The ``[captures]`` section, with the reference and repeats guessed from the names."""
    lines = [
        "",
        "[captures]",
        '# request = "ID"  # default: every request present in both captures',
    ]
    ref = next((k for k in captures if "alone" in k.lower()), next(iter(captures)))
    lines.append(f"reference = {_value(ref)}  # guessed: the layout the others are compared with")
    lines += ["", "[captures.folders]"]
    repeats = {k for k in captures if _repeat_of(k, list(captures))}
    lines += [f"{_key(k)} = {_value(v)}" for k, v in captures.items() if k not in repeats]
    if repeats:
        lines += ["", "[captures.repeats]  # guessed from the names"]
        lines += [
            f"{_key(_repeat_of(k, list(captures)) or k)} = {_value(captures[k])}"
            for k in sorted(repeats)
        ]
    return lines


def _training_note(p: Path) -> str | None:
    """What a Hugging Face training folder was recognised as (None for any other folder)."""
    from dmlib.io import hf_trainer

    found = hf_trainer.checkpoints_of(p)
    if found:
        steps = ", ".join(map(str, found))
        return (
            f"a Trainer run: {len(found)} checkpoint-N/ folders, a step ladder (step: "
            f"trainer_state.json's global_step, else N; folders {steps})"
        )
    if hf_trainer.can_open(str(p)):
        what = (
            "a Trainer checkpoint"
            if hf_trainer.kind(str(p)) == "trainer"
            else "an Accelerate state"
        )
        return f"{what} folder: one checkpoint (its files are components, not steps)"
    from dmlib.io.hf_pretrained import can_open_adapter, can_open_model

    if can_open_model(str(p)) or can_open_adapter(str(p)):
        what = "a PEFT adapter" if can_open_adapter(str(p)) else "a transformers model"
        return f"{what} folder (save_pretrained): one checkpoint"
    return None


def _label(name: str, taken: Mapping[str, str]) -> str:
    label = re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "run"
    out, i = label, 2
    while out in taken:
        out, i = f"{label}_{i}", i + 1
    return out


def _guess_control(labels: Sequence[str]) -> str | None:
    hits = [k for k in labels if re.search(r"control|other[_-]?seed", k, re.I)]
    return hits[0] if len(hits) == 1 else None


def _repeat_of(label: str, labels: Sequence[str]) -> str | None:
    m = re.match(r"^(.*?)[_-]?(repeat|rerun|again)\d*$", label, re.I)
    if m and m.group(1) in labels:
        return m.group(1)
    return None


def _repeat_guesses(labels: Sequence[str]) -> list[str]:
    pairs = [(k, _repeat_of(k, labels)) for k in labels]
    pairs = [(k, v) for k, v in pairs if v]
    if not pairs:
        return []
    return ["", "[repeats]  # guessed from the names: run = the run it repeats"] + [
        f"{_key(k)} = {_value(v)}" for k, v in pairs
    ]


def _made_on_guess() -> str:
    """A commented ``made_on`` line naming this machine: right only if the runs were made here."""
    from dmlib.machine import machine_line

    return (
        f"# made_on = {_value(machine_line())}"
        "  # this machine: keep it only if the runs were made here"
    )
