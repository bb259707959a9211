"""``dmlib map suggest A B --out MAP.toml``: propose a mapping between converted checkpoints."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from dmlib.cli import add_common_epilog
from dmlib.cli._table import add_format
from dmlib.errors import DmlibError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "map",
        help="mappings between checkpoints whose names and layouts differ",
        description="Work with mapping files (docs/mapping.md), which `dmlib compare A B --map "
        "MAP.toml` compares through.",
    )
    add_common_epilog(p)
    inner = p.add_subparsers(dest="map_command", metavar="SUBCOMMAND", parser_class=type(p))
    s = inner.add_parser(
        "suggest",
        help="propose a mapping from A's tensors to B's, from their values",
        description="Propose a mapping from A (source) to B (target) by matching shapes and "
        "value fingerprints that a layout change preserves (sorted values, value sets), each "
        "rule confirmed element by element, with a comment saying how sure it is. Exit 2 "
        "(after writing what was found) when some tensors could not be placed: they are named.",
    )
    s.add_argument("a", help="source checkpoint (a file, a directory or FILE,FILE of rank files)")
    s.add_argument("b", help="target checkpoint")
    s.add_argument("--out", required=True, metavar="MAP.toml", help="where to write the mapping")
    s.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    add_format(s)
    add_common_epilog(s)
    s.set_defaults(func=run_suggest, command="map")
    p.set_defaults(func=_no_sub, command="map")


def _no_sub(args: argparse.Namespace) -> int:
    print("dmlib map: error: a subcommand is needed: suggest", file=sys.stderr)
    return 2


def side(text: str) -> str | list[str]:
    """A command-line side: ``FILE,FILE`` is a list of rank files read as one side."""
    if "," in text and not os.path.exists(text):
        return [p for p in text.split(",") if p]
    return text


def run_suggest(args: argparse.Namespace) -> int:
    from dmlib._atomic import atomic_write_text
    from dmlib.mapping.spec import to_toml
    from dmlib.mapping.suggest import suggest

    out = args.out
    if os.path.isdir(out):
        raise DmlibError("is a directory; --out names the mapping file to write", path=out)
    if os.path.lexists(out) and not args.force:
        raise DmlibError("exists already; pass --force to overwrite it", path=out)
    for p in (args.a, args.b):
        for one in side(p) if isinstance(side(p), list) else [p]:
            if os.path.abspath(one) == os.path.abspath(out):
                raise DmlibError("--out would overwrite an input", path=out)
    res = suggest(side(args.a), side(args.b))
    header = (
        f"dmlib map suggest\nsource (A): {args.a}\ntarget (B): {args.b}\n"
        "Each rule was confirmed on the values; read the confidence above it."
    )
    if res.unplaced_a or res.unplaced_b:
        header += "\nNot placed (map them, or list them in ignore_a / ignore_b):"
        header += "".join(f"\n  A: {n}" for n in res.unplaced_a)
        header += "".join(f"\n  B: {n}" for n in res.unplaced_b)
    atomic_write_text(out, to_toml(res.mapping, header))
    say(f"wrote {out}: {len(res.mapping.rules)} rules")
    if res.unplaced_a or res.unplaced_b:
        names = [f"A:{n}" for n in res.unplaced_a] + [f"B:{n}" for n in res.unplaced_b]
        shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        say(f"dmlib map: error: could not place {len(names)} tensor(s): {shown}", file=sys.stderr)
        return 2
    return 0


_MAPPED_TABLE = [
    "name",
    "dtype",
    "n_diff",
    "max_ulp",
    "rel_fro",
    "first_diff_target",
    "first_diff_source",
]


def say(text: str, file: Any = None) -> None:
    """Print ``text`` with every non-printable character of the data escaped, line by line."""
    from dmlib.mapping.spec import printable

    print("\n".join(printable(ln) for ln in str(text).split("\n")), file=file)


def run_mapped(args: argparse.Namespace, hash_name: str) -> int:
    """``dmlib compare A B --map MAP.toml``: rows in B's names, differences traced to A."""
    import json

    from dmlib._json import jsonable
    from dmlib.cli._table import table
    from dmlib.stats.compare import compare_records, summarize_records

    if args.rename:
        raise DmlibError("--map names the tensors: it does not combine with --rename")
    if args.file_hashes or getattr(args, "dask", None):
        raise DmlibError("--map compares on this machine, without --file-hashes")
    rows, at = compare_records(
        side(args.a), side(args.b),  # type: ignore[arg-type]  # (a list: rank files) include=args.include, exclude=args.exclude,
        cross_dtype=args.cross_dtype, hash=hash_name, mapping=args.map,
    )  # fmt: skip
    s = summarize_records(rows, at)
    if args.json:
        print(
            json.dumps(jsonable({"summary": s, "attrs": at, "rows": rows}, default=str), indent=1)
        )
        return 0 if s else 1
    shown = rows if args.all else [r for r in rows if r["n_diff"] > 0]
    if shown:
        say(table(shown, _MAPPED_TABLE))
    for name, found in at["located"].items():
        for f in found[1:]:
            say(f"  also differs: {f['target']} <- {f['source']}")
        if found:
            row = next(r for r in rows if r["name"] == name)
            say(f"{name}: via {row['transform']} from {row['source']}")
    for key in ("only_in_a", "only_in_b"):
        if at[key]:
            say(f"{key} (ignored by the mapping, not compared): {', '.join(at[key])}")
    for m in at["mismatched"]:
        say(
            f"mismatched: {m['name']} <- {', '.join(m['source'])} via {m['transform']}: "
            f"{m['dtype_a']}{m['shape_a']} vs {m['dtype_b']}{m['shape_b']} (not compared)"
        )
    say(str(s))
    return 0 if s else 1
