"""Train tiny Llama models with ``transformers.Trainer`` (and save one Accelerate state):
the real training folders the Hugging Face tests read. Run as a script, in its own process
(torch's global state and transformers' warnings stay out of the test process)::

    python tests/_support/hf_train.py OUT

writes ``OUT/runs/{A,B,G,S}`` (A, its repeat B, gradient accumulation G with the same
effective batch, another seed S), ``OUT/runs/R`` (A resumed from its checkpoint-2),
``OUT/runs/D`` (the same resume with another data seed: another data order),
``OUT/accelerate`` (an ``Accelerator.save_state`` folder) and ``OUT/grouping.json``: the
Trainer's own decay names and, per optimizer group, the parameter names in group order.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
warnings.simplefilter("ignore")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    """32 random sequences of 8 token ids (the labels are the inputs)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, 100, (32, 8), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(cfg)


def train(out: str, *, seed: int = 0, accum: int = 1, resume: str | None = None, data_seed=None):
    args = TrainingArguments(
        output_dir=out,
        max_steps=6,
        per_device_train_batch_size=4 // accum,
        gradient_accumulation_steps=accum,
        save_steps=2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=seed,
        data_seed=data_seed,
        learning_rate=1e-3,
        weight_decay=0.1,
        warmup_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model(seed), args=args, train_dataset=Tokens())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def grouping(trainer: Trainer) -> dict:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {
        "decay": trainer.get_decay_parameter_names(trainer.model),
        "groups": [[names[id(p)] for p in g["params"]] for g in trainer.optimizer.param_groups],
    }


def accelerate_state(out: str) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    m = model(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    m, opt, sched = acc.prepare(m, opt, sched)
    x = Tokens().x[:4]
    loss = m(input_ids=x, labels=x).loss
    acc.backward(loss)
    opt.step()
    sched.step()
    acc.save_state(out)


def main(root: str) -> None:
    runs = os.path.join(root, "runs")
    a = train(os.path.join(runs, "A"))
    train(os.path.join(runs, "B"))
    train(os.path.join(runs, "G"), accum=2)
    train(os.path.join(runs, "S"), seed=1)
    resume = os.path.join(runs, "A", "checkpoint-2")
    train(os.path.join(runs, "R"), resume=resume)
    train(os.path.join(runs, "D"), resume=resume, data_seed=7)
    accelerate_state(os.path.join(root, "accelerate"))
    with open(os.path.join(root, "grouping.json"), "w", encoding="utf-8") as f:
        json.dump(grouping(a), f)


if __name__ == "__main__":
    main(sys.argv[1])
