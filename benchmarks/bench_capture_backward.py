"""Cost of ``dmlib.capture(..., backward=True)`` against a plain forward + backward.

The tiny model of the tests (``Qwen2Config``: hidden 64, 2 layers, 4/2 heads, MLP 128,
random weights, float32, eager CPU) with a PEFT LoRA (r=8, alpha 16, on q/k/v/o), on a
batch of 5 x 80 tokens. Variants, timed interleaved N times (median and best of N; wall
clock around forward + backward, the capture's manifest written included):

- ``plain``: ``out.backward(randn)`` after ``model(**batch)``, gradients zeroed before;
- ``capture_bw``: the same inside ``dmlib.capture(model, ..., backward=True,
  grad_seed=0)`` with the default modules and a row map (every forward boundary, each
  module's gradients w.r.t. its outputs and inputs, every LoRA factor's .grad), the
  backward run by ``rec.backward(out)`` (the same seeded upstream gradient);
- ``capture_fw``: ``backward=False`` (the forward's boundaries only) around the same
  forward + backward, to show what the backward's boundaries add.

Target: ``capture_bw <= 3x`` plain (median ratio).

    python -m benchmarks.bench_capture_backward [--n 15]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import peft
    import torch
    import transformers

    import dmlib

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    cfg = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])  # fmt: skip
    m = peft.get_peft_model(transformers.Qwen2ForCausalLM(cfg), lora)
    x = torch.randint(0, 256, (5, 80))
    rows = [[(b, j) for j in range(80)] for b in range(5)]
    up = torch.randn(5, 80, 256, generator=torch.Generator().manual_seed(0))
    tmp = Path(tempfile.mkdtemp())

    def plain() -> None:
        m.zero_grad(set_to_none=True)
        m(input_ids=x).logits.backward(up)

    def captured(backward: bool) -> None:
        m.zero_grad(set_to_none=True)
        with dmlib.capture(m, tmp / "c", row_map=rows, overwrite=True, backward=backward,
                           grad_seed=0) as rec:  # fmt: skip
            out = m(input_ids=x).logits
            if backward:
                rec.backward(out)
            else:
                out.backward(up)

    variants = {"plain": plain, "capture_bw": lambda: captured(True),
                "capture_fw": lambda: captured(False)}  # fmt: skip
    for f in variants.values():  # warm up: imports, first-call costs
        f()
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(args.n):
        for k, f in variants.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    out = {
        k: {"median_ms": round(med[k] * 1e3, 2), "best_ms": round(best[k] * 1e3, 2),
            "ratio": round(med[k] / med["plain"], 2),
            "best_ratio": round(best[k] / best["plain"], 2)}
        for k in variants
    }  # fmt: skip
    print(json.dumps({"n": args.n, "threads": args.threads, "variants": out}, indent=1))


if __name__ == "__main__":
    main()
