"""Cost of dmlib.capture with states and routing on a tiny hybrid MoE, against a plain forward.

A tiny random-init ``Qwen3NextForCausalLM`` from its config (one torch thread) (3 Gated DeltaNet layers on
the torch fallback, 1 attention layer, 4 experts top-2), float32 on the CPU, a batch of
3 x 24 tokens with ``use_cache=True`` (so the forward leaves a cache: 3 conv and 3
recurrent states, 1 layer of keys and values). Variants, timed alternately ``--n`` times
(median and best reported; wall clock around ``with capture(...): model(**batch)``,
manifest written included):

- ``plain``: ``model(**batch)`` under ``torch.no_grad()``;
- ``capture``: the default modules, hashes only: module boundaries, the states of the
  cache after the pass (kind ``state``) and the routers' decisions (kind ``router``,
  their two tensors dumped per call).
- ``experts``: the same with ``experts=True``: each expert's gate_up_proj / down_proj
  rows per routed token (kind ``expert``; the experts modules hooked too), every torch
  call inside an experts module passing experts.py's TorchFunctionMode.

Target: ``capture <= 2x`` plain (medians); ``experts`` has none yet (its ratio reported).

    python -m benchmarks.bench_capture_hybrid [--n 15]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def build():
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        max_position_embeddings=128,
    )  # fmt: skip
    model = transformers.Qwen3NextForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "use_cache": True}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()
    import torch

    import dmlib

    # one thread: on a shared machine torch's thread pool makes the forward's own time swing
    # several-fold from run to run, more than the capture costs
    torch.set_num_threads(1)
    model, batch = build()
    rows = [[(b, j) for j in range(24)] for b in range(3)]
    work = Path(tempfile.mkdtemp())
    times: dict[str, list[float]] = {"plain": [], "capture": [], "experts": []}
    n_states = n_routers = n_experts = 0
    with torch.no_grad():
        model(**batch)  # warm-up: the torch fallback's first call
        for i in range(args.n + 1):
            t0 = time.perf_counter()
            model(**batch)
            plain = time.perf_counter() - t0
            path = work / f"c{i}"
            t0 = time.perf_counter()
            with dmlib.capture(model, path, row_map=rows):
                model(**batch)
            cap = time.perf_counter() - t0
            c = dmlib.open_capture(path)
            n_states = sum(b.state for b in c)
            n_routers = sum(b.router for b in c)
            shutil.rmtree(path)
            t0 = time.perf_counter()
            with dmlib.capture(model, path, row_map=rows, experts=True):
                model(**batch)
            exp = time.perf_counter() - t0
            n_experts = sum(b.expert is not None for b in dmlib.open_capture(path))
            shutil.rmtree(path)
            if i:  # the first capture imports the capture's rooms
                times["plain"].append(plain)
                times["capture"].append(cap)
                times["experts"].append(exp)
    shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    out = {
        "n": args.n, "plain_ms": med["plain"] * 1e3, "capture_ms": med["capture"] * 1e3,
        "ratio": med["capture"] / med["plain"], "best_ratio": best["capture"] / best["plain"],
        "state_boundaries": n_states, "router_boundaries": n_routers,
        "experts_ms": med["experts"] * 1e3, "experts_ratio": med["experts"] / med["plain"],
        "experts_best_ratio": best["experts"] / best["plain"], "expert_boundaries": n_experts,
    }  # fmt: skip
    print(json.dumps(out, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
