"""``dmlib compare A B`` and ``dmlib matrix LABEL=PATH ...``: divergence tables and verdicts."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dmlib.cli._common import add_common, exit_code, print_json
from dmlib.cli._dask import engine as engine_of
from dmlib.cli._table import add_selection, labelled_paths, table
from dmlib.textsafe import names_list, shown

# columns of the readable table (the JSON output carries every column)
_TABLE = [
    "name",
    "dtype",
    "numel",
    "n_diff",
    "frac_diff",
    "max_abs",
    "max_ulp",
    "median_ulp",
    "rel_fro",
    "cosine",
    "first_diff",
]


def register(sub: argparse._SubParsersAction) -> None:
    """Add ``compare`` and ``matrix``."""
    _add_compare(sub)
    _add_matrix(sub)


def _add_compare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="compare the tensors of two checkpoints",
        description="Compare every tensor two checkpoints share: elements differing, max |a-b|, "
        "ULP distances, relative Frobenius error, cosine, first differing index. Prints the "
        "tensors that differ (--all: every tensor) and a summary line, which always says what "
        "was not compared (names only in A or B, dtype or shape mismatches). Patterns: with "
        "* ? [ a glob matched against the whole name, without them a substring of the name, "
        "re:REGEX a regular expression; an --include that matches no name is bad input "
        "(exit 2). Two files that share no name are bad input too, with the prefix mapping "
        "(--rename) that would pair them.",
    )
    p.add_argument("a", help="reference checkpoint")
    p.add_argument("b", help="checkpoint compared against it")
    add_selection(p)
    p.add_argument(
        "--rename",
        action="append",
        metavar="SIDE:OLD=NEW",
        help="map names before comparing: replace the prefix OLD by NEW in side a's or b's "
        "names, e.g. a:model.= strips 'model.' from A's names, b:=module. adds 'module.' to "
        "B's; SIDE:re:REGEX=REPL replaces every match of a regular expression (b:re:/=. turns "
        "B's '/' into '.'); applied before --include/--exclude; repeatable. Without it, '/' "
        "separators and JAX's trailing '.value' are mapped when one rule set alone pairs the names",
    )
    p.add_argument(
        "--cross-dtype",
        action="store_true",
        help="compare float tensors of different dtypes (f32 vs bf16...): the wider side is "
        "rounded to the narrower dtype (round to nearest, ties to even) and ULP are counted "
        "in the narrower dtype",
    )
    p.add_argument(
        "--map",
        metavar="MAP.toml",
        help="compare through a mapping file (docs/mapping.md): names and layouts differ "
        "(a converted checkpoint); A or B may then be a directory or FILE,FILE of rank files",
    )
    p.add_argument("--all", action="store_true", help="list identical tensors too")
    p.add_argument(
        "--file-hashes",
        action="store_true",
        help="also hash whole files and data sections (two more hash passes per file)",
    )
    _add_hash(p, "each tensor's bytes")
    from dmlib.cli._groups import add_group_l2
    from dmlib.cli._lora import add_options

    add_options(p)
    add_group_l2(p)
    add_common(p, json="print one JSON document (rows, summary, attrs)", format=True, dask=True)
    p.set_defaults(func=run_compare)


def _add_matrix(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser(
        "matrix",
        help="compare every pair of several runs and give the verdict",
        description="Compare every pair of runs (LABEL=PATH) and print one line per pair and the "
        "verdict: same-seed pairs' worst rel_fro and max ULP against the control's, their "
        "separation in orders of magnitude, bit-identical pairs, tensors that never differ. "
        "Exit status 0 only when every pair (the control's included) is bit-identical. Two "
        "runs that share no tensor name compare nothing: refused (exit 2) with the --rename "
        "that would pair them.",
    )
    m.add_argument("runs", nargs="+", metavar="LABEL=PATH", help="at least two runs")
    m.add_argument("--control", metavar="LABEL", help="the run expected to differ (another seed)")
    add_run_rename(m)
    add_selection(m)
    _add_hash(m, "every distinct content's bytes")
    from dmlib.cli.map import add_run_maps

    add_run_maps(m)
    from dmlib.cli._groups import add_group_l2

    add_group_l2(m)
    add_common(m, json="print one JSON document (verdict and every row)", format=True, dask=True)
    m.set_defaults(func=run_matrix)


RUN_RENAME_HELP = (
    "map one run's names before comparing, as study.toml's [names]: replace the prefix OLD "
    "by NEW in run RUN's names (seed1:model.= strips 'model.', seed1:=module. adds it); "
    "RUN:re:REGEX=REPL replaces every match; repeatable"
)


def add_run_rename(p: argparse.ArgumentParser) -> None:
    """``--rename RUN:OLD=NEW`` (repeatable): one run's names mapped, as ``[names]`` does."""
    p.add_argument(
        "--rename", action="append", default=None, metavar="RUN:OLD=NEW", help=RUN_RENAME_HELP
    )


def _add_hash(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--hash",
        choices=["blake3", "sha256", "none"],
        default=None,
        help=f"identity hash of {what}, printed as NAME:HEX: blake3 (fast) or sha256 (to "
        "check against published SHA-256 sums), or none. Default: blake3 with --json (or "
        "--file-hashes), none otherwise: no verdict rests on a reported hash, bytes are "
        "compared",
    )


def _hash_of(args: argparse.Namespace) -> str:
    """The scheme a command computes: the one asked for, else blake3 only where printed."""
    if args.hash:
        return str(args.hash)
    return "blake3" if args.json or getattr(args, "file_hashes", False) else "none"


def _is_dir(path: str) -> bool:
    import os

    return os.path.isdir(path)


def run_compare(args: argparse.Namespace) -> int:
    # plain records, not a DataFrame: the command starts without importing pandas
    """``dmlib compare A B``: the divergence table, what was not compared, the verdict."""
    from dmlib.cli import _groups, _lora
    from dmlib.stats.compare import compare_records, summarize_records

    if _lora.wants_adapters(args):  # two LoRA adapters, or a merge (--adapter)
        return _lora.run(args)
    if _is_dir(args.a) and _is_dir(args.b):
        from dmlib.io.hf_trainer import is_run_folder

        if is_run_folder(args.a) and is_run_folder(args.b):
            return _compare_runs(args)
    hash_name = _hash_of(args)
    if getattr(args, "map", None):
        from dmlib.cli.map import run_mapped

        return run_mapped(args, hash_name)
    with engine_of(args) as engine:
        rows, at = compare_records(
            args.a,
            args.b,
            include=args.include,
            exclude=args.exclude,
            file_hashes=args.file_hashes,
            rename=args.rename,
            cross_dtype=args.cross_dtype,
            hash=hash_name,
            engine=engine,
        )
    s = summarize_records(rows, at)
    comps = _components(rows, at)
    groups = _groups.records(args.a, args.b, args.group_l2) if args.group_l2 else None
    if args.json:
        doc = {"summary": s, "attrs": at, "rows": rows}
        if comps is not None:
            doc["components"] = comps
        if groups is not None:
            doc["group_l2"] = groups
        print_json(doc)
        return exit_code(s)
    listed = rows if args.all else [r for r in rows if r["n_diff"] > 0]
    if listed:
        hashed = args.hash not in (None, "none")
        print(table(listed, _TABLE + (["data_hash_a", "data_hash_b"] if hashed else [])))
    _print_notes(at, file_hashes=args.file_hashes)
    for line in component_lines(comps or []):
        print(line)
    if groups is not None:
        print(_groups.lines(groups))
    print(s)  # the Summary's one-line verdict
    return exit_code(s)


def _print_notes(at: dict[str, Any], *, file_hashes: bool) -> None:
    """What a comparison's attrs say beside the table: names and scalars one side holds,
    mismatched tensors, metadata and parameter ids that differ, file hashes, name mappings."""
    for key in ("only_in_a", "only_in_b"):
        if at[key]:
            print(f"{key}: {names_list(at[key])}")
    for side in ("a", "b"):  # plain values one file holds and the other does not
        if at.get(f"scalars_only_in_{side}"):
            print(f"scalars only in {side.upper()}: {names_list(at[f'scalars_only_in_{side}'])}")
    for m in at["mismatched"]:
        print(
            f"mismatched: {shown(m['name'])} {m['dtype_a']}{m['shape_a']} vs {m['dtype_b']}{m['shape_b']} (not compared)"
        )
    if at["metadata_diff"]:
        print(f"metadata_diff: {names_list(at['metadata_diff'])}")
    if at["param_id_diff"]:
        print(f"param_id_diff: {len(at['param_id_diff'])} tensors")
    for side in ("a", "b") if file_hashes else ():
        print(
            f"data_section_hash_{side}: {at['data_section_hash_' + side]}  file_hash_{side}: {at['file_hash_' + side]}"
        )
    if at.get("rename_detected"):
        print(
            f"note: names paired by the detected mapping {' '.join(at['rename'])} (--rename overrides)"
        )
    if at["alignment_hint"]:
        h = at["alignment_hint"]
        print(
            f"note: only {h['shared_before']} names are shared; mapping {shown(h['spec'])} would pair "
            f"{h['shared_after']} (--rename {shown(h['spec'])})"
        )


def _components(rows: list[dict[str, Any]], at: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Per-component rows when both sides are training checkpoint folders, else None."""
    if not (_is_dir(str(at["path_a"])) and _is_dir(str(at["path_b"]))):
        return None
    from dmlib.stats.components import components

    return components(rows, at)


def component_lines(comps: list[dict[str, Any]]) -> list[str]:
    """One line per component of a training checkpoint (and one per RNG generator)."""
    from dmlib.stats.components import printable

    lines = []
    for c in comps:
        if c["status"] == "absent":
            continue
        text = f"{c['component']}: {c['status'].upper()}"
        if c["n_tensors"]:
            text += f" ({c['n_tensors_diff']} of {c['n_tensors']} tensors differ"
            text += f", {c['n_scalars_diff']} scalars)" if c["n_scalars_diff"] else ")"
        elif c["n_scalars_diff"]:
            text += f" ({c['n_scalars_diff']} scalars differ)"
        if c["first"]:
            text += f"; first: {printable(c['first'])}"
        if c["detail"]:
            text += f"; {printable(c['detail'])}"
        lines.append(text)
        for g, word in c.get("generators", []):
            lines.append(f"  rng {printable(g)}: {word}")
    return lines


def _compare_runs(args: argparse.Namespace) -> int:
    """Two Trainer output folders: every shared step, component by component."""
    from dmlib.stats.components import compare_runs, printable

    r = compare_runs(args.a, args.b)
    if args.json:
        print_json(r)
        return exit_code(r)
    for step in r["steps"]:
        words = ", ".join(
            f"{c['component']} {c['status']}" for c in r["by_step"][step] if c["status"] != "absent"
        )
        print(f"step {step}: {words}")
    for side in ("a", "b"):
        if r[f"only_in_{side}"]:
            steps = ", ".join(map(str, r[f"only_in_{side}"]))
            print(f"steps only in {side.upper()} (not compared): {steps}")
    print(r)  # the verdict line: BIT-EXACT, NOT ALL COMPARED or DIFFERENT from step N
    if r.bit_exact or r.first_step is None:
        return exit_code(r)
    first = r["by_step"][r["first_step"]]
    for line in component_lines([c for c in first if c["status"] != "identical"]):
        print("  " + line)
    later = {k: v for k, v in r["first_diff"].items() if v != r["first_step"]}
    if later:
        print("later: " + ", ".join(f"{k} from step {v}" for k, v in later.items()))
    if r["loss_parts_at"] is not None:
        print(
            f"loss curves (trainer.log_history.loss) first part at logged step {r['loss_parts_at']}"
        )
    prior = [s for s in r["steps"] if s < r["first_step"]]
    if prior:
        print(
            f"at step {prior[-1]} every component was identical: what steps {prior[-1] + 1}-"
            f"{r['first_step']} consumed (the data order is not recorded in the files) or "
            "computed on it differed"
        )
    if r["inconclusive"]:
        print(f"not compared at some step: {', '.join(map(printable, r['inconclusive']))}")
    return exit_code(r)


def run_matrix(args: argparse.Namespace) -> int:
    """``dmlib matrix LABEL=PATH ...``: one line per pair of runs and the verdict."""
    from dmlib.cli import _groups
    from dmlib.cli.map import located_lines, mapped_notes, run_maps
    from dmlib.stats.matrix import matrix_records

    runs = labelled_paths(args.runs)
    # plain records, not a DataFrame: the command starts without importing pandas
    with engine_of(args) as engine:
        rows, attrs = matrix_records(
            runs,
            control=args.control,
            include=args.include,
            exclude=args.exclude,
            hash=_hash_of(args),
            engine=engine,
            mapping=run_maps(args.map),
            rename=args.rename,
        )
    v = attrs["verdict"]
    code = exit_code(v)
    groups = _groups.matrix_records(runs, args.group_l2) if args.group_l2 else None
    if args.json:
        doc = {"verdict": v, "pairs": attrs["pairs"], "rows": rows, "mapped": attrs["mapped"]}
        if groups is not None:
            doc["group_l2"] = groups
        print_json(doc)
        return code
    cols = [
        "a",
        "b",
        "control",
        "identical",
        "n_diff",
        "frac_diff",
        "max_abs",
        "max_ulp",
        "worst_rel_fro",
    ]
    print(table(v["pairs"], cols, key=2))
    for at in attrs["pairs"].values():  # a pair sharing few names: said before the verdict
        if at.get("alignment_hint"):
            print(f"warning: {at['alignment_hint']['message']}")
    for line in mapped_notes(attrs["mapped"]):
        print(line)
    located = [{"pair": pair, "name": name, **where}
               for pair, at in attrs["pairs"].items() for name, where in at.get("located", {}).items()]  # fmt: skip
    for line in located_lines(located):
        print(line)
    if groups is not None:
        print(_groups.lines(groups, pairs=True))
    print(v)  # the MatrixVerdict's lines
    sys.stdout.flush()
    return code
