"""``dmlib inspect PATH``: format, layout, tensor table and padding census of one file."""

from __future__ import annotations

import argparse
import sys

from dmlib.cli._common import ONE_DOCUMENT, add_common, print_json
from dmlib.cli._table import table
from dmlib.textsafe import shown


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``inspect``."""
    p = sub.add_parser(
        "inspect",
        help="show a checkpoint's format, layout, tensors and padding",
        description="Show a checkpoint's format, layout (data base, records), a table of its "
        "tensors (name, dtype, shape, numel, offset, param_id, data hash) and, for burnpack "
        "files, the padding census.",
    )
    p.add_argument(
        "path",
        help="checkpoint file (burnpack, safetensors, .npy/.npz, torch, flax msgpack) or "
        "folder (DCP, Orbax step or item)",
    )
    p.add_argument(
        "--no-hash", action="store_true", help="skip per-tensor data hashes (faster on big files)"
    )
    add_common(p, json=ONE_DOCUMENT, format=True)
    p.set_defaults(func=run)


def _print_table(rows: list[dict], cols: list[str], out) -> None:
    print(table(rows, cols, cell=lambda v: "" if v is None else shown(v)), file=out)


def _pairs(table: dict, limit: int = 50) -> str:
    """``k=v, ...`` with keys and values escaped and cut; past ``limit`` entries, a count."""
    items = list(table.items())
    text = ", ".join(f"{shown(k)}={shown(v)}" for k, v in items[:limit])
    return text + (f", ... ({len(items) - limit:,} more)" if len(items) > limit else "")


def _print_arrays(lay: dict, out) -> None:
    """An Orbax item's arrays: zarr version, chunk shape, chunk grid, compression."""
    rows = [
        {
            "array": shown(name),
            "zarr": a.get("zarr_format"),
            "chunks": "x".join(map(str, a.get("chunks", []))) or "scalar",
            "grid": "x".join(map(str, a.get("grid", []))) or "1",
            "inner_chunks": "x".join(map(str, a.get("inner_chunks", []))),
            "compression": a.get("compressor"),
        }
        for name, a in lay["arrays"].items()
    ]
    _print_table(rows, ["array", "zarr", "chunks", "grid", "inner_chunks", "compression"], out)
    for name, vtype in (lay.get("not_read") or {}).items():
        print(f"not read: {ascii(name)} ({ascii(vtype)}, not an array)", file=out)
    print(file=out)


def run(args: argparse.Namespace) -> int:
    """``dmlib inspect PATH``: format, layout, tensor table, padding census."""
    from dmlib.inspect_ import describe

    doc = describe(args.path, format=args.format, hashes=not args.no_hash)
    out = sys.stdout
    if args.json:
        print_json(doc)
        return 0
    print(
        f"{shown(doc['path'])}: {doc['format']}, {doc['n_tensors']} tensors, {doc['numel']} elements",
        file=out,
    )
    if doc.get("role"):  # what the file is (a Trainer RNG state, an optimizer state...)
        print(f"what it is: {doc['role']['text']}", file=out)
    for name, text in (doc.get("files") or {}).items():
        print(f"  {shown(name)}: {text}", file=out)
    if doc.get("role", {}) and doc["role"]["kind"] == "training_args":
        return 0
    lay = doc["layout"]
    if doc["records"]:
        for r in doc["records"]:
            print(
                f"record {r['record']}: bytes [{r['start']}, {r['end']}), data base {r['data_base']}, "
                f"{r['layout']} layout, {r['n_tensors']} tensors",
                file=out,
            )
    elif lay:
        plain = {k: v for k, v in lay.items() if k not in ("arrays", "not_read", "items")}
        print("layout: " + _pairs(plain), file=out)
    if isinstance(lay.get("arrays"), dict):  # Orbax: per array, its zarr chunking
        _print_arrays(lay, out)
    if doc["metadata"]:
        print("metadata: " + _pairs(doc["metadata"]), file=out)
    if doc["scalars"]:
        print("scalars: " + _pairs(doc["scalars"]), file=out)
    if doc["file_hash"]:
        print(f"file_hash {doc['file_hash']}\ndata_hash {doc['data_hash']}", file=out)
    print(file=out)
    rows = [
        dict(
            t,
            shape="x".join(map(str, t["shape"])) or "scalar",
            data_hash=(t["data_hash"] or "")[:16],
        )
        for t in doc["tensors"]
    ]
    cols = ["name", "dtype", "shape", "numel", "offset", "param_id", "data_hash"]
    if any(t["record"] for t in doc["tensors"]):
        cols.insert(0, "record")
    _print_table(rows, cols, out)
    if "padding" in doc:
        print(file=out)
        for s in doc["padding"]["slots"]:
            print(
                f"record {s['record']} slots: flat {s['flat_slots']} = named {s['named_slots']} + padding "
                f"{s['padding_slots']} ({s['padding_nonzero_slots']} non-zero, {s['nan']} NaN, {s['huge']} |v|>=1e30)",
                file=out,
            )
        dirty = [g for g in doc["padding"]["gaps"] if not g["zero"]]
        print(f"padding: {len(doc['padding']['gaps'])} gaps, {len(dirty)} not zero", file=out)
        if dirty:
            _print_table(
                dirty,
                ["record", "kind", "start", "end", "nbytes", "nonzero_bytes", "nan", "huge"],
                out,
            )
    return 0
