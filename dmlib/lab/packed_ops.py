"""The packed-vs-alone case at op level: first divergent op, patch test, fp64 arbitration.

:func:`op_findings` runs the real all-MiniLM-L6-v2 on the probe of the ``packed`` dataset
(:mod:`dmlib.lab.packed`) alone and packed with a longer neighbour, captures every
module boundary plus every op of the encoder layers (``ops=True``), and computes on this
machine: the first divergent op and the culprit op (inputs identical, output differs),
where the op sequences of the two layouts part, a patch test at the culprit op, the same
with that op patched in every layer, and, as a control, at the last op before it whose
output still matches, and each run's distance to the float64 replay of the culprit op. Nothing is stated in advance: which op diverges
depends on the CPU (ISA, oneDNN/MKL kernels, threads), which the result names.

:func:`generate` (``python -m dmlib.lab packed_ops --out data``) commits the op level of
the ``packed`` dataset beside its module-boundary captures: ``packed/ops/alone`` and
``packed/ops/packed``, captured with the ops of one encoder layer only (the layer of the
culprit op, layer 0 when there is none) and whole dumps of the culprit op's inputs and
output only (what the fp64 replay needs; everything else is hashes), and
``packed/ops/op_findings.json``: :func:`op_findings` (its patch tests need the live
model, so they are computed here and recorded with the machine), what the committed
captures show, and the machine, CPU flags and the ISA torch dispatched to.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

from dmlib.lab import packed

OP_MODULES = "encoder.layer.*"
DUMP = "encoder.layer.*.attention.self/*"  # the attention ops' own tensors, whole


def op_findings(
    out_dir: str | Path | None = None,
    *,
    op_modules: str = OP_MODULES,
    dump: str = DUMP,
    threads: int = packed.THREADS,
) -> dict[str, Any]:
    """Capture alone and packed with ops inside ``op_modules``; return what they show.

    Parameters
    ----------
    out_dir
        Where the captures go (default: a temporary folder, removed).
    op_modules
        Modules whose ops are recorded.
    dump
        Op boundaries dumped whole (for the patch tests and the fp64 replay).
    threads
        torch threads while running (the dataset's setting by default).

    Returns
    -------
    dict
        ``machine``, ``torch``, ``threads``, ``first_divergent_op``, ``culprit_op``,
        ``culprit_module``, ``op_alignment``, ``patch`` (at the culprit op),
        ``patch_every_layer`` (that op in every layer), ``patch_control`` (at the last
        matching op before it), ``arbitration``.
    """
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    tmp = None
    if out_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="dmlib-packed-ops-")
        out_dir = tmp.name
    root = Path(out_dir)
    try:
        from dmlib.lab.minilm import load_minilm
        from dmlib.localize.boundaries import compare_captures

        model = load_minilm()
        runs = _capture_layouts(model, root, op_modules, dump)
        df = compare_captures(root / "alone", root / "packed", request=packed.REQUEST)
        out = _boundary_findings(df.attrs, threads, op_modules)
        if out["culprit_op"] is not None:
            _culprit_tests(out, df, model, root, *runs["packed"])
        return out
    finally:
        torch.set_num_threads(previous)
        if tmp is not None:
            tmp.cleanup()


def _capture_layouts(
    model: Any, root: Path, op_modules: str, dump: str
) -> dict[str, tuple[Any, Any]]:
    """Capture the probe alone and packed into ``root/alone`` and ``root/packed``;
    ``{layout: (batch, row_map)}``."""
    import torch

    from dmlib.lab.minilm import tokenize
    from dmlib.localize.capture import capture

    layouts = packed._layouts(small=True)
    runs: dict[str, Any] = {}
    for name in ("alone", "packed"):
        texts, probe, pad_to = layouts[name]
        batch = tokenize(texts, pad_to=pad_to)
        rows = packed.row_map(batch["attention_mask"], probe)
        with torch.no_grad(), capture(model, root / name, modules="*", ops=True,
                                      op_modules=op_modules, row_map=rows,
                                      block_rows=packed.BLOCK_ROWS, overwrite=True,
                                      dump=dump):  # fmt: skip
            model(**batch)
        runs[name] = (batch, rows)
    return runs


def _boundary_findings(at: dict[str, Any], threads: int, op_modules: str) -> dict[str, Any]:
    """The result's machine and what the capture comparison shows; the tests left empty."""
    import torch

    from dmlib.lab.manifest import describe_machine, environment

    return {
        "machine": describe_machine(environment()),
        "torch": torch.__version__,
        "threads": threads,
        "op_modules": op_modules,
        "first_divergent_boundary": at["first_divergent_boundary"],
        "first_divergent_op": at["first_divergent_op"],
        "culprit_op": at["culprit_op"],
        "culprit_module": None if at["culprit_op"] is None else at["culprit_op"].split("/")[0],
        "op_alignment": at["op_alignment"],
        "patch": None,
        "patch_every_layer": None,
        "patch_control": None,
        "arbitration": None,
    }


def _culprit_tests(
    out: dict[str, Any], df: Any, model: Any, root: Path, batch: Any, rows: Any
) -> None:
    """Fill ``out``'s patch tests (culprit op, in every layer, control) and arbitration."""
    import torch

    from dmlib.localize.arbitrate import arbitrate
    from dmlib.localize.captures import open_capture
    from dmlib.localize.patch import patch_test

    def run() -> Any:
        with torch.no_grad():
            return model(**batch)

    op = out["culprit_op"]
    out["patch"] = _patch(patch_test, model, root, op, rows, run)
    every = _in_every_layer(op, open_capture(root / "alone"))
    if len(every) > 1:
        out["patch_every_layer"] = _patch(patch_test, model, root, every, rows, run)
    control = _last_matching_op_before(df, op, open_capture(root / "alone"))
    if control is not None:
        out["patch_control"] = _patch(patch_test, model, root, control, rows, run)
    arb = arbitrate(root / "alone", root / "packed", op, request=packed.REQUEST)
    out["arbitration"] = {
        "verdict": arb.verdict,
        "reason": arb.reason,
        "rows": arb.table.to_dict(orient="records"),
    }


def _in_every_layer(op: str, source: Any) -> list[str]:
    """``op`` with its layer number replaced by every layer's that the capture holds."""
    import re

    from dmlib.localize.ops import op_table

    m = re.search(r"\.layers?\.(\d+)\.", op)
    if m is None:
        return [op]
    ids = {o.id for o in op_table(source)}
    out = []
    for i in range(1000):
        name = op[: m.start(1)] + str(i) + op[m.end(1) :]
        if name not in ids:
            break
        out.append(name)
    return out


def _patch(patch_test: Any, model: Any, root: Path, boundary: Any, rows: Any, run: Any) -> dict:
    from dmlib.errors import CaptureError

    label = boundary if isinstance(boundary, str) else ", ".join(boundary)
    try:
        res = patch_test(model, source=root / "alone", boundary=boundary,
                         request=packed.REQUEST, row_map=rows, run=run)  # fmt: skip
    except CaptureError as err:  # e.g. the op's rows were not dumped for the probe
        return {"boundary": label, "confirmed": None, "reason": err.message,
                "first_still_differing": None}  # fmt: skip
    return {"boundary": label, "confirmed": res.confirmed, "reason": res.reason,
            "first_still_differing": res.first_still_differing}  # fmt: skip


def _last_matching_op_before(df: Any, op: str, source: Any) -> str | None:
    """The last op output before ``op`` whose probe rows match and were dumped: a patch
    there must not be confirmed."""
    import pandas as pd

    names = list(df["boundary"])
    for i in range(names.index(op) - 1, -1, -1):
        name, same = names[i], df["identical"].iloc[i]
        if "/" not in name or ":" in name or same is pd.NA or not bool(same):
            continue
        if source.boundary(name).row_mapped and source.dumped(name, packed.REQUEST):
            return name
    return None


OPS_DIR = "ops"
FINDINGS = "op_findings.json"
_LAYER = re.compile(r"^(.*?\.layers?\.\d+)(?:\.|/|$)")


def committed_scope(culprit_op: str | None) -> tuple[list[str], list[str]]:
    """(op_modules, dump) for the committed captures: the culprit op's layer, its tensors."""
    m = _LAYER.match(culprit_op or "")
    layer = m.group(1) if m else "encoder.layer.0"
    dump = [] if culprit_op is None else [culprit_op, f"{culprit_op}:*"]
    return [layer, f"{layer}.*"], dump


def generate(out_dir: Path, *, small: bool = False) -> dict[str, Any]:
    """Write ``<out>/packed/ops/{alone,packed,op_findings.json}``; return the manifest section.

    The module-boundary captures of :mod:`dmlib.lab.packed` are left as they are.
    """
    import torch

    from dmlib import _atomic, _json
    from dmlib.lab.manifest import describe_machine, environment
    from dmlib.lab.minilm import load_minilm, tokenize
    from dmlib.localize.boundaries import compare_captures
    from dmlib.localize.capture import capture

    out_dir = Path(out_dir)
    ds = out_dir / packed.DATASET / OPS_DIR
    ds.mkdir(parents=True, exist_ok=True)
    found = op_findings()
    op_modules, dump = committed_scope(found["culprit_op"])
    previous = torch.get_num_threads()
    torch.set_num_threads(packed.THREADS)
    try:
        model = load_minilm()
        layouts = packed._layouts(small=True)
        for name in ("alone", "packed"):
            texts, probe, pad_to = layouts[name]
            batch = tokenize(texts, pad_to=pad_to)
            rows = packed.row_map(batch["attention_mask"], probe)
            meta = {"layout": name, "probe_index": probe, "torch_threads": packed.THREADS}
            with torch.no_grad(), capture(model, ds / name, modules="*", ops=True,
                                          op_modules=op_modules, row_map=rows,
                                          block_rows=packed.BLOCK_ROWS, overwrite=True,
                                          dump=dump, metadata=meta):  # fmt: skip
                model(**batch)
        env = environment()
    finally:
        torch.set_num_threads(previous)
    at = compare_captures(ds / "alone", ds / "packed", request=packed.REQUEST).attrs
    committed = {
        "op_modules": op_modules,
        "dump": dump,
        "first_divergent_op": at["first_divergent_op"],
        "culprit_op": at["culprit_op"],
    }
    doc = {
        "request": packed.REQUEST,
        "machine": describe_machine(env),
        "environment": env,
        "computed_by": "python -m dmlib.lab packed_ops --out data",
        "lab_capture": "alone and packed recaptured in the same process with the ops of "
        f"every {found['op_modules']} module and the attention ops dumped whole",
        "findings": found,
        "committed": committed,
    }
    _atomic.atomic_write_text(ds / FINDINGS, json.dumps(_json.jsonable(doc), indent=1) + "\n")
    files = [str((ds / FINDINGS).relative_to(out_dir))]
    for name in ("alone", "packed"):
        files += sorted(str(p.relative_to(out_dir)) for p in (ds / name).rglob("*") if p.is_file())
    size = sum((out_dir / f).stat().st_size for f in files)
    return {
        "name": "packed_ops",
        "description": (
            "op level of the packed dataset: MiniLM's probe alone and packed, ops of "
            f"{op_modules[0]} recorded, the culprit op's tensors dumped whole ({size} bytes); "
            f"op_findings.json: first divergent op {found['first_divergent_op']}, culprit op "
            f"{found['culprit_op']}, patch test confirmed="
            f"{(found['patch'] or {}).get('confirmed')}, on {doc['machine']}"
        ),
        "command": "python -m dmlib.lab packed_ops --out data",
        "files": files,
    }


__all__ = [
    "op_findings",
    "generate",
    "committed_scope",
    "OP_MODULES",
    "DUMP",
    "OPS_DIR",
    "FINDINGS",
]
