"""Dataset ``packed``: one request run alone, padded, and co-packed, captured at every boundary.

The real all-MiniLM-L6-v2 runs one request ("the probe") alone, right-padded, and inside
batches, under :func:`dmlib.capture`. Whether, and where, the probe's hidden states stop
being bit-identical depends on the machine's floating point (the ISA PyTorch dispatches to,
oneDNN/MKL kernel choice, threads): on one CPU the first divergent boundary is the layer-0
scaled-dot-product attention, on another already the row-count-dependent GEMM of the query
projection. So nothing here states the finding: :func:`generate` computes it from the
captures it just wrote (``findings`` in ``index.json``) and names the machine beside it.

Captures (each a :func:`dmlib.capture` directory under ``<out>/packed/``), request id
``"probe"``, block_rows 8:

``alone``, ``alone_repeat``
    The probe text by itself, no padding (twice: the repeat control).
``padded``
    The probe by itself, right-padded to 128 positions.
``packed``, ``packed_repeat``
    The probe second in a batch of four texts; a longer neighbour pads it.
``packed_unpadded``
    The probe in a batch of four where it is the longest text, so it is not padded.
``different``
    Another text under the same request id: the negative control (must differ).

Full tensors are dumped only for the probe's rows of three boundaries (embedding
output, layer-0 attention output, layer-5 output) and only in ``alone``, ``padded`` and
``packed``; everything else is hashes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

DATASET = "packed"
REQUEST = "probe"
BLOCK_ROWS = 8
THREADS = 1
PAD_TO = 128

PROBE = (
    "The committee reviewed the quarterly results in detail, noting that revenue from the "
    "northern region had grown steadily while costs in manufacturing had fallen, and it "
    "asked the finance team to prepare a revised forecast for the board meeting next month."
)
DIFFERENT = (
    "A small boat drifted slowly across the quiet lake at dawn, its single passenger "
    "watching herons lift from the reeds while the mist burned away above the water and "
    "the distant village bells rang out the hour for the farmers already in their fields."
)
SHORT = ["A man is eating food.", "The sky is blue.", "I like pizza."]
LONGER = (
    "In the long and detailed report published yesterday, researchers from several "
    "universities described how coastal ecosystems respond to rising sea temperatures, "
    "documenting shifts in fish populations, coral bleaching events, changes in seagrass "
    "meadows and the migration of predators toward cooler waters further from the equator."
)

DUMP = ["embeddings", "encoder.layer.0.attention.self", "encoder.layer.5"]
# controls are compared by hash only; full rows are kept where statistics are shown
DUMPED_LAYOUTS = ("alone", "padded", "packed")
DESCRIPTION = (
    "all-MiniLM-L6-v2 (CPU, float32, torch threads=1): one request ('probe') captured at "
    "every module boundary alone, alone again, padded to 128, packed with a longer "
    "neighbour, packed as the longest text, and a different text; per-request block "
    "hashes (8 positions per block) everywhere, full rows of the probe for a few "
    "boundaries. Where the layouts first diverge is measured per machine: see 'findings'."
)
# the layouts whose comparison against ``alone`` is summarised in index.json["findings"]
COMPARED = ("padded", "packed", "packed_unpadded")


def findings(ds: Path, layouts: list[str]) -> dict[str, Any]:
    """What the captures under ``ds`` show, computed: per layout against ``alone``.

    The first divergent boundary, the culprit (inputs match, output differs) and whether the
    repeat control held, with the machine that made them named in one line.
    """
    from dmlib import compare_captures
    from dmlib.lab.manifest import describe_machine, environment

    out: dict[str, Any] = {"machine": describe_machine(environment()), "layouts": {}}
    for name in COMPARED:
        if name not in layouts:
            continue
        repeat = ds / "alone_repeat" if "alone_repeat" in layouts else None
        df = compare_captures(ds / "alone", ds / name, request=REQUEST, repeat=repeat)
        # identical is True, False, or missing (a boundary not judged: counted apart, never
        # as a difference nor as identical)
        judged = df["identical"].notna()
        out["layouts"][name] = {
            "first_divergent_boundary": df.attrs.get("first_divergent_boundary"),
            "culprit": df.attrs.get("culprit"),
            "differing_boundaries": int((judged & (df["identical"] == False)).sum()),  # noqa: E712
            "not_judged_boundaries": int((~judged).sum()),
            "boundaries": len(df),
            "repeat_held": (df.attrs.get("repeat_control") or {}).get("held"),
        }
    return out


def finding_sentence(found: dict[str, Any]) -> str:
    """One sentence per compared layout, computed from :func:`findings`."""
    parts = []
    for name, f in found["layouts"].items():
        if f["first_divergent_boundary"] is None:
            parts.append(f"{name}: identical to alone at all {f['boundaries']} boundaries")
        else:
            parts.append(
                f"{name}: first divergent boundary {f['first_divergent_boundary']}"
                f" (culprit {f['culprit']}), {f['differing_boundaries']} of {f['boundaries']} differ"
            )
        if f.get("not_judged_boundaries"):
            parts[-1] += f" ({f['not_judged_boundaries']} not judged)"
    return f"On {found['machine']}: " + "; ".join(parts) + "."


def _layouts(small: bool) -> dict[str, tuple[list[str], int, int | None]]:
    """name -> (texts, index of the probe, pad_to)."""
    out = {
        "alone": ([PROBE], 0, None),
        "alone_repeat": ([PROBE], 0, None),
        "padded": ([PROBE], 0, PAD_TO),
        "packed": ([SHORT[0], PROBE, LONGER, SHORT[1]], 1, None),
        "packed_repeat": ([SHORT[0], PROBE, LONGER, SHORT[1]], 1, None),
        "packed_unpadded": ([SHORT[0], PROBE, SHORT[1], SHORT[2]], 1, None),
        "different": ([DIFFERENT], 0, None),
    }
    if small:
        for k in ("packed_repeat", "packed_unpadded"):
            del out[k]
    return out


def row_map(attention_mask, probe: int) -> list[tuple[str, int] | None]:
    """(request, position) for every (batch, position) row; None where the mask is 0."""
    rows: list[tuple[str, int] | None] = []
    for i, mask in enumerate(attention_mask.tolist()):
        rid = REQUEST if i == probe else f"r{i}"
        rows += [(rid, j) if m else None for j, m in enumerate(mask)]
    return rows


def capture_layout(model, path: Path, texts: list[str], probe: int, pad_to: int | None, *,
                   dump: list[str] | None = None, block_rows: int = BLOCK_ROWS) -> None:  # fmt: skip
    """Run ``texts`` through ``model`` under :func:`dmlib.capture` into ``path``."""
    import torch

    from dmlib.lab.minilm import tokenize
    from dmlib.localize.capture import capture

    batch = tokenize(texts, pad_to=pad_to)
    rows = row_map(batch["attention_mask"], probe)
    meta = {"texts": len(texts), "probe_index": probe, "pad_to": pad_to, "shape": list(batch["input_ids"].shape),
            "torch_threads": torch.get_num_threads()}  # fmt: skip
    if path.exists():
        shutil.rmtree(path)
    with torch.no_grad(), capture(model, path, modules="*", row_map=rows, block_rows=block_rows,
                                  dump=DUMP if dump is None else dump, dump_requests=[REQUEST], metadata=meta):  # fmt: skip
        model(**batch)


def generate(out_dir: Path, *, small: bool = False) -> dict[str, Any]:
    """Write the captures and ``index.json`` under ``out_dir/packed``; return the manifest section."""
    import torch

    from dmlib import _atomic
    from dmlib.lab.minilm import load_minilm

    out_dir = Path(out_dir)
    ds = out_dir / DATASET
    ds.mkdir(parents=True, exist_ok=True)
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)  # the phenomenon and the repeats are stated for one thread
    try:
        model = load_minilm()
        layouts = _layouts(small)
        for name, (texts, probe, pad_to) in layouts.items():
            capture_layout(
                model, ds / name, texts, probe, pad_to, dump=DUMP if name in DUMPED_LAYOUTS else []
            )
    finally:
        torch.set_num_threads(previous)
    found = findings(ds, list(layouts))
    index = {
        "request": REQUEST,
        "captures": {name: name for name in layouts},
        "block_rows": BLOCK_ROWS,
        "torch_threads": THREADS,
        "dumped": DUMP,
        "dumped_in": list(DUMPED_LAYOUTS),
        "description": DESCRIPTION,
        "findings": found,
    }
    _atomic.atomic_write_text(ds / "index.json", json.dumps(index, indent=1) + "\n")
    files = ["packed/index.json"]
    for name in layouts:
        files += sorted(str(p.relative_to(out_dir)) for p in (ds / name).rglob("*") if p.is_file())
    return {
        "name": DATASET,
        "description": DESCRIPTION + " " + finding_sentence(found),
        "command": "python -m dmlib.lab packed --out data",
        "files": files,
    }


__all__ = [
    "generate",
    "capture_layout",
    "row_map",
    "findings",
    "finding_sentence",
    "REQUEST",
    "BLOCK_ROWS",
]
