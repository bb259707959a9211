"""Reading an Orbax checkpoint (OCDBT + zarr v2, zstd) against the same values in ``.npz``.

tensorstore writes an Orbax-style item folder (``_METADATA``, ``manifest.ocdbt``, data
files; zstd level 1 as orbax-checkpoint does; every array in 2 chunks, as an array
sharded over two devices is) holding ``--size-mib`` of float32 values, and numpy writes
the same values to an uncompressed ``.npz``. Each reader then runs once in its own child
process (time from spawn to exit, peak RSS, CPU seconds) on a warm page cache: open the
checkpoint with dmlib and load every tensor (every page of an ``.npz`` tensor is touched:
its arrays are memory maps), and, for reference, tensorstore reading the Orbax folder.

    python -m benchmarks.bench_orbax [--size-mib 1024] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

from benchmarks._proc import run_cpu

HERE = Path(__file__).resolve().parent
WORK = HERE / "_work_orbax"
RESULTS = HERE / "results" / "orbax.json"
N_ARRAYS = 16


def _child(kind: str, path: str) -> None:
    if kind == "tensorstore":
        import tensorstore as ts

        kv = {"driver": "ocdbt", "base": f"file://{path}/"}
        names = json.loads((Path(path) / "_METADATA").read_text())["tree_metadata"]
        for key in names:
            name = ".".join(k["key"] for k in names[key]["key_metadata"])
            spec = {"driver": "zarr", "kvstore": dict(kv, path=f"{name}/")}
            ts.open(spec).result().read().result()
        return
    import dmlib

    with dmlib.open_tensors(path) as tset:
        for t in tset.values():
            raw = t.raw()
            int(raw[::4096].sum())  # touch every page (npz tensors are memory maps)


def _write(size_mib: int) -> tuple[Path, Path]:
    import tensorstore as ts

    if WORK.exists():
        shutil.rmtree(WORK)
    item = WORK / "10" / "default"
    item.mkdir(parents=True)
    rows = max(2, (size_mib << 20) // (4 * 1024 * N_ARRAYS))
    rows -= rows % 2
    rng = np.random.default_rng(0)
    arrays = {
        f"params.layer{i}.kernel": rng.standard_normal((rows, 1024), np.float32)
        for i in range(N_ARRAYS)
    }
    tree = {}
    for name, a in arrays.items():
        kv = {"driver": "ocdbt", "base": f"file://{item}/", "path": f"{name}/",
              "config": {"max_inline_value_bytes": 1024}}  # fmt: skip
        meta = {"shape": list(a.shape), "chunks": [rows // 2, 1024], "dtype": "<f4",
                "compressor": {"id": "zstd", "level": 1}}  # fmt: skip
        ts.open({"driver": "zarr", "kvstore": kv, "metadata": meta, "create": True}).result().write(
            a
        ).result()
        keys = name.split(".")
        tree[str(tuple(keys))] = {
            "key_metadata": [{"key": k, "key_type": 2} for k in keys],
            "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False},
        }
    (item / "_METADATA").write_text(json.dumps({"tree_metadata": tree}))
    (WORK / "10" / "_CHECKPOINT_METADATA").write_text("{}")
    npz = WORK / "same.npz"
    np.savez(npz, **arrays)
    return WORK / "10", npz


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size-mib", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="64 MiB: a smoke test")
    args = p.parse_args(argv)
    size = 64 if args.quick else args.size_mib
    step, npz = _write(size)
    orbax_bytes = sum(f.stat().st_size for f in step.rglob("*") if f.is_file())
    me = [sys.executable, "-m", "benchmarks.bench_orbax", "--child"]
    res = {}
    for kind, path in (("npz", npz), ("orbax", step), ("tensorstore", step / "default")):
        dt, rss, cpu = run_cpu([*me, kind, str(path)], ok=(0,), cwd=HERE.parent)
        res[kind] = {"seconds": round(dt, 3), "peak_rss_mib": round(rss, 1), "cpu_s": round(cpu, 3)}
        print(f"{kind:12s} {dt:7.2f} s  {cpu:7.2f} cpu-s  peak RSS {rss:8.1f} MiB", flush=True)
    doc = {
        "size_mib": size,
        "orbax_bytes_on_disk": orbax_bytes,
        "npz_bytes": npz.stat().st_size,
        "runs": res,
        "orbax_over_npz": round(res["orbax"]["seconds"] / res["npz"]["seconds"], 2),
        "orbax_over_tensorstore": round(res["orbax"]["seconds"] / res["tensorstore"]["seconds"], 2),
    }
    print(f"orbax/npz {doc['orbax_over_npz']}x, orbax/tensorstore {doc['orbax_over_tensorstore']}x")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    shutil.rmtree(WORK)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main())
