"""``dmlib map suggest A B --out MAP.toml``: propose a mapping between converted checkpoints."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from dmlib.cli._common import EXIT_BAD_INPUT, add_common, exit_code, print_json
from dmlib.errors import DmlibError


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``map`` and its subcommand ``suggest``."""
    p = sub.add_parser(
        "map",
        help="mappings between checkpoints whose names and layouts differ",
        description="Work with mapping files (docs/mapping.md), which `dmlib compare A B --map "
        "MAP.toml` compares through.",
    )
    add_common(p)
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
    add_common(s, format=True)
    s.set_defaults(func=run_suggest, command="map")
    p.set_defaults(func=_no_sub, command="map")


def _no_sub(args: argparse.Namespace) -> int:
    print("dmlib map: error: a subcommand is needed: suggest", file=sys.stderr)
    return EXIT_BAD_INPUT


def side(text: str) -> str | list[str]:
    """A command-line side: ``FILE,FILE`` is a list of rank files read as one side."""
    if "," in text and not os.path.exists(text):
        return [p for p in text.split(",") if p]
    return text


def run_suggest(args: argparse.Namespace) -> int:
    """``dmlib map suggest A B --out MAP.toml``: write a proposed mapping."""
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
        return EXIT_BAD_INPUT
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
        print_json({"summary": s, "attrs": at, "rows": rows})
        return exit_code(s)
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
    say(str(s))  # the Summary's one-line verdict
    return exit_code(s)


def add_run_maps(p: argparse.ArgumentParser) -> None:
    """``--map RUN=MAP.toml`` (repeatable): runs of a matrix or ladder seen through a mapping."""
    p.add_argument(
        "--map",
        action="append",
        metavar="RUN=MAP.toml",
        help="run RUN was converted to other names and layouts: compare it through the "
        "mapping file onto the reference's names (docs/mapping.md); repeatable",
    )


def run_maps(items: list[str] | None) -> dict[str, str] | None:
    """``{run: mapping file}`` from ``--map RUN=MAP.toml`` items (None without any)."""
    if not items:
        return None
    out: dict[str, str] = {}
    for item in items:
        run, sep, path = item.partition("=")
        if not sep or not run or not path:
            raise DmlibError(f"--map expects RUN=MAP.toml, got {item!r}")
        if run in out:
            raise DmlibError(f"--map: run {run!r} given twice")
        out[run] = path
    return out


#: located lines printed at most (``--json`` lists them all)
LOCATED_SHOWN = 20


def located_lines(records: list[dict[str, Any]]) -> list[str]:
    """One line per traced first difference of a pair with a mapped side.

    ``records``: ``{"pair", "name", "target", "source_a"/"source_b", "step"?}`` (a
    matrix's per-pair ``located`` or a ladder's ``attrs["located"]``), printed as
    ``located: [step S] A/B: NAME first differs at TARGET <- a SOURCE; b SOURCE``.
    """
    from dmlib.mapping.spec import printable

    lines = []
    for r in records[:LOCATED_SHOWN]:
        step = f"step {r['step']} " if r.get("step") is not None else ""
        sources = "; ".join(f"{side} {r[f'source_{side}']}" for side in ("a", "b")
                            if r.get(f"source_{side}"))  # fmt: skip
        lines.append(printable(f"located: {step}{r['pair']}: {r['name']} first differs at "
                               f"{r['target']}" + (f" <- {sources}" if sources else "")))  # fmt: skip
    if len(records) > LOCATED_SHOWN:
        lines.append(f"located: {len(records) - LOCATED_SHOWN} more (--json lists them all)")
    return lines


def mapped_notes(mapped: dict[str, Any]) -> list[str]:
    """One line per mapped run: its mapping, the run it maps onto, what it leaves out."""
    from dmlib.mapping.spec import printable

    lines = []
    for run, m in mapped.items():
        left = [f"not mapped from {run}: {', '.join(m['ignored_a'])}"] if m["ignored_a"] else []
        if m["ignored_b"]:
            left.append(f"absent from {run}: {', '.join(m['ignored_b'])}")
        lines.append(
            printable(
                f"note: run {run} seen through {m['path'] or 'its mapping'} onto the names of "
                f"{m['reference']} ({len(m['bindings'])} bindings)"
                + (f"; {'; '.join(left)}" if left else "")
            )
        )
    return lines
