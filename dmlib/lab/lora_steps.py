"""Dataset ``lora_steps``: LoRA adapters and their gradients along a short training run,
for four runs that differ in how the batch's gradient is formed.

A tiny Qwen2 (random initialisation from a config, seed 0) gets a PEFT LoRA (r=8,
alpha=16 on q/k/v/o; PEFT's initialisation, B = 0, from ``LORA_SEED``) and is trained a few
AdamW steps on a fixed batch of four token sequences of unequal lengths (next-token loss,
the mean over every predicted token of the batch). The runs:

- ``base``: one backward over the four sequences together (one padded batch);
- ``split``: two micro-batches of two sequences, each token's loss divided by the batch's
  token count, gradients accumulated: the same gradient up to rounding;
- ``bug``: the same micro-batches, each micro-batch's mean loss divided by the number of
  micro-batches (the per-micro-batch mean: tokens of the shorter micro-batch weigh more);
- ``seed8``: ``base`` with the LoRA initialised from seed 8: the control.

At each step N: the adapter as ``save_pretrained`` writes it (``<run>/adapter/step_N/``:
``adapter_model.safetensors`` and ``adapter_config.json``; PEFT's model card is not kept)
before the step's update, and the gradients of that step's backward
(``<run>/grads/step_N.safetensors``, the adapter's parameters as PEFT names them).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DATASET = "lora_steps"
STEPS = 6
SMALL_STEPS = 2
LORA_SEED = {"base": 0, "split": 0, "bug": 0, "seed8": 8}
LENGTHS = (5, 17, 7, 11)  # tokens per sequence: micro-batches of 22 and 18 tokens
CONFIG: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
LORA: dict[str, Any] = {"r": 8, "lora_alpha": 16,
                        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}  # fmt: skip
LR = 1e-2
DESCRIPTION = (
    "A tiny random-init Qwen2 (2 layers, hidden 32, vocab 96) with a PEFT LoRA (r 8, alpha 16 "
    "on q/k/v/o) trained 6 AdamW steps on four sequences of 5, 17, 7 and 11 tokens: 'base' "
    "(one backward over all four), 'split' (two micro-batches, each token's loss over all "
    "tokens), 'bug' (two micro-batches, each one's mean loss halved) and 'seed8' (the LoRA "
    "initialised from another seed: the control). At every step the adapter (save_pretrained "
    "folder) and the step's LoRA gradients (safetensors)."
)


def _batch_loss(torch: Any, model: Any, seqs: list[Any]) -> tuple[Any, int]:
    """The summed next-token loss of some sequences (one padded batch), and its token count."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)], labels[i, : len(s)] = s, 1, s
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    vocab = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, vocab), labels[:, 1:].reshape(-1), reduction="sum"
    )
    return loss, int((labels[:, 1:] != -100).sum())


def _backward(torch: Any, model: Any, seqs: list[Any], run: str) -> None:
    total = sum(len(s) - 1 for s in seqs)
    if run in ("base", "seed8"):
        loss, _ = _batch_loss(torch, model, seqs)
        (loss / total).backward()
        return
    for mb in (seqs[:2], seqs[2:]):
        loss, n = _batch_loss(torch, model, mb)
        (loss / total if run == "split" else loss / n / 2).backward()


def _run(torch: Any, folder: Path, run: str, steps: int) -> list[float]:
    """One run: adapter and gradients at every step into ``folder``; the losses."""
    import peft
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**CONFIG, pad_token_id=0))
    torch.manual_seed(LORA_SEED[run])
    model = peft.get_peft_model(base, peft.LoraConfig(**LORA))
    gen = torch.Generator().manual_seed(7)  # the same sequences for every run
    seqs = [torch.randint(1, CONFIG["vocab_size"], (n,), generator=gen) for n in LENGTHS]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = []
    for step in range(steps):
        out = folder / "adapter" / f"step_{step}"
        model.save_pretrained(str(out))
        (out / "README.md").unlink(missing_ok=True)  # PEFT's model card: no data
        opt.zero_grad()
        _backward(torch, model, seqs, run)
        grads = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()
                 if p.grad is not None}  # fmt: skip
        (folder / "grads").mkdir(parents=True, exist_ok=True)
        save_file(
            grads, folder / "grads" / f"step_{step}.safetensors", metadata={"step": str(step)}
        )
        with torch.no_grad():
            loss, n = _batch_loss(torch, model, seqs)
        losses.append(float(loss) / n)
        opt.step()
    return losses


def generate(out_dir: Path, *, small: bool = False) -> dict[str, Any]:
    """Every run into ``out_dir/lora_steps/``; returns the manifest section."""
    import shutil

    import torch

    from dmlib._atomic import atomic_write_text

    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    ds = out_dir / DATASET
    for run in LORA_SEED:  # a previous run's files
        shutil.rmtree(ds / run, ignore_errors=True)
    steps = SMALL_STEPS if small else STEPS
    losses = {run: _run(torch, ds / run, run, steps) for run in LORA_SEED}
    index = {
        "runs": list(LORA_SEED), "control": "seed8", "reference": "base",
        "steps": list(range(steps)), "lengths": list(LENGTHS), "micro_batches": [[0, 1], [2, 3]],
        "lora_seed": LORA_SEED, "config": CONFIG, "lora": LORA, "lr": LR, "loss": losses,
    }  # fmt: skip
    atomic_write_text(ds / "index.json", json.dumps(index, indent=1) + "\n")
    atomic_write_text(ds / "README.md", _readme(small))
    files = sorted(str(f.relative_to(out_dir)) for f in ds.rglob("*")
                   if f.is_file() and not f.name.startswith("."))  # fmt: skip
    return {
        "name": DATASET,
        "description": ("Smoke-test copy (2 steps). " if small else "") + DESCRIPTION,
        "command": "python -m dmlib.lab lora_steps --out data" + (" --small" if small else ""),
        "files": files,
    }


def _readme(small: bool) -> str:
    from dmlib.lab.manifest import describe_machine, environment

    return f"""# lora_steps: LoRA adapters and their gradients along training

{DESCRIPTION}

Generated by `python -m dmlib.lab lora_steps --out data`{" (small)" if small else ""} on
{describe_machine(environment())}. Files: `<run>/adapter/step_N/` (a PEFT adapter folder)
and `<run>/grads/step_N.safetensors` for each step N; `index.json` lists the runs, the
sequences' lengths, the micro-batches and the training losses.

    dmlib compare data/lora_steps/base/adapter/step_5 data/lora_steps/split/adapter/step_5
    dmlib compare data/lora_steps/base/grads/step_0.safetensors data/lora_steps/bug/grads/step_0.safetensors --group-l2 adapter

The report notebook `adapters` reads `study.toml` (its `[runs]` of adapter folders and its
`[adapters]` gradients).
"""
