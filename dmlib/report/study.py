"""A study: what a report analyses, read from a small TOML file (``study.toml``).

Every path in the file is relative to the file itself, so a study folder can be moved,
mailed or committed. The format (every key optional, but a study names runs or captures)::

    title = "Threads 1 vs 2, a repeat and a different-seed control"
    made_on = "Intel Xeon 8480+ (AVX-512, AMX), torch 2.13.0 CPU, 1 thread"  # the runs' machine
    root = "."               # the folder the paths below are relative to (default: this file's)
    control = "seed8"        # a run expected to differ (another seed): the yardstick
    reference = "base"       # the run step ladders are measured against (default: first run)

    [runs]                   # label = a checkpoint file, a folder of them, or a glob
    base = "runs/base/"      #   a folder or a glob is a step ladder: one checkpoint per step,
    threads2 = "runs/t2/*.safetensors"  # the step recorded in the file, else the
    seed8 = "runs/seed8/step20.pt"      # last number of its file name
    hf = "runs/trainer_out"  # a Trainer output folder: its checkpoint-N/ folders are the
                             #   steps (global_step of trainer_state.json, else N)
    jax = { path = "runs/flax/", mapping = "maps/flax.toml" }  # a converted run, seen
                             #   through a mapping onto the reference's names

    [repeats]                # run = the run it repeats (same configuration, new process)
    repeat = "base"

    [[factor_groups]]        # factorised layers, judged on the weight they compute
    kind = "svd"             # W = u diag(s) v^T  ("lowrank": W = a b, keys a and b)
    u = "{prefix}.u"
    s = "{prefix}.s"
    v = "{prefix}.v"

    [groups]                 # parameter groups for growth rates: name = regular expression
    bias = "\\.bias$"

    [names]                  # a run's tensor names, mapped before any comparison:
    seed8 = "model.="        #   label = "OLD=NEW" (prefix OLD replaced by NEW), or a list

    [anatomy]                # extra files whose byte layout the anatomy notebook maps
    files = ["records.bpk"]

    [captures]               # forward-pass captures (dmlib.capture) of one request
    request = "probe"
    reference = "alone"      # default: the first folder
    negative = "different"   # optional: a capture of another input, must differ
    [captures.folders]
    alone = "cap/alone"
    packed = "cap/packed"
    [captures.repeats]       # folder label = a second capture of that layout
    alone = "cap/alone_repeat"
    [captures.ops]           # optional: op-level captures (capture(..., ops=True)) of two
    alone = "cap/ops/alone"  #   layouts, reference first, the culprit op's tensors dumped
    packed = "cap/ops/packed"
    findings = "cap/ops/op_findings.json"  # optional: what was computed with the live model

    [logprobs]               # per-step log-probs of the same tokens from two sides (a: the
    control = "lr0"          #   sampler, b: the trainer), for drift over training; the
    [logprobs.runs]          #   control is an lr=0 run (report/study_logprobs.py)
    policy = { a = "lp/policy/sampler_*.jsonl", b = "lp/policy/trainer_*.safetensors" }
    lr0 = { a = "lp/lr0/sampler_*.jsonl", b = "lp/lr0/trainer_*.safetensors" }

    [adapters]               # LoRA runs: the adapters are the [runs] whose checkpoints are
    group = "adapter"        #   PEFT adapters; per-step gradients and the group whose global
    [adapters.gradients]     #   relative L2 is drawn (report/study_adapters.py)
    base = "grads/base/step_*.safetensors"

``made_on`` names the machine (CPU, instruction set, library build, threads) that made the
runs: floating-point results, and so every finding of the report, depend on it, and the
report quotes it beside its findings (or says that the study does not record it).

``[names]`` maps one run's names onto the others' (a checkpoint saved under a wrapper's
``model.``, ``module.`` or ``_orig_mod.``): the rule of :class:`dmlib.names.Rename`,
applied to that run's checkpoints by :meth:`Study.sources`.

A run written as a table (``{ path = ..., mapping = "MAP.toml" }``) was converted to other
names and layouts: :meth:`Study.sources` shows its checkpoints through the mapping file
(``docs/mapping.md``) onto the names of the reference run (``reference``, else the first
run without a mapping). The mapping path is relative to ``root`` and must stay inside it
(no ``..``, no symlink out); the file is read and checked when the study is loaded.
"""

from __future__ import annotations

import glob
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmlib import _limits
from dmlib.errors import DmlibError
from dmlib.safepaths import read_regular

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["Capture", "Run", "Study", "StudyCaptures", "load_study", "resolve_runs"]

STUDY_FILE = "study.toml"
_TOP_KEYS = {
    "root",
    "title",
    "made_on",
    "control",
    "reference",
    "runs",
    "repeats",
    "factor_groups",
    "groups",
    "names",
    "anatomy",
    "captures",
    "logprobs",
    "adapters",
}
_GROUP_KEYS = {"svd": ("u", "s", "v"), "lowrank": ("a", "b")}
_GLOB = re.compile(r"[*?\[]")
_NUMBER = re.compile(r"(\d+)")


@dataclass
class Run:
    """One run: its checkpoints by step (``None`` when a lone file records no step)."""

    label: str
    spec: str
    checkpoints: dict[int | None, Path]
    step_source: dict[int | None, str] = field(default_factory=dict)

    @property
    def steps(self) -> list[int]:
        """The recorded steps in increasing order (a checkpoint without a step left out)."""
        return sorted(s for s in self.checkpoints if s is not None)

    def last(self) -> tuple[int | None, Path]:
        """The checkpoint at the highest step (the only one of a single-file run)."""
        if self.steps:
            return self.steps[-1], self.checkpoints[self.steps[-1]]
        return next(iter(self.checkpoints.items()))


@dataclass
class StudyCaptures:
    """A study.toml's [captures] section: folders by label, the request, repeats and negative control.

    Not a capture folder read back (that is :class:`dmlib.localize.capture.reader.Capture`).
    """

    folders: dict[str, Path]
    request: str | None = None
    reference: str | None = None
    repeats: dict[str, Path] = field(default_factory=dict)
    negative: Path | None = None
    ops: dict[str, Path] = field(default_factory=dict)
    op_findings: Path | None = None


# The name this class had before: kept so that ``from dmlib.report.study import Capture`` works.
Capture = StudyCaptures


@dataclass
class Study:
    """A resolved study: every path absolute, every run's checkpoints found and stepped."""

    path: Path | None
    root: Path
    title: str
    runs: dict[str, Run]
    control: str | None = None
    reference: str | None = None
    repeats: dict[str, str] = field(default_factory=dict)
    factor_groups: list[dict[str, Any]] = field(default_factory=list)
    groups: dict[str, str] = field(default_factory=dict)
    names: dict[str, list[str]] = field(default_factory=dict)
    anatomy: list[Path] = field(default_factory=list)
    captures: StudyCaptures | None = None
    made_on: str | None = None
    logprobs: Any = None  # [logprobs]: a report.study_logprobs.LogprobRuns
    adapters: Any = None  # [adapters]: a report.study_adapters.AdapterRuns
    mappings: dict[str, Path] = field(default_factory=dict)

    # -- what notebooks ask -------------------------------------------------

    def rel(self, path: str | os.PathLike[str]) -> str:
        """``path`` relative to the study's folder, for display (never an absolute path)."""
        return os.path.relpath(path, self.root).replace(os.sep, "/")

    def at_last_step(self, labels: list[str] | None = None) -> tuple[dict[str, Path], str]:
        """One checkpoint per run at the last step they share, and the phrase quoting it.

        Runs without a common step contribute their last checkpoint each; the phrase
        then lists every run's step ("steps 20 (a), 30 (b)") or says it is not recorded.
        """
        labels = list(self.runs) if labels is None else labels
        sub = [self.runs[k] for k in labels]
        shared = sorted(set.intersection(*(set(r.steps) for r in sub))) if sub else []
        if shared:
            return {r.label: r.checkpoints[shared[-1]] for r in sub}, f"at step {shared[-1]}"
        picked = {r.label: r.last() for r in sub}
        steps = {k: s for k, (s, _) in picked.items()}
        files = {k: p for k, (_, p) in picked.items()}
        if all(s is None for s in steps.values()):
            return files, "with no step recorded"
        if len({s for s in steps.values()}) == 1:
            return files, f"at step {next(iter(steps.values()))}"
        return files, "at steps " + ", ".join(
            f"{'?' if s is None else s} ({k})" for k, s in steps.items()
        )

    def ladders(self) -> dict[str, dict[int, Path]]:
        """Runs with two or more stepped checkpoints: ``{label: {step: path}}``."""
        return {
            k: {s: r.checkpoints[s] for s in r.steps}
            for k, r in self.runs.items()
            if len(r.steps) > 1
        }

    def sources(self, files: Mapping[str, Path]) -> dict[str, Any]:
        """``{label: path}`` -> what the statistics take: the path, or for a run with a
        ``[names]`` mapping its checkpoint opened with the names mapped, or for a run with
        a ``mapping`` its checkpoint seen through it onto the reference's names."""
        out = {k: self._source(k, p) for k, p in files.items()}
        mapped = [k for k in out if k in self.mappings]
        if mapped:
            ref = self._map_reference(list(out))
            names = self._names_of(out[ref])
            for k in mapped:
                out[k] = self._mapped(k, out[k], names)
        return out

    def ladder_sources(self, ladder: Mapping[str, Mapping[int, Path]]) -> dict[str, dict[int, Any]]:
        """:meth:`sources` for a ladder ``{label: {step: path}}`` (a mapped run onto the
        reference's checkpoint at the same step, else its first)."""
        out = {k: {s: self._source(k, p) for s, p in steps.items()} for k, steps in ladder.items()}
        if not any(k in self.mappings for k in out):
            return out
        ref = self._map_reference(list(out))
        for k in [k for k in out if k in self.mappings]:
            for s, src in out[k].items():
                names = self._names_of(out[ref].get(s, next(iter(out[ref].values()))))
                out[k][s] = self._mapped(k, src, names)
        return out

    def _map_reference(self, labels: list[str]) -> str:
        """The run whose names a mapped run is mapped onto."""
        if self.reference in labels and self.reference not in self.mappings:
            return self.reference
        for k in labels:
            if k not in self.mappings:
                return k
        raise DmlibError(
            f"every run of {labels} has a mapping: one must keep its names (the reference)",
            path=self.path,
        )

    @staticmethod
    def _names_of(source: Any) -> list[str]:
        from dmlib.sources import opened

        with opened(source) as ts:
            return [t.name for t in ts.disk_order()]

    def _mapped(self, label: str, source: Any, names: list[str]) -> Any:
        from dmlib.mapping.view import mapped_set
        from dmlib.sources import as_tensor_set

        try:
            return mapped_set(as_tensor_set(source), self.mappings[label], names)
        except DmlibError as err:
            raise DmlibError(f"run {label!r}: {err.message}", path=err.path or self.path) from None

    def _source(self, label: str, path: Path) -> Any:
        if label not in self.names:
            return path
        from dmlib.io import open_tensors
        from dmlib.names import Rename, apply_renames

        renames = [Rename.parse(f"a:{m}") for m in self.names[label]]
        return apply_renames(open_tensors(path), renames, "a")

    def factor_group_objects(self) -> list[Any]:
        """:class:`dmlib.FactorGroup` objects for ``[[factor_groups]]``."""
        from dmlib.forensics.factors import FactorGroup

        out = []
        for g in self.factor_groups:
            keys = _GROUP_KEYS[g["kind"]]
            maker = FactorGroup.svd if g["kind"] == "svd" else FactorGroup.lowrank
            out.append(maker(*(g[k] for k in keys)))
        return out

    def group_of(self, names: list[str]) -> dict[str, str | None]:
        """Parameter name -> its ``[groups]`` group (first match), else its last name part."""
        out: dict[str, str | None] = {}
        from dmlib.names import user_regex  # a shared study's regex cannot hang

        compiled = [(g, user_regex(rx, f"groups.{g}")) for g, rx in self.groups.items()]
        for n in names:
            if compiled:
                out[n] = next((g for g, search in compiled if search(n)), None)
            else:
                out[n] = n.rsplit(".", 1)[-1]
        return out

    def input_files(self) -> list[Path]:
        """Every file the study reads (checkpoints, anatomy files, capture folders' files)."""
        files: list[Path] = []
        for r in self.runs.values():
            for ck in r.checkpoints.values():  # a checkpoint folder (Orbax, Trainer): its files
                files += sorted(p for p in ck.rglob("*") if p.is_file()) if ck.is_dir() else [ck]
        files += self.mappings.values()
        files += self.anatomy
        if self.captures is not None:
            c = self.captures
            folders = [*c.folders.values(), *c.repeats.values(), *c.ops.values()]
            if c.negative is not None:
                folders.append(c.negative)
            for folder in folders:  # its manifest and the dumps it names, nothing else
                files += _capture_files(folder)
            if c.op_findings is not None:
                files.append(c.op_findings)
        if self.logprobs is not None:
            files += self.logprobs.files()
        if self.adapters is not None:
            files += self.adapters.files()
        return list(dict.fromkeys(files))


# ---------------------------------------------------------------------------
# reading


def load_study(path: str | os.PathLike[str]) -> Study:
    """Read and resolve ``study.toml`` (a file, or a folder holding one).

    Raises
    ------
    DmlibError
        Naming the study file and what is wrong: a TOML error, an unknown key, a run whose
        path matches nothing, a control that is not a run, a missing capture folder...
    """
    path = Path(path)
    if path.is_dir():
        path = path / STUDY_FILE
    try:
        # one bounded read of a regular file: a FIFO or device named study.toml is refused,
        # never waited on (the path's own symlinks are the user's: resolved first)
        raw = read_regular(os.path.realpath(path), what="study file", where=path,
                           limit=_limits.MAX_TEXT_BYTES, kind="a study file")  # fmt: skip
        data = tomllib.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError) as err:
        raise DmlibError(f"cannot read the study file: {err}", path=path) from None
    except tomllib.TOMLDecodeError as err:
        raise DmlibError(f"not valid TOML: {err}", path=path) from None
    except RecursionError:  # tomllib recurses per nested array or inline table
        raise DmlibError(
            "arrays or inline tables nest too deeply to be a study file", path=path
        ) from None
    if _limits.nesting_depth(data) > _limits.MAX_NESTING:  # [a.a.a...] tables: no recursion
        raise DmlibError(
            f"tables or arrays nest more than {_limits.MAX_NESTING} deep, too deeply to be "
            "a study file",
            path=path,
        )
    return from_dict(data, root=Path(os.path.abspath(path)).parent, path=path)


def from_dict(data: Mapping[str, Any], *, root: Path, path: Path | None = None) -> Study:
    """Resolve a study given as a dict (the parsed TOML), paths relative to ``root``."""
    where = path if path is not None else root
    if "root" in data:
        root = _under(root, _str(data["root"], "root", where))
        if not root.is_dir():
            raise DmlibError(
                f"root {data['root']!r} is not a folder (it is relative to the study file)",
                path=where,
            )
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise DmlibError(
            f"unknown key {', '.join(map(repr, unknown))}; valid: {', '.join(sorted(_TOP_KEYS))}",
            path=where,
        )
    runs_spec = _table(data, "runs", where)
    if not runs_spec and not data.get("captures") and not data.get("logprobs"):
        raise DmlibError(
            "nothing to analyse: name runs in [runs] (label = path), captures in [captures] "
            "or log-prob files in [logprobs]",
            path=where,
        )
    runs_spec, mappings = _run_mappings(runs_spec, root, where)
    runs = resolve_runs(
        {
            k: [_str(x, f"runs.{k}", where) for x in v]
            if isinstance(v, list)
            else _str(v, f"runs.{k}", where)
            for k, v in runs_spec.items()
        },
        root,
        where,
    )
    control = _label(data.get("control"), "control", runs, where)
    reference = _label(data.get("reference"), "reference", runs, where)
    if reference is None:
        reference = next((k for k in runs if k != control), None)
    repeats: dict[str, str] = {}
    for k, v in _table(data, "repeats", where).items():
        repeats[_need(_label(k, "repeats", runs, where))] = _need(
            _label(v, f"repeats.{k}", runs, where)
        )
    names = _names(_table(data, "names", where), runs, where)
    anatomy_spec = _table(data, "anatomy", where)
    bad = sorted(set(anatomy_spec) - {"files"})
    if bad:
        raise DmlibError(f"[anatomy]: unknown key {bad[0]!r}; valid: files", path=where)
    anatomy = [
        _existing(root, _str(f, "anatomy.files", where), where, "anatomy file")
        for f in _list(anatomy_spec.get("files", []), "anatomy.files", where)
    ]
    return Study(
        path=Path(os.path.abspath(path)) if path is not None else None,
        root=root,
        title=_str(data.get("title") or root.name, "title", where),
        runs=runs,
        control=control,
        reference=reference,
        repeats=repeats,
        factor_groups=_factor_groups(data.get("factor_groups", []), where),
        groups=_groups(_table(data, "groups", where), where),
        names=names,
        anatomy=anatomy,
        captures=_captures(_table(data, "captures", where), root, where),
        made_on=_str(data["made_on"], "made_on", where) if data.get("made_on") else None,
        mappings=mappings,
        logprobs=_logprobs(_table(data, "logprobs", where), root, where),
        adapters=_adapters(_table(data, "adapters", where), root, where),
    )


def _adapters(spec: Mapping[str, Any], root: Path, where: Path) -> Any:
    from dmlib.report.study_adapters import adapter_runs  # it stands beside this module

    return adapter_runs(spec, root, where)


def _logprobs(spec: Mapping[str, Any], root: Path, where: Path) -> Any:
    from dmlib.report.study_logprobs import logprob_runs  # it stands beside this module

    return logprob_runs(spec, root, where)


def _run_mappings(
    spec: Mapping[str, Any], root: Path, where: Path
) -> tuple[dict[str, Any], dict[str, Path]]:
    """``[runs]`` with each table ``{ path, mapping }`` replaced by its path, and the mapping
    files (inside ``root``, read and checked now)."""
    from dmlib.mapping.spec import load_mapping
    from dmlib.safepaths import inside

    runs: dict[str, Any] = {}
    mappings: dict[str, Path] = {}
    for label, v in spec.items():
        if not isinstance(v, dict):
            runs[label] = v
            continue
        bad = sorted(set(v) - {"path", "mapping"})
        if bad or "path" not in v:
            raise DmlibError(
                f"runs.{label}: a run given as a table has the keys path and mapping"
                + (f", not {bad[0]!r}" if bad else " (path is missing)"),
                path=where,
            )
        runs[label] = v["path"]
        if "mapping" in v:
            m = inside(root, v["mapping"], what=f"runs.{label}.mapping", where=where)
            if not m.is_file():
                raise DmlibError(
                    f"runs.{label}.mapping {v['mapping']!r} not found (paths are relative to "
                    "the study's root)",
                    path=where,
                )
            load_mapping(m)  # a bad mapping file is refused now, naming that file
            mappings[label] = Path(os.path.normpath(m))
    return runs, mappings


def resolve_runs(spec: Mapping[str, str | list[str]], root: Path, where: Path) -> dict[str, Run]:
    """Run label -> :class:`Run`: a file, a folder of checkpoints, a glob, or a list of files."""
    runs = {}
    for label, text in spec.items():
        if not label or any(c in label for c in "/\\ ="):
            raise DmlibError(
                f"run label {label!r}: use a short name without / \\ = or spaces", path=where
            )
        if isinstance(text, list):
            if not text:
                raise DmlibError(
                    f"run {label!r}: the list of checkpoint files is empty", path=where
                )
            files = [_checkpoint(root, t, where, label) for t in text]
            runs[label] = _stepped(label, " ".join(text), files, where)
            continue
        target = _under(root, text)
        if _GLOB.search(text):
            files = sorted(Path(p) for p in glob.glob(str(target)) if Path(p).is_file())
            if not files:
                raise DmlibError(f"run {label!r}: the pattern {text!r} matches no file", path=where)
        elif target.is_dir() and _training_folder(target) is not None:
            files = _training_folder(target) or []
        elif target.is_dir():
            files = _checkpoints_in(target)
            if not files:
                raise DmlibError(f"run {label!r}: {empty_folder(target, text)}", path=where)
        elif target.is_file():
            files = [target]
        else:
            raise DmlibError(
                f"run {label!r}: {text!r} not found (paths are relative to the study file)",
                path=where,
            )
        runs[label] = _stepped(label, text, files, where)
    return runs


def _training_folder(folder: Path) -> list[Path] | None:
    """A Hugging Face training folder's checkpoints: a Trainer output folder's
    ``checkpoint-N/`` folders (a step ladder), or the folder itself when it is one
    checkpoint (``checkpoint-N/``, an Accelerate state); None for any other folder."""
    from dmlib.io import hf_trainer

    found = hf_trainer.checkpoints_of(folder)
    if found:
        return [Path(p) for p in found.values()]
    from dmlib.io import hf_pretrained  # a save_pretrained folder (model or adapter) is one

    one = hf_pretrained.can_open_model(str(folder)) or hf_pretrained.can_open_adapter(str(folder))
    return [folder] if hf_trainer.can_open(str(folder)) or one else None


def _checkpoints_in(folder: Path) -> list[Path]:
    from dmlib.io import detect_format
    from dmlib.io.orbax import checkpoints_in

    orbax = checkpoints_in(folder)  # an Orbax manager folder's steps, or one step folder
    if orbax is not None:
        return [Path(p) for p in orbax]
    out = []
    for p in sorted(folder.iterdir()):
        # a file, or a folder a reader takes whole (a checkpoint-N/ or another folder format)
        if not p.name.startswith(".") and (p.is_file() or p.is_dir()):
            try:
                detect_format(p)
            except (DmlibError, OSError):
                continue
            out.append(p)
    return out


def empty_folder(folder: Path, text: str) -> str:
    """Why a folder given as a run holds no checkpoint: what was looked for, what it holds."""
    entries = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    held = (
        f"it holds {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} none of them read "
        f"as a checkpoint (e.g. {', '.join(map(repr, entries[:3]))})"
        if entries
        else "it is empty"
    )
    return (
        f"no checkpoint in the folder {text!r}: looked for checkpoint-N/ folders (a Trainer "
        "output), Orbax step folders, and files or folders a dmlib reader opens (by their "
        f"first bytes, then their suffix: dmlib inspect says what one is); {held}"
    )


def _stepped(label: str, spec: str, files: list[Path], where: Path) -> Run:
    """Give each checkpoint its step: the one it records, else the last number in its name."""
    from dmlib.forensics.ladder import check_steps

    named = {}
    for f in files:
        nums = _NUMBER.findall(f.stem)
        # a lone file's name (seed7_p1.bpk) is no evidence of a step; a ladder's names are
        named[f] = int(nums[-1]) if nums and len(files) > 1 else None
    # check_steps reads each file's own record of its step; claim the file-name step (or
    # a placeholder) so that the recorded one can be read beside it
    checked = check_steps({label: dict(enumerate(files))})
    bad = checked[checked["status"].isin(["missing", "unreadable"])]
    if len(bad):
        raise DmlibError(f"run {label!r}: {bad['detail'].iloc[0]}", path=where)
    recorded = dict(zip(checked["step"], checked["recorded_step"], strict=True))
    checkpoints: dict[int | None, Path] = {}
    source: dict[int | None, str] = {}
    for i, f in enumerate(files):
        rec = recorded.get(i)
        step: int | None
        if rec is not None and not _isna(rec):
            step, how = int(rec), "recorded"
        elif named[f] is not None:
            step, how = named[f], "file name"
        elif _step_beside(f) is not None:
            step, how = _step_beside(f) or (None, "none")
        elif len(files) == 1:
            step, how = None, "none"
        else:
            raise DmlibError(
                f"run {label!r}: {f.name} records no step and its name holds no number; "
                "a ladder needs a step per checkpoint",
                path=where,
            )
        if step in checkpoints:
            raise DmlibError(
                f"run {label!r}: {checkpoints[step].name} and {f.name} are both step {step}",
                path=where,
            )
        checkpoints[step] = f
        source[step] = how
    order = sorted(checkpoints, key=lambda s: -1 if s is None else s)
    return Run(label, spec, {s: checkpoints[s] for s in order}, {s: source[s] for s in order})


def _step_beside(f: Path) -> tuple[int, str] | None:
    """The step of a file inside a Trainer ``checkpoint-N/`` folder: ``global_step`` of the
    ``trainer_state.json`` beside it, else N of the folder's name; None elsewhere."""
    import json

    from dmlib.io import hf_trainer

    if f.is_dir():
        return None
    state = f.parent / hf_trainer.TRAINER_STATE
    try:
        step = json.loads(state.read_text(encoding="utf-8")).get("global_step")
    except (OSError, ValueError, AttributeError):
        step = None
    if isinstance(step, int) and not isinstance(step, bool):
        return step, "trainer_state.json"
    m = hf_trainer.CHECKPOINT_DIR.match(f.parent.name)
    return (int(m.group(1)), "folder name") if m else None


def _isna(x: Any) -> bool:
    try:
        import pandas as pd

        return bool(pd.isna(x))
    except (TypeError, ValueError):
        return False


def _captures(spec: Mapping[str, Any], root: Path, where: Path) -> StudyCaptures | None:
    if not spec:
        return None
    valid = {"folders", "request", "reference", "repeats", "negative", "ops"}
    bad = sorted(set(spec) - valid)
    if bad:
        raise DmlibError(
            f"[captures]: unknown key {bad[0]!r}; valid: {', '.join(sorted(valid))}", path=where
        )
    folders = {
        k: _existing(
            root, _str(v, f"captures.folders.{k}", where), where, "capture folder", folder=True
        )
        for k, v in _table(spec, "folders", where).items()
    }
    if len(folders) < 2:
        raise DmlibError(
            "[captures.folders] needs at least two capture folders to compare", path=where
        )
    reference = spec.get("reference")
    if reference is not None and reference not in folders:
        raise DmlibError(
            f"captures.reference {reference!r} is not one of [captures.folders] ({', '.join(folders)})",
            path=where,
        )
    repeats = {}
    for k, v in _table(spec, "repeats", where).items():
        if k not in folders:
            raise DmlibError(
                f"captures.repeats.{k}: {k!r} is not one of [captures.folders]", path=where
            )
        repeats[k] = _existing(
            root, _str(v, f"captures.repeats.{k}", where), where, "capture folder", folder=True
        )
    negative = spec.get("negative")
    ops, op_findings = _op_captures(_table(spec, "ops", where), root, where)
    return StudyCaptures(
        folders=folders,
        request=None if spec.get("request") is None else str(spec["request"]),
        reference=reference or next(iter(folders)),
        repeats=repeats,
        negative=None
        if negative is None
        else _existing(
            root, _str(negative, "captures.negative", where), where, "capture folder", folder=True
        ),
        ops=ops,
        op_findings=op_findings,
    )


def _op_captures(
    spec: Mapping[str, Any], root: Path, where: Path
) -> tuple[dict[str, Path], Path | None]:
    """[captures.ops]: label = op-level capture folder (two, reference first), findings = file."""
    if not spec:
        return {}, None
    findings = spec.get("findings")
    ops = {
        k: _existing(
            root, _str(v, f"captures.ops.{k}", where), where, "capture folder", folder=True
        )
        for k, v in spec.items()
        if k != "findings"
    }
    if len(ops) != 2:
        raise DmlibError(
            f"[captures.ops] needs two op-level capture folders (reference first), found {len(ops)}",
            path=where,
        )
    if findings is not None:
        findings = _existing(
            root, _str(findings, "captures.ops.findings", where), where, "op findings file"
        )
    return ops, findings


def _factor_groups(spec: Any, where: Path) -> list[dict[str, Any]]:
    if isinstance(spec, dict):
        spec = [spec]
    out = []
    for i, g in enumerate(_list(spec, "factor_groups", where)):
        if not isinstance(g, dict) or g.get("kind") not in _GROUP_KEYS:
            raise DmlibError(
                f"factor_groups[{i}]: needs kind = 'svd' (keys u, s, v) or 'lowrank' (keys a, b)",
                path=where,
            )
        keys = _GROUP_KEYS[g["kind"]]
        missing = [k for k in keys if not isinstance(g.get(k), str)]
        extra = sorted(set(g) - {"kind", *keys})
        if missing or extra:
            raise DmlibError(
                f"factor_groups[{i}] ({g['kind']}): keys {', '.join(keys)} are name patterns "
                f"holding {{prefix}}; missing {missing or 'none'}, unknown {extra or 'none'}",
                path=where,
            )
        out.append({"kind": g["kind"], **{k: g[k] for k in keys}})
    if out:  # build them once so that a bad pattern is named now, not in a notebook
        from dmlib.forensics.factors import FactorGroup

        for g in out:
            try:
                FactorGroup(
                    g["kind"],
                    tuple(g[k] for k in _GROUP_KEYS[g["kind"]]),
                    (False,) * len(_GROUP_KEYS[g["kind"]]),
                )
            except DmlibError as err:
                raise DmlibError(f"factor_groups: {err}", path=where) from None
    return out


def _names(spec: Mapping[str, Any], runs: Mapping[str, Run], where: Path) -> dict[str, list[str]]:
    from dmlib.names import Rename

    out = {}
    for label, value in spec.items():
        _label(label, "names", runs, where)
        items = value if isinstance(value, list) else [value]
        for m in items:
            try:
                Rename.parse(f"a:{_str(m, f'names.{label}', where)}")
            except DmlibError:
                raise DmlibError(
                    f"names.{label}: {m!r} is not OLD=NEW (e.g. 'model.=' strips 'model.')",
                    path=where,
                ) from None
        out[label] = [str(m) for m in items]
    return out


def _groups(spec: Mapping[str, Any], where: Path) -> dict[str, str]:
    out = {}
    for k, v in spec.items():
        rx = _str(v, f"groups.{k}", where)
        try:
            re.compile(rx)
        except re.error as err:
            raise DmlibError(
                f"groups.{k}: {rx!r} is not a regular expression ({err})", path=where
            ) from None
        from dmlib.names import user_regex

        try:
            user_regex(rx, f"groups.{k}")
        except DmlibError as err:
            raise DmlibError(str(err), path=where) from None
        out[k] = rx
    return out


def _checkpoint(root: Path, text: str, where: Path, label: str) -> Path:
    """A checkpoint of a run's list: a file, a training checkpoint folder (``checkpoint-N/``)
    or an Orbax step folder."""
    p = _under(root, text)
    if p.is_dir() and _training_folder(p) == [p]:
        return p
    return _existing(root, text, where, f"run {label!r}: checkpoint", checkpoint=True)


def _existing(
    root: Path, text: str, where: Path, what: str, *, folder: bool = False, checkpoint: bool = False
) -> Path:
    p = _under(root, text)
    if checkpoint and p.is_dir():  # a checkpoint that is a folder (an Orbax step folder)
        from dmlib.io.orbax import checkpoints_in

        if checkpoints_in(p) == [os.fspath(p)]:
            return p
    if not (p.is_dir() if folder else p.is_file()):
        raise DmlibError(
            f"{what} {text!r} not found (paths are relative to the study file)", path=where
        )
    if what == "capture folder" and not (p / "manifest.json").is_file():
        # a study hashes a capture's files: only a folder that is a capture is read
        raise DmlibError(
            f"{what} {text!r} holds no manifest.json: not a dmlib capture (a study reads "
            "only capture folders)",
            path=where,
        )
    return p


def _capture_files(folder: Path) -> list[Path]:
    """A capture folder's manifest and the dump files it names (each inside the folder)."""
    from dmlib.errors import CaptureError
    from dmlib.localize.captures import dump_files
    from dmlib.safepaths import bounded_json

    manifest = folder / "manifest.json"
    doc = bounded_json(manifest.read_text(errors="replace"), where=manifest, error=CaptureError)
    dumps = dump_files(folder, doc) if isinstance(doc, dict) else []
    return [manifest, *sorted(p for p in dumps if p.is_file())]


def _under(root: Path, text: str) -> Path:
    """``text`` (absolute, ``~``, or relative to ``root``) as a normalised absolute path."""
    p = Path(os.path.expanduser(text))
    # normpath, not resolve(): a symlinked data folder keeps the name the study gave it
    return Path(os.path.normpath(p if p.is_absolute() else root / p))


def _table(data: Mapping[str, Any], key: str, where: Path) -> Mapping[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise DmlibError(f"{key} must be a table ([{key}]), got {type(value).__name__}", path=where)
    return value


def _list(value: Any, key: str, where: Path) -> list[Any]:
    if not isinstance(value, list):
        raise DmlibError(f"{key} must be a list, got {type(value).__name__}", path=where)
    return value


def _str(value: Any, key: str, where: Path) -> str:
    if not isinstance(value, str) or not value:
        raise DmlibError(f"{key} must be a non-empty string, got {value!r}", path=where)
    return value


def _need(label: str | None) -> str:
    assert label is not None  # _label returns None only for a None value
    return label


def _label(value: Any, key: str, runs: Mapping[str, Run], where: Path) -> str | None:
    if value is None:
        return None
    if value not in runs:
        raise DmlibError(f"{key} {value!r} is not one of the runs ({', '.join(runs)})", path=where)
    return str(value)
