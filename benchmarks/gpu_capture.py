"""Capture on a GPU: outputs unchanged, same-layout repeats, packed vs alone, overhead.

A check for machines with CUDA (it falls back to the CPU so it can be smoke-tested
anywhere): a MiniLM-architecture encoder with seeded random weights (the real weights
are not needed to exercise capture and kernels) runs one request alone, again, padded
and co-packed, in float32 and bfloat16, under :func:`dmlib.capture`; the captures are
compared with :func:`dmlib.compare_captures`, and the forward pass is timed with no
capture, hashes only, and full dumps.

    python -m benchmarks.gpu_capture --config CONFIG_JSON --tokenizer TOKENIZER_JSON --out DIR
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

PROBE = "The quick brown fox jumps over the lazy dog near the quiet river bank at dawn."
OTHERS = [
    "A short one.",
    "Numerical reproducibility means two runs that should agree do agree, bit for bit, "
    "across processes, machines and batch layouts, which is harder than it sounds.",
    "Padding rows are masked out of attention.",
]


def main(argv: list[str] | None = None) -> int:
    import torch
    from tokenizers import Tokenizer

    import dmlib
    from dmlib.lab.minilm import Config, MiniLM
    from dmlib.lab.packed import row_map

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    out = Path(args.out)
    work = out / "captures"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = Tokenizer.from_file(args.tokenizer)
    tok.no_padding()

    def batch(texts: list[str], pad_to: int | None = None) -> dict[str, torch.Tensor]:
        enc = tok.encode_batch(texts)
        width = max(len(e.ids) for e in enc) if pad_to is None else pad_to
        ids = torch.zeros((len(enc), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, e in enumerate(enc):
            ids[i, : len(e.ids)] = torch.tensor(e.ids)
            mask[i, : len(e.ids)] = 1
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}

    layouts = {
        "alone": ([PROBE], 0, None),
        "alone_repeat": ([PROBE], 0, None),
        "padded": ([PROBE], 0, 128),
        "packed": ([OTHERS[0], PROBE, OTHERS[1], OTHERS[2]], 1, None),
        "packed_repeat": ([OTHERS[0], PROBE, OTHERS[1], OTHERS[2]], 1, None),
    }
    torch.manual_seed(0)
    cfg = Config(json.loads(Path(args.config).read_text()))
    base = MiniLM(cfg).eval()
    report: dict = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    for dtype in (torch.float32, torch.bfloat16):
        model = MiniLM(cfg).eval()
        model.load_state_dict(base.state_dict())
        model = model.to(device=device, dtype=dtype)
        tag = str(dtype).removeprefix("torch.")
        res: dict = {}
        for name, (texts, probe, pad_to) in layouts.items():
            b = {k: v.to(device) for k, v in batch(texts, pad_to).items()}
            rows = row_map(b["attention_mask"].cpu(), probe)
            with torch.no_grad():
                plain = model(**b)
                with dmlib.capture(model, work / f"{tag}_{name}", modules="*", row_map=rows, block_rows=8,
                                   dump=["embeddings", "encoder.layer.0.attention.self"], dump_requests=["probe"]):  # fmt: skip
                    captured = model(**b)
            same = torch.equal(
                plain.contiguous().view(torch.uint8), captured.contiguous().view(torch.uint8)
            )
            res.setdefault("outputs_unchanged_by_capture", {})[name] = bool(same)
            schemes = sorted({x.hash for x in dmlib.open_capture(work / f"{tag}_{name}")})
            res.setdefault("hash_schemes", {})[name] = schemes  # cksum4-v1: hashed on the device
        for other in ("padded", "packed"):
            df = dmlib.compare_captures(
                work / f"{tag}_alone",
                work / f"{tag}_{other}",
                request="probe",
                repeat=work / f"{tag}_alone_repeat",
            )
            diff = df[df["identical"].eq(False).fillna(False).astype(bool)]
            res[f"alone_vs_{other}"] = {
                "first_divergent_boundary": df.attrs.get("first_divergent_boundary"),
                "culprits": df.attrs.get("culprits") or df.attrs.get("culprit"),
                "valid": df.attrs.get("valid"),
                "repeat_control": str(df.attrs.get("repeat_control")),
                "n_boundaries": int(len(df)),
                "n_differing": int(len(diff)),
                "max_rel_fro": float(df["rel_fro"].max()) if df["rel_fro"].notna().any() else None,
            }
        rep = dmlib.compare_captures(
            work / f"{tag}_packed", work / f"{tag}_packed_repeat", request="probe"
        )
        res["packed_repeat_differing_boundaries"] = int(
            rep["identical"].eq(False).fillna(False).sum()
        )
        res["packed_repeat_first_divergent"] = rep.attrs.get("first_divergent_boundary")
        report[tag] = res
    # overhead, float32, the packed batch
    model = base.to(device)
    b = {k: v.to(device) for k, v in batch(layouts["packed"][0]).items()}
    rows = row_map(b["attention_mask"].cpu(), 1)

    def timed(fn) -> float:
        times = []
        for _ in range(args.repeats):
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:])

    def run(dump):
        path = work / "timing"
        shutil.rmtree(path, ignore_errors=True)
        with (
            torch.no_grad(),
            dmlib.capture(model, path, modules="*", row_map=rows, block_rows=8, dump=dump),
        ):
            model(**b)

    with torch.no_grad():
        t_plain = timed(lambda: model(**b))
    t_hash = timed(lambda: run(None))
    t_dump = timed(lambda: run("*"))
    report["overhead_float32_packed"] = {
        "no_capture_ms": t_plain * 1e3,
        "hash_only_ms": t_hash * 1e3,
        "full_dump_ms": t_dump * 1e3,
        "hash_only_ratio": t_hash / t_plain,
        "full_dump_ratio": t_dump / t_plain,
    }
    shutil.rmtree(work, ignore_errors=True)
    (out / "gpu_capture.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
