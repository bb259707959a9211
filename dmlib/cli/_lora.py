"""``dmlib compare`` on LoRA adapters: two adapters by the weight they add (the default when
both sides are adapters; ``--raw`` compares the stored factors), and ``--adapter``: a
merged model checked against base + adapter. The library's :mod:`dmlib.forensics.lora`."""

from __future__ import annotations

import argparse
import os

from dmlib.cli._common import exit_code, print_json
from dmlib.cli._table import table

_ADAPTER_TABLE = ["target", "kind", "shape", "dtype", "scaling_a", "scaling_b", "rel_fro",
                  "max_abs", "max_ulp", "bound_ulp", "factor_n_diff", "status"]  # fmt: skip
_MERGE_TABLE = ["target", "weight", "dtype", "scaling", "max_abs", "max_ulp", "bound_ulp",
                "n_outside", "status"]  # fmt: skip


def add_options(p: argparse.ArgumentParser) -> None:
    """``--adapter`` and ``--raw`` of ``dmlib compare``."""
    p.add_argument(
        "--adapter",
        metavar="ADAPTER",
        help="A is a merged model, B its base: check that A equals B + scaling * lora_B @ "
        "lora_A for every target of this PEFT adapter (folder, or adapter_model.safetensors "
        "beside its adapter_config.json) within the rounding of one merge in A's dtype "
        "(reported in ULP of that dtype), and that every tensor the adapter does not touch "
        "is bit-identical (docs/adapters.md)",
    )
    p.add_argument(
        "--raw",
        action="store_true",
        help="two LoRA adapters: compare their stored factors tensor by tensor instead of "
        "the weight each target adds (scaling * B @ A, the default for two adapters)",
    )


def wants_adapters(args: argparse.Namespace) -> bool:
    """True when ``compare`` judges adapters: ``--adapter``, or two adapters without ``--raw``."""
    if getattr(args, "adapter", None):
        return True
    if getattr(args, "raw", False) or getattr(args, "map", None):
        return False
    if not all(_may_be_adapter(p) for p in (args.a, args.b)):
        return False  # two plain files: the usual comparison, no adapter reader imported
    from dmlib.io.hf_pretrained import is_adapter  # not pandas: compare starts without it

    return is_adapter(args.a) and is_adapter(args.b)


def _may_be_adapter(path: str) -> bool:
    """A folder, or a file named like PEFT's weights (``adapter_model.*``): worth asking."""
    return os.path.isdir(path) or os.path.basename(path).startswith("adapter_model")


def run(args: argparse.Namespace) -> int:
    """The adapter comparison or the merge check, printed; its exit status."""
    if args.adapter:
        return _merge(args)
    from dmlib.forensics.lora import compare_adapters

    df = compare_adapters(args.a, args.b)
    v = df.attrs["verdict"]
    rows = df.to_dict("records")
    groups = None
    if getattr(args, "group_l2", None):  # the stored tensors' global L2, as compare gives it
        from dmlib.cli import _groups

        groups = _groups.records(args.a, args.b, args.group_l2)
    if args.json:
        doc = {"mode": "adapter", "verdict": v, "rows": rows}
        print_json(doc if groups is None else {**doc, "group_l2": groups})
        return exit_code(v)
    listed = rows if args.all else [r for r in rows if r["status"] != "identical"]
    if listed:
        print(table(listed, _ADAPTER_TABLE))
    if groups is not None:
        from dmlib.cli import _groups

        print(_groups.lines(groups))
    print(v)
    return exit_code(v)


def _merge(args: argparse.Namespace) -> int:
    from dmlib.forensics.lora import check_merge

    df = check_merge(args.a, args.b, args.adapter)
    v = df.attrs["verdict"]
    rows = df.to_dict("records")
    if args.json:
        print_json({"mode": "merge", "verdict": v, "rows": rows,
                    "untouched": df.attrs["untouched"]})  # fmt: skip
        return exit_code(v)
    listed = rows if args.all else [r for r in rows if r["status"] != "within"]
    if listed:
        print(table(listed, _MERGE_TABLE))
    print(v)
    return exit_code(v)
