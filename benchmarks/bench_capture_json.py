"""Two compiled pieces of the capture weighed against their alternatives, in one process.

1. The manifest's JSON: the compiled writer (``jsonenc.compact_lines``, written for the
   capture) against orjson (``orjson.dumps`` per boundary, joined as the manifest joins
   them) and the json module's encoder (the fallback where nothing is compiled).
2. XXH3-128: called directly by the compiled loop through the xxhash package's exported
   function (``use_xxh3``, a ``dlsym``) against one Python call per digest (the compiled
   loop calling ``xxhash.xxh3_128_digest``, as it does where the direct call is refused).

On two captures of ``bench_capture_hf``'s Llama configs, batch 5 x 80, f32 CPU: the ops
capture of the tiny one (``ops=True`` on ``model.layers.0``) and the default capture of
the hidden-512 one. For each: the writer alone on the capture's boundaries (median of
``--n-writer`` calls), then whole captures (forward, hooks, hashing, the manifest written)
with each alternative, interleaved run by run with a plain forward, median of ``--n``
(ratios to the plain forward's median). orjson's text is also compared with today's.

    python -m benchmarks.bench_capture_json [--n 21] [--n-writer 200]
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_capture_hf import build


def _orjson_lines(items: list[Any]) -> str:
    import orjson

    return b",\n".join(map(orjson.dumps, items)).decode()


def _json_lines(items: list[Any]) -> str:
    enc = json.JSONEncoder(separators=(",", ":"))
    return ",\n".join(map(enc.encode, items))


def _median_ms(fn: Any, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _writers(boundaries: list[Any], n: int) -> dict[str, Any]:
    from dmlib.localize.capture import jsonenc

    ours = jsonenc.compact_lines(boundaries)
    out: dict[str, Any] = {
        "boundaries": len(boundaries),
        "bytes": len(ours or ""),
        "compiled_ms": _median_ms(lambda: jsonenc.compact_lines(boundaries), n),
        "orjson_ms": _median_ms(lambda: _orjson_lines(boundaries), n),
        "json_module_ms": _median_ms(lambda: _json_lines(boundaries), n),
        "orjson_same_text": _orjson_lines(boundaries) == ours,
    }
    return out


def _capture_runs(model: Any, work: Path, kw: dict[str, Any], n: int) -> dict[str, Any]:
    """Whole captures with each alternative, interleaved with a plain forward."""
    import torch
    import xxhash

    import dmlib
    from dmlib.localize.capture import jsonenc, recorder

    x = torch.randint(0, 256, (5, 80), generator=torch.Generator().manual_seed(1))
    rows = [[(b, j) for j in range(80)] for b in range(5)]
    real_lines, real_args = jsonenc.compact_lines, recorder._tree_args

    def python_xxh3(scheme: str) -> Any:
        _, tag, piece, size = real_args(scheme)  # a partial: a new object, called per digest
        return functools.partial(xxhash.xxh3_128_digest), tag, piece, size

    def cap(lines: Any = real_lines, args: Any = real_args) -> Any:
        def go() -> None:
            jsonenc.compact_lines, recorder._tree_args = lines, args
            try:
                with dmlib.capture(model, work / "c", row_map=rows, overwrite=True, **kw):
                    model(input_ids=x)
            finally:
                jsonenc.compact_lines, recorder._tree_args = real_lines, real_args

        return go

    variants = {
        "plain": lambda: model(input_ids=x),
        "capture": cap(),
        "capture_orjson": cap(lines=_orjson_lines),
        "capture_python_xxh3": cap(args=python_xxh3),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        for fn in variants.values():
            fn()
        for _ in range(n):
            for k, fn in variants.items():
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
    plain = statistics.median(times["plain"])
    return {k: {"median_ms": statistics.median(v) * 1e3,
                "ratio": statistics.median(v) / plain} for k, v in times.items()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=21, help="whole captures per variant")
    p.add_argument("--n-writer", type=int, default=200, help="writer calls per writer")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args(argv)
    import torch

    import dmlib

    torch.set_num_threads(args.threads)
    cases = {
        "tiny_ops_layer": ("tiny", {"ops": True, "op_modules": "model.layers.0"}),
        "h512_capture": ("h512", {}),
    }
    report: dict[str, Any] = {}
    work = Path(tempfile.mkdtemp(prefix="dmlib-bench-json-"))
    try:
        for case, (config, kw) in cases.items():
            model = build(config)
            x = torch.randint(0, 256, (5, 80), generator=torch.Generator().manual_seed(1))
            rows = [[(b, j) for j in range(80)] for b in range(5)]
            with torch.no_grad(), dmlib.capture(model, work / "w", row_map=rows,
                                                overwrite=True, **kw) as rec:  # fmt: skip
                model(input_ids=x)
            report[case] = {"writer": _writers(rec.boundaries, args.n_writer),
                            "capture": _capture_runs(model, work, kw, args.n)}  # fmt: skip
            print(case, json.dumps(report[case]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
