"""engine="local" vs engine="dask" on a 2-process LocalCluster, and the figures docs/scale.md uses.

A sharded pair (``*.safetensors.index.json`` + 4 shards per checkpoint, float32, ~15 % of
elements 1-2 ULP apart in the second checkpoint) is compared by the local engine and on a
LocalCluster of 2 worker processes (1 thread each) started once before timing; runs
interleaved, best of N, rows checked equal. Then the inputs of the paper estimate:

- per-core throughput of one piece task (:func:`dmlib.engine.pieces.compare_piece` on one
  64 MiB piece pair, in this process): identical and differing bytes, GB/s of input;
- Dask's per-task overhead: wall time per task of 2,000 trivial tasks on the cluster.

On this 2-core machine shared with other work, expect no speed-up: the point is that the
overhead is small. Files under benchmarks/_work_dask/, deleted at the end.

    python -m benchmarks.bench_dask [--size-mib 1024] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
WORK = HERE / "_work_dask"
RESULTS = HERE / "results" / "dask.json"
SHARDS = 4


def write_sharded(folder: Path, nbytes: int, seed: int, moved: bool) -> Path:
    """A sharded safetensors checkpoint of SHARDS shards x 4 tensors of float32."""
    import dmlib

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    mv = np.random.default_rng(seed + 1000)  # moves drawn apart: a and b share the base values
    per = nbytes // (SHARDS * 4) // 4
    wmap = {}
    for s in range(SHARDS):
        tensors = {}
        for t in range(4):
            x = rng.standard_normal(per, dtype=np.float32)
            if moved:
                m = mv.random(per, dtype=np.float32) < 0.15
                x.view(np.uint32)[m] += mv.integers(1, 3, int(m.sum()), dtype=np.uint32)
            tensors[f"layers.{s}.w{t}"] = x
        name = f"model-{s:05d}-of-{SHARDS:05d}.safetensors"
        dmlib.write_safetensors(folder / name, tensors)
        wmap.update({k: name for k in tensors})
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size-mib", type=int, default=1024, help="size of each checkpoint")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    size = (16 << 20) if args.quick else args.size_mib << 20
    repeat = 1 if args.quick else args.repeat

    import dask
    import distributed

    import dmlib
    from dmlib import hashing
    from dmlib.engine import pieces as P

    result: dict = {"size_bytes": size, "repeat": repeat, "loadavg_before": os.getloadavg()}
    import shutil

    try:
        ia = write_sharded(WORK / "a", size, seed=1, moved=False)
        ib = write_sharded(WORK / "b", size, seed=1, moved=True)
        t0 = time.perf_counter()
        cluster = distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0"
        )
        client = distributed.Client(cluster)
        result["cluster_start_seconds"] = time.perf_counter() - t0
        try:
            times: dict[str, list[float]] = {"local": [], "dask": []}
            frames = {}
            for _ in range(repeat):
                for engine in ("local", "dask"):
                    t = time.perf_counter()
                    frames[engine] = dmlib.compare(str(ia), str(ib), engine=engine, progress=False)
                    times[engine].append(time.perf_counter() - t)
            import pandas as pd

            pd.testing.assert_frame_equal(frames["dask"], frames["local"], check_exact=True)
            result["compare"] = {k: {"best_seconds": min(v), "runs": v} for k, v in times.items()}
            # Dask's per-task overhead on this cluster
            n = 200 if args.quick else 2000
            t = time.perf_counter()
            dask.compute(*[dask.delayed(int, pure=False)(i) for i in range(n)])
            result["dask_seconds_per_task"] = (time.perf_counter() - t) / n
        finally:
            client.close()
            cluster.close()
        # per-core throughput of one piece task, in this process (no Dask)
        with dmlib.open_tensors(ia) as sa, dmlib.open_tensors(ib) as sb:
            from dmlib.engine.dask import side_of

            name = next(iter(sa))
            ta, tb = sa[name], sb[name]
            n = min(hashing.PIECE, ta.nbytes)
            for label, other in (("identical", ta), ("differing", tb)):
                spec = P.PieceSpec(
                    side_of(ta), side_of(other), 0, n, "float", "float32", 4 << 20, hashing.BLAKE3
                )
                P.compare_piece(spec)  # page cache warm
                best = min(
                    (lambda t: (P.compare_piece(spec), time.perf_counter() - t)[1])(
                        time.perf_counter()
                    )
                    for _ in range(repeat)
                )
                result[f"piece_gbps_{label}"] = 2 * n / best / 1e9  # both sides read
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    result["loadavg_after"] = os.getloadavg()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    c = result["compare"]
    print(
        f"sharded pair, {size >> 20} MiB per checkpoint ({SHARDS} shards), best of {repeat}"
        f"{' (QUICK: not a measurement)' if args.quick else ''}"
    )
    print(f"local engine                 {c['local']['best_seconds']:8.3f} s")
    print(
        f"dask, LocalCluster 2 procs   {c['dask']['best_seconds']:8.3f} s   "
        f"ratio {c['dask']['best_seconds'] / c['local']['best_seconds']:.2f}x (rows identical)"
    )
    print(
        f"cluster start-up             {result['cluster_start_seconds']:8.3f} s (not in the ratio)"
    )
    print(f"dask per-task overhead       {result['dask_seconds_per_task'] * 1e3:8.3f} ms")
    print(
        f"one piece task, per core     {result['piece_gbps_identical']:8.2f} GB/s identical, "
        f"{result['piece_gbps_differing']:.2f} GB/s differing (input bytes, both sides)"
    )
    la, lb = result["loadavg_before"][0], result["loadavg_after"][0]
    print(
        f"load average before/after: {la:.1f} / {lb:.1f} (a shared machine: ratios, not absolutes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
