"""Dataset ``moe_packed``: one request of a tiny hybrid mixture-of-experts model captured
alone and packed with others, with its router decisions, expert rows and cache states.

A tiny ``Qwen3NextForCausalLM`` (random initialisation from a config, seed 0; Gated DeltaNet
linear-attention layers on transformers' torch fallback interleaved with full-attention
layers, a sparse MoE block of 8 experts, top-2, in every layer) runs one request ("the
probe", random token ids) under :func:`dmlib.capture` with ``experts=True``: every module
boundary, each router's chosen experts and margins (recorded by default), each expert's
rows, and the state the forward leaves in its cache (conv and recurrent states of the linear
layers, keys and values of the attention layers; recorded by default). Captures, per dtype
(``bf16/`` and ``f32/``), request id ``"probe"``:

``alone``, ``alone_repeat``
    The probe by itself (twice: the repeat control).
``packed``, ``packed_repeat``
    The probe third in a left-padded batch of four requests of other lengths (position ids
    from the attention mask, so the probe's positions are 0.. in every layout).
``different``
    Other token ids under the same request id: the negative control (must differ).

Whether packing changes the probe's hidden states, where the difference enters, and which
tokens change experts depend on the machine's floating point, so nothing here states them:
:func:`generate` computes ``findings`` in ``index.json`` from the captures it just wrote
(:func:`dmlib.compare_captures`) and names the machine beside them. The MoE blocks'
outputs (``model.layers.*.mlp``) are dumped for the probe's rows, which is what a flip's
``effect`` (its token's difference against the others') is computed from, and so are the
probe's conv and recurrent states (their size where they differ).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

DATASET = "moe_packed"
REQUEST = "probe"
BLOCK_ROWS = 4
THREADS = 1
VOCAB, N_PROBE, PAD = 64, 32, 0
OTHERS = (N_PROBE + 5, 9, 5)  # the other requests' lengths (rows 0, 1, 3)
PROBE_ROW = 2
SEEDS = {"model": 0, "probe": 1, "others": 2, "different": 3}
CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_hidden_layers": 4,
    "full_attention_interval": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "max_position_embeddings": 64,
}
DTYPES = ("bf16", "f32")
# the boundaries hooked: the blocks, the attention outputs' projections and the MoE block's
# parts (every leaf would double the folder); "" is the model itself, so its outputs and
# the states its cache leaves are judged
_PARTS = ("", ".mlp", ".mlp.gate", ".mlp.experts", ".mlp.shared_expert")


def _attention(i: int) -> tuple[str, ...]:
    # full attention every full_attention_interval-th layer (Qwen3NextConfig's layer_types)
    if (i + 1) % CONFIG["full_attention_interval"] == 0:
        return (".self_attn", ".self_attn.o_proj")
    return (".linear_attn", ".linear_attn.out_proj")


# listed by name: a glob's * would match every submodule below the layers too
MODULES = [
    "",
    "model.embed_tokens",
    *(f"model.layers.{i}{p}" for i in range(CONFIG["num_hidden_layers"])
      for p in (*_PARTS[:1], *_attention(i), *_PARTS[1:])),
    "model.norm",
    "lm_head",
]  # fmt: skip
# the MoE blocks' outputs (each flip's effect is read there) and the states the forward
# leaves (a state that differs gets its size; the attention layers' keys and values are
# read per position and not dumped)
DUMP = ["model.layers.*.mlp", "(model):state.*"]
COMPARED = ("packed",)
DESCRIPTION = (
    "A tiny random-init hybrid mixture-of-experts model (Qwen3-Next: Gated DeltaNet linear "
    "attention on the torch fallback and full attention, alternating over 4 layers, 8 experts "
    "top-2 in every layer, hidden 32), torch threads=1, in bfloat16 and float32: one "
    f"{N_PROBE}-token request ('probe') captured alone, alone again and packed third in a "
    "left-padded batch of four, plus other tokens (bfloat16, the negative control), with "
    "dmlib.capture(..., experts=True): module boundaries, router choices and margins, expert "
    f"rows and the cache's states (block hashes of {BLOCK_ROWS} positions; the MoE blocks' "
    "outputs and the linear layers' states dumped for the probe). Where the layouts diverge and which tokens change "
    "experts are measured per machine: see 'findings'."
)


def _model(torch: Any, dtype: str) -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(SEEDS["model"])
    cfg = Qwen3NextConfig(**CONFIG, pad_token_id=PAD, bos_token_id=None, eos_token_id=None)
    model = Qwen3NextForCausalLM(cfg).eval()
    return model.to(torch.bfloat16 if dtype == "bf16" else torch.float32)


def _ids(torch: Any, n: int, seed: int) -> Any:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def batch(torch: Any, layout: str) -> tuple[dict[str, Any], list[str]]:
    """The model's keyword arguments for ``layout`` and the batch rows' request ids."""
    if layout in ("alone", "alone_repeat", "different"):
        seed = SEEDS["different" if layout == "different" else "probe"]
        ids = _ids(torch, N_PROBE, seed)[None]
        mask = torch.ones_like(ids)
        return {"input_ids": ids, "attention_mask": mask,
                "position_ids": torch.arange(N_PROBE)[None]}, [REQUEST]  # fmt: skip
    lens = [*OTHERS[:PROBE_ROW], N_PROBE, *OTHERS[PROBE_ROW:]]
    width = max(lens)
    ids = torch.full((len(lens), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(lens), width, dtype=torch.long)
    for row, n in enumerate(lens):
        seed = SEEDS["probe"] if row == PROBE_ROW else SEEDS["others"] * 100 + row
        ids[row, width - n :] = _ids(torch, n, seed)
        mask[row, width - n :] = 1
    names = [REQUEST if r == PROBE_ROW else f"r{r}" for r in range(len(lens))]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}, names


def capture_layout(model: Any, path: Path, layout: str, *, block_rows: int = BLOCK_ROWS) -> None:
    """Run ``layout``'s batch through ``model`` under :func:`dmlib.capture` into ``path``."""
    import torch

    from dmlib.localize.capture import capture
    from dmlib.localize.hf import row_map_from_attention_mask

    kwargs, names = batch(torch, layout)
    rows = row_map_from_attention_mask(kwargs["attention_mask"], names)
    meta = {"layout": layout, "probe_row": names.index(REQUEST),
            "shape": list(kwargs["input_ids"].shape), "torch_threads": torch.get_num_threads()}  # fmt: skip
    if path.exists():
        shutil.rmtree(path)
    with torch.no_grad(), capture(model, path, modules=MODULES, row_map=rows, block_rows=block_rows,
                                  dump=DUMP, dump_requests=[REQUEST], metadata=meta, experts=True):  # fmt: skip
        model(**kwargs)


def _layouts(dtype: str) -> list[str]:
    """The captures of ``dtype`` (float32's negative control is bfloat16's to show)."""
    if dtype == "bf16":
        return ["alone", "alone_repeat", "packed", "different"]
    return ["alone", "alone_repeat", "packed"]


def _flip(f: dict[str, Any]) -> dict[str, Any]:
    keep = ("router", "step", "position", "experts_a", "experts_b", "margin_a", "margin_ulp_a",
            "margin_b", "margin_ulp_b", "scores", "effect")  # fmt: skip
    return {k: f.get(k) for k in keep}


def _sizes(rows: Any) -> dict[str, dict[str, Any]]:
    """boundary -> {n_diff, max_abs, max_ulp} of the differing rows that were dumped in both
    captures (a state hashed only has no size)."""
    import pandas as pd

    out = {}
    for _, r in rows.iterrows():
        if pd.isna(r["n_diff"]):
            continue
        out[r["boundary"]] = {"n_diff": int(r["n_diff"]), "max_abs": float(r["max_abs"]),
                              "max_ulp": int(r["max_ulp"])}  # fmt: skip
    return out


def compared(ds: Path, name: str, layouts: list[str]) -> dict[str, Any]:
    """What ``alone`` against ``name`` under ``ds`` shows (:func:`dmlib.compare_captures`)."""
    from dmlib import compare_captures

    repeat = ds / "alone_repeat" if "alone_repeat" in layouts else None
    negative = ds / "different" if "different" in layouts else None
    df = compare_captures(ds / "alone", ds / name, request=REQUEST, repeat=repeat,
                          negative=negative)  # fmt: skip
    a = df.attrs
    judged = df["identical"].notna()
    differ = judged & (df["identical"] == False)  # noqa: E712
    states = df["boundary"].str.contains(":state.", regex=False)
    routing = a.get("routing") or {}
    experts = a.get("experts") or {}
    return {
        "status": a.get("status"),
        "first_divergent_boundary": a.get("first_divergent_boundary"),
        "culprit": a.get("culprit"),
        "differing_boundaries": int(differ.sum()),
        "not_judged_boundaries": int((~judged).sum()),
        "boundaries": len(df),
        "states": int(states.sum()),
        "states_differing": sorted(df.loc[states & differ, "boundary"].tolist()),
        "state_sizes": _sizes(df[states & differ]),
        "router_calls": routing.get("n_router_calls"),
        "flips": [_flip(f) for f in routing.get("flips", [])],
        "expert_rows_differ": experts.get("n_rows_differ"),
        "expert_rows_identical": experts.get("n_rows_identical"),
        "first_divergent_expert_row": (experts.get("first_divergent") or {}).get("text"),
        "repeat_held": (a.get("repeat_control") or {}).get("held"),
        "negative_passed": (a.get("negative_control") or {}).get("passed"),
    }


def findings(out: Path, layouts: dict[str, list[str]]) -> dict[str, Any]:
    """Per dtype (``layouts``: dtype -> its captures under ``out/<dtype>``), per compared
    layout against ``alone``: computed from the captures."""
    from dmlib.lab.manifest import describe_machine, environment

    got: dict[str, Any] = {"machine": describe_machine(environment()), "dtypes": {}}
    for dtype, names in layouts.items():
        got["dtypes"][dtype] = {
            name: compared(out / dtype, name, names) for name in COMPARED if name in names
        }
    return got


def finding_sentence(found: dict[str, Any]) -> str:
    """One sentence per dtype and compared layout, computed from :func:`findings`."""
    parts = []
    for dtype, per in found["dtypes"].items():
        for name, f in per.items():
            if f["first_divergent_boundary"] is None:
                text = f"{dtype} {name}: {f['status']} at all {f['boundaries']} boundaries"
            else:
                text = (f"{dtype} {name}: first divergent boundary {f['first_divergent_boundary']}"
                        f" (culprit {f['culprit']}), {f['differing_boundaries']} of "
                        f"{f['boundaries']} differ")  # fmt: skip
            text += (f", {len(f['flips'])} routing flips, {f['expert_rows_differ']} expert rows "
                     f"differ, {len(f['states_differing'])} of {f['states']} states differ")  # fmt: skip
            parts.append(text)
    return f"On {found['machine']}: " + "; ".join(parts) + "."


def generate(out_dir: Path, *, small: bool = False) -> dict[str, Any]:
    """Write the captures, ``index.json`` and the README under ``out_dir/moe_packed``;
    return the manifest section."""
    import torch

    from dmlib._atomic import atomic_write_text

    out_dir = Path(out_dir)
    ds = out_dir / DATASET
    ds.mkdir(parents=True, exist_ok=True)
    dtypes = ["bf16"] if small else list(DTYPES)
    layouts = {d: _layouts(d) for d in dtypes}
    previous = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        for dtype in dtypes:
            model = _model(torch, dtype)
            for name in layouts[dtype]:
                capture_layout(model, ds / dtype / name, name)
    finally:
        torch.set_num_threads(previous)
    found = findings(ds, layouts)
    index = {
        "request": REQUEST,
        "dtypes": dtypes,
        "captures": {d: {name: f"{d}/{name}" for name in layouts[d]} for d in dtypes},
        "block_rows": BLOCK_ROWS,
        "torch_threads": THREADS,
        "config": CONFIG,
        "seeds": SEEDS,
        "modules": MODULES,
        "dumped": DUMP,
        "description": DESCRIPTION,
        "findings": found,
    }
    atomic_write_text(ds / "index.json", json.dumps(index, indent=1) + "\n")
    atomic_write_text(ds / "README.md", readme(index, small))
    files = [f"{DATASET}/index.json"]
    for dtype in dtypes:
        for name in layouts[dtype]:
            files += sorted(
                str(p.relative_to(out_dir)) for p in (ds / dtype / name).rglob("*") if p.is_file()
            )
    return {
        "name": DATASET,
        "description": ("Smoke-test copy (bfloat16 only). " if small else "")
        + DESCRIPTION
        + " "
        + finding_sentence(found),
        "command": "python -m dmlib.lab moe_packed --out data" + (" --small" if small else ""),
        "files": files,
    }


__all__ = [
    "batch",
    "capture_layout",
    "compared",
    "finding_sentence",
    "findings",
    "generate",
    "readme",
    "REQUEST",
    "BLOCK_ROWS",
]


def _fmt(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _flip_text(f: dict[str, Any]) -> str:
    e = f.get("effect") or {}
    text = (f"`{f['router']}` position {f['position']}: experts {f['experts_a']} -> "
            f"{f['experts_b']}, margin (k-th minus next score) {_fmt(f.get('margin_a'))} "
            f"({f.get('margin_ulp_a')} ULP) alone, {_fmt(f.get('margin_b'))} "
            f"({f.get('margin_ulp_b')} ULP) packed")  # fmt: skip
    if e:
        text += (f"; the MoE block's output differs by up to {_fmt(e.get('at_flip'))} at that "
                 f"token, {_fmt(e.get('elsewhere'))} at most elsewhere")  # fmt: skip
    return text


def _state_text(name: str, size: dict[str, Any] | None) -> str:
    text = f"`{name.split(':', 1)[1]}`"
    if size:
        text += (f": {size['n_diff']} element(s), max |a-b| {_fmt(size['max_abs'])}, "
                 f"{size['max_ulp']} ULP")  # fmt: skip
    return text


def _finding_lines(dtype: str, name: str, f: dict[str, Any]) -> list[str]:
    head = f"- **{dtype}, alone vs {name}**: {f['status']}"
    if f["first_divergent_boundary"] is not None:
        head += (f"; first divergent boundary `{f['first_divergent_boundary']}`, culprit "
                 f"`{f['culprit']}`; {f['differing_boundaries']} of {f['boundaries']} "
                 "boundaries differ")  # fmt: skip
    lines = [head + f" (repeat control held: {f['repeat_held']}; negative control passed: "
             f"{f['negative_passed']})."]  # fmt: skip
    states = ", ".join(_state_text(s, f["state_sizes"].get(s)) for s in f["states_differing"])
    lines.append(f"  - states the forward leaves in its cache: {len(f['states_differing'])} "
                 f"of {f['states']} differ ({states or 'none'}).")  # fmt: skip
    lines.append(f"  - routing: {len(f['flips'])} token(s) changed experts over "
                 f"{f['router_calls']} router calls" + (":" if f["flips"] else "."))  # fmt: skip
    lines += [f"    - {_flip_text(x)}" for x in f["flips"]]
    lines.append(f"  - expert rows: {f['expert_rows_differ']} differ, "
                 f"{f['expert_rows_identical']} identical"
                 + (f"; the first: {f['first_divergent_expert_row']}."
                    if f["first_divergent_expert_row"] else "."))  # fmt: skip
    return lines


def readme(index: dict[str, Any], small: bool) -> str:
    """The folder's README: how it was made and what its captures show (from ``index``)."""
    found = index["findings"]
    lines = [
        "# moe_packed: a hybrid MoE request alone and packed: states, routing flips, expert rows",
        "",
        "Written by `python -m dmlib.lab moe_packed --out data` (`dmlib/lab/moe_packed.py`)"
        + (" with `--small`" if small else "")
        + "; this README and `index.json` are computed "
        "from the captures by the generator, never edited by hand.",
        "",
        index["description"],
        "",
        "| capture | what ran | probe rows |",
        "|---|---|---|",
        f"| `<dtype>/alone`, `<dtype>/alone_repeat` | the probe ({N_PROBE} random token ids) "
        "by itself, twice | batch row 0 |",
        f"| `<dtype>/packed` | 4 requests of {', '.join(map(str, OTHERS[:PROBE_ROW]))}, "
        f"{N_PROBE} and {', '.join(map(str, OTHERS[PROBE_ROW:]))} tokens, left-padded, "
        "position ids from the mask | batch row 2 |",
        "| `bf16/different` | other token ids under the request id `probe` (negative control) "
        "| batch row 0 |",
        "",
        "The model: `Qwen3NextForCausalLM` from `Qwen3NextConfig` (`config` in `index.json`; "
        "transformers' torch fallback for the Gated DeltaNet kernels), random initialisation "
        "with `torch.manual_seed(0)`, then cast to each dtype. Qwen3-Next rather than "
        "Qwen3-MoE: it has both the linear-attention states and the MoE routers, and a "
        "capture of it takes well under a second here. `study.toml` declares the bfloat16 "
        "captures (`dmlib report data/moe_packed/study.toml`); the float32 ones are compared "
        "in `index.json`. The probe's length (32) and its neighbours were chosen on the "
        "machine that made the data, by trying a few, so that bfloat16 packing flips a "
        "token there: with a 16-token probe, and with 4 to 8 layers, 8 to 64 experts or a "
        "hidden size of 64 or 128, none of the tries flipped one.",
        "",
        f"## What it shows on {found['machine']}",
        "",
        "Which boundary first diverges, which tokens flip and how many rows differ are this "
        "CPU's floating point (the ISA torch dispatched to, its kernels, one thread), not the "
        "model's: another machine can name another boundary or see no flip at all. Computed "
        "with `dmlib.compare_captures(alone, packed, request='probe', repeat=alone_repeat, "
        "negative=different)` (float32 has no `different`: its negative control is the planted "
        "one-bit change alone):",
        "",
    ]
    for dtype, per in found["dtypes"].items():
        for name, f in per.items():
            lines += _finding_lines(dtype, name, f)
    lines += [
        "",
        "    dmlib localize data/moe_packed/bf16/alone data/moe_packed/bf16/packed --request probe "
        "--repeat data/moe_packed/bf16/alone_repeat --negative data/moe_packed/bf16/different",
        "",
    ]
    return "\n".join(lines)
