"""Dataset ``logprob_drift``: a sampler's and a trainer's log-probs of the same tokens,
along a short training run and along an lr=0 run.

A tiny Qwen2 (random initialisation from a config, seed 0) is trained for a few AdamW
steps on a fixed batch of token sequences (next-token loss), twice from the same
initialisation: ``policy`` (lr 3e-3) and ``lr0`` (lr 0: the weights never move). At each
saved step a bfloat16 copy of the weights plays both parts:

- the *sampler*: ``generate()`` (prefill, then one token at a time against a
  ``DynamicCache``), sampling from the full distribution (temperature 1, no top-k or
  top-p), seeded per step; its log-probs are the log-softmax of the logits it sampled
  from, written as JSONL (``sampler_N.jsonl``: tokens, log-probs, the top 5 ids and
  log-probs of each position, and a metadata line);
- the *trainer*: one forward pass over the whole sequences (prompt + sampled tokens,
  no cache), the log-prob of each sampled token, written as safetensors
  (``trainer_N.safetensors``, the same keys as padded tensors).

Both files record the bf16 weights' SHA-256 and the temperature (metadata), so the
identity gate checks that they score the same weights and tokens. Whatever separates
their log-probs is numerics: bfloat16 matmuls over one row at a time against a cache
versus the whole sequence at once.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

DATASET = "logprob_drift"
STEPS = (0, 2, 4, 6, 8)
SMALL_STEPS = (0, 2)
RUNS = {"policy": 3e-3, "lr0": 0.0}
BATCH, PROMPT, NEW, TOP = 4, 6, 16, 5
CONFIG: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
DESCRIPTION = (
    "A tiny random-init Qwen2 (2 layers, hidden 32, vocab 96) trained 8 AdamW steps on a "
    "fixed batch, with lr 3e-3 ('policy') and lr 0 ('lr0', the control); at steps 0, 2, 4, 6, "
    "8 a bfloat16 copy samples 4 x 16 tokens with generate() and a KV cache (sampler_N.jsonl: "
    "tokens, log-probs, top-5 ids and log-probs) and scores the same sequences in one forward "
    "pass without a cache (trainer_N.safetensors)."
)


def _model(torch: Any) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**CONFIG, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    return Qwen2ForCausalLM(cfg).eval()


def _weights_hash(model: Any) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy())
    return h.hexdigest()


def _sample_and_score(torch: Any, model: Any, prompts: Any, step: int) -> dict[str, Any]:
    """The sampler's and the trainer's log-probs of one step's samples (bfloat16 weights)."""
    bf = copy.deepcopy(model).to(torch.bfloat16).eval()
    torch.manual_seed(1000 + step)
    with torch.no_grad():
        out = bf.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            max_new_tokens=NEW,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
        tokens = out.sequences[:, PROMPT:]
        s_lp = torch.stack(out.logits, dim=1).float().log_softmax(-1)  # [B, NEW, V]
        t_logits = bf(out.sequences).logits[:, PROMPT - 1 : -1]
        t_lp = t_logits.float().log_softmax(-1)
    pick = tokens.unsqueeze(-1)
    return {
        "tokens": tokens.numpy().astype(np.int64),
        "sampler": (s_lp.gather(-1, pick)[..., 0].numpy(), *_top(torch, s_lp)),
        "trainer": (t_lp.gather(-1, pick)[..., 0].numpy(), *_top(torch, t_lp)),
        "weights_hash": _weights_hash(bf),
    }


def _top(torch: Any, lp: Any) -> tuple[np.ndarray, np.ndarray]:
    v, i = torch.topk(lp, TOP, dim=-1)
    return v.numpy(), i.numpy().astype(np.int64)


def _write_step(folder: Path, step: int, got: dict[str, Any]) -> list[Path]:
    from dmlib._atomic import atomic_write_text
    from dmlib.io.safetensors import write_safetensors

    meta = {"weights_hash": got["weights_hash"], "temperature": "1.0"}
    lp, top_v, top_i = got["sampler"]
    lines = [json.dumps({"metadata": meta})]
    for s in range(BATCH):
        lines.append(
            json.dumps(
                {
                    "tokens": got["tokens"][s].tolist(),
                    "logprobs": [float(x) for x in lp[s]],
                    "top_ids": top_i[s].tolist(),
                    "top_logprobs": [[float(x) for x in row] for row in top_v[s]],
                }
            )
        )
    sampler = folder / f"sampler_{step}.jsonl"
    atomic_write_text(sampler, "\n".join(lines) + "\n")
    lp, top_v, top_i = got["trainer"]
    trainer = folder / f"trainer_{step}.safetensors"
    arrays = {"logprobs": lp, "tokens": got["tokens"], "top_logprobs": top_v, "top_ids": top_i}
    write_safetensors(
        trainer, {k: np.ascontiguousarray(v) for k, v in arrays.items()}, metadata=meta
    )
    return [sampler, trainer]


def _run(torch: Any, folder: Path, lr: float, steps: tuple[int, ...]) -> dict[str, Any]:
    """Train from the shared initialisation, saving both sides' log-probs at ``steps``."""
    model = _model(torch)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(1, CONFIG["vocab_size"], (8, 24), generator=gen)
    prompts = torch.randint(1, CONFIG["vocab_size"], (BATCH, PROMPT), generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    folder.mkdir(parents=True, exist_ok=True)
    files, losses, hashes = [], {}, {}
    for step in range(max(steps) + 1):
        if step in steps:
            got = _sample_and_score(torch, model, prompts, step)
            files += _write_step(folder, step, got)
            hashes[step] = got["weights_hash"]
        if step == max(steps):
            break
        model.train()
        loss = model(data, labels=data).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        losses[step + 1] = loss.item()
    return {"files": files, "loss": losses, "weights_hash": hashes}


def generate(out_dir: Path, *, small: bool = False) -> dict[str, Any]:
    """Both runs into ``out_dir/logprob_drift/``; returns the manifest section."""
    import torch

    from dmlib._atomic import atomic_write_text

    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    ds = out_dir / DATASET
    steps = SMALL_STEPS if small else STEPS
    for old in [*ds.glob("*/sampler_*.jsonl"), *ds.glob("*/trainer_*.safetensors")]:
        old.unlink()  # a previous run's files
    made = {run: _run(torch, ds / run, lr, steps) for run, lr in RUNS.items()}
    index = {
        "runs": {
            run: {
                str(s): [f"{run}/sampler_{s}.jsonl", f"{run}/trainer_{s}.safetensors"]
                for s in steps
            }
            for run in RUNS
        },
        "control": "lr0",
        "lr": RUNS,
        "steps": list(steps),
        "config": CONFIG,
        "shape": {"sequences": BATCH, "prompt": PROMPT, "new_tokens": NEW, "top": TOP},
        "loss": {run: m["loss"] for run, m in made.items()},
        "weights_hash": {run: m["weights_hash"] for run, m in made.items()},
    }
    atomic_write_text(ds / "index.json", json.dumps(index, indent=1) + "\n")
    atomic_write_text(ds / "README.md", _readme(index, small))
    files = sorted(
        str(f.relative_to(out_dir))
        for f in ds.rglob("*")
        if f.is_file() and not f.name.startswith(".")
    )
    return {
        "name": DATASET,
        "description": ("Smoke-test copy (steps 0 and 2). " if small else "") + DESCRIPTION,
        "command": "python -m dmlib.lab logprob_drift --out data" + (" --small" if small else ""),
        "files": files,
    }


def _readme(index: dict[str, Any], small: bool) -> str:
    from dmlib.lab.manifest import describe_machine, environment

    same = index["weights_hash"]["lr0"]
    lr0_fixed = len(set(same.values())) == 1
    return f"""# logprob_drift: a sampler's and a trainer's log-probs along training

{DESCRIPTION}

Generated by `python -m dmlib.lab logprob_drift --out data`{" (small)" if small else ""} on
{describe_machine(environment())}. Files: `<run>/sampler_N.jsonl` and
`<run>/trainer_N.safetensors` for each saved step N (layouts: `docs/logprobs.md`);
`index.json` lists them with the training losses and the bf16 weights' SHA-256 per step.
The lr=0 run's weights are the same at every step: **{lr0_fixed}** (their hash).

    dmlib logprobs data/logprob_drift/policy/sampler_8.jsonl data/logprob_drift/policy/trainer_8.safetensors
    dmlib logprob-ladder policy:0=data/logprob_drift/policy/sampler_0.jsonl,data/logprob_drift/policy/trainer_0.safetensors ... --control lr0

The report notebook `logprob_drift` reads `study.toml` (its `[logprobs]` section).
"""
