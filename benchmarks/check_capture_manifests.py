"""A check, not a benchmark: the capture writes the same manifests byte for byte in two
checkouts of dmlib (the same model, inputs and settings, one torch thread).

The workload runs in a fresh interpreter inside each checkout (its own ``dmlib`` and its
own compiled modules): the lab's MiniLM captures (``dmlib.lab.packed`` layouts, hashes and
dumps as the lab writes them; the op-level ones of ``dmlib.lab.packed_ops``) and a tiny
Llama from ``bench_capture_hf``'s config, without and with ``ops=True`` on one layer, and a
``capture_generate`` run (KV caches, decode steps). Every ``manifest.json`` and dump file of
one is compared with the other's.

``--drop-head KEY`` and ``--drop-with KEY`` compare across a change that adds to the
format on purpose: a head key (``coverage``) is cut from the manifest's first line, and a
boundary line holding the key (``state``) left out, in this checkout's manifests only; the
rest of the text is compared as it is.

    python -m benchmarks.check_capture_manifests OTHER_CHECKOUT [--keep DIR]
        [--drop-head KEY ...] [--drop-with KEY ...]
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

WORKLOAD = r"""
import sys
from pathlib import Path

import torch
import transformers

out = Path(sys.argv[1])
torch.set_num_threads(1)
from dmlib.lab import packed, packed_ops
from dmlib.lab.minilm import load_minilm
from dmlib.localize.capture import capture
from dmlib.localize.hf import capture_generate, row_map_from_attention_mask

model = load_minilm()
for name, (texts, probe, pad_to) in packed._layouts(small=True).items():
    packed.capture_layout(model, out / "lab" / name, texts, probe, pad_to)
packed_ops._capture_layouts(model, out / "lab_ops", "encoder.layer.0.*", "")

torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=256, max_position_embeddings=128, hidden_size=64,
                               intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2)
llama = transformers.LlamaForCausalLM(cfg).eval()
x = torch.randint(0, 256, (5, 80), generator=torch.Generator().manual_seed(1))
rows = [[(b, j) for j in range(80)] for b in range(5)]
with torch.no_grad():
    for name, kw in (("llama", {}), ("llama_ops", {"ops": True, "op_modules": "model.layers.0"})):
        with capture(llama, out / name, row_map=rows, **kw):
            llama(input_ids=x)
    ids = x[:2, :12]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    gen = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 3, "do_sample": False,
           "pad_token_id": 0}
    capture_generate(llama, out / "llama_generate", generate_kwargs=gen,
                     row_map=row_map_from_attention_mask(mask, ["a", "b"]))
print("ok")
"""


def run_in(checkout: Path, out: Path) -> None:
    """The workload in a fresh interpreter whose ``dmlib`` is the checkout's."""
    subprocess.run([sys.executable, "-c", WORKLOAD, str(out)], cwd=checkout, check=True,
                   env=dict(os.environ, PYTHONPATH=str(checkout)))  # fmt: skip


def without(text: str, head_keys: list[str], boundary_keys: list[str]) -> str:
    """A manifest's text (head line, one boundary a line, ``]}``) less the head keys named
    and the boundary lines holding one of ``boundary_keys``; everything else as it is."""
    head, *body, end, last = text.split("\n")
    decoder = json.JSONDecoder()
    for key in head_keys:
        at = head.find(f',"{key}":')
        if at >= 0:
            _, stop = decoder.raw_decode(head, at + len(key) + 4)
            head = head[:at] + head[stop:]
    kept = [line.rstrip(",") for line in body
            if not set(boundary_keys) & set(json.loads(line.rstrip(",")))]  # fmt: skip
    return "\n".join([head, ",\n".join(kept), end, last])


def compare_trees(a: Path, b: Path, head_keys: list[str], boundary_keys: list[str]) -> list[str]:
    """The files that differ or exist on one side only (relative paths); ``a``'s manifests
    read :func:`without` the keys named."""
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    bad = sorted(str(p) + " (one side only)" for p in files_a ^ files_b)
    for rel in sorted(files_a & files_b):
        if rel.name == "manifest.json" and (head_keys or boundary_keys):
            mine = without((a / rel).read_text(), head_keys, boundary_keys)
            if mine != (b / rel).read_text():
                bad.append(str(rel))
        elif not filecmp.cmp(a / rel, b / rel, shallow=False):
            bad.append(str(rel))
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("other", type=Path, help="the other checkout (a git worktree, say)")
    p.add_argument("--keep", type=Path, help="write the captures here (else a temporary folder)")
    p.add_argument(
        "--drop-head",
        action="append",
        default=[],
        metavar="KEY",
        help="a head key this checkout adds (left out before comparing)",
    )
    p.add_argument(
        "--drop-with",
        action="append",
        default=[],
        metavar="KEY",
        help="a boundary key this checkout adds (its lines left out)",
    )
    p.add_argument(
        "--compare-only",
        action="store_true",
        help="compare the captures already in --keep (no run)",
    )
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="dmlib-manifests-")) if args.keep is None else args.keep
    try:
        if not args.compare_only:
            run_in(HERE.parent, root / "this")
            run_in(args.other.resolve(), root / "other")
        bad = compare_trees(root / "this", root / "other", args.drop_head, args.drop_with)
        n = sum(1 for f in (root / "this").rglob("manifest.json"))
        print(f"{n} manifests and their dumps compared: "
              + ("byte-identical" if not bad else f"{len(bad)} differ: {bad[:10]}"))  # fmt: skip
        return 1 if bad else 0
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
