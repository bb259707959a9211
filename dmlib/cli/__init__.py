"""The ``dmlib`` command line.

Each subcommand lives in its own module under ``dmlib.cli`` and exposes
``register(subparsers)``, which adds its parser(s) and sets ``func`` to a callable
taking the parsed arguments and returning the exit status.

Exit status, for every subcommand: 0 success (for comparisons: nothing differs),
1 a comparison found a difference, 2 bad input or usage (one line on stderr, no traceback),
4 an internal error (an exception dmlib did not expect: one line naming the input files;
never 1, which would read as a found difference; 3 is left to "inconclusive").
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence

from dmlib.errors import DmlibError

# Modules that contribute subcommands, in the order ``dmlib --help`` lists them.
_COMMAND_MODULES = (
    "dmlib.cli.inspect_cmd",
    "dmlib.cli.compare_cmd",
    "dmlib.cli.map_cmd",
    "dmlib.cli.forensics_cmd",
    "dmlib.cli.localize_cmd",
    "dmlib.cli.why_cmd",
    "dmlib.cli.report_cmd",
)

EXIT_CODES = """exit status:
  0  success (for comparisons: every compared tensor is bit-identical)
  1  a comparison found a difference
  2  bad input or usage: one line on stderr naming the file and the problem
  4  internal error (a bug in dmlib): one line on stderr naming the input files"""

EXIT_INTERNAL = 4


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line, like every other dmlib failure."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dmlib",
        description="Numerical-reproducibility forensics: read checkpoints, compare runs, "
        "localise where two runs first diverge.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from dmlib import __version__

    parser.add_argument("--version", action="version", version=f"dmlib {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in _COMMAND_MODULES:
        if importlib.util.find_spec(name) is None:
            continue
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    from dmlib.io import assumed_format

    try:
        with assumed_format(getattr(args, "format", None)):
            return int(args.func(args) or 0)
    except DmlibError as err:
        print(f"dmlib {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `dmlib inspect x | head`
        return 0
    except KeyboardInterrupt:
        print("dmlib: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # a bug: say so in one line, and never exit 1 ("a difference")
        text = " ".join(str(err).split())
        text = text if len(text) <= 200 else text[:197] + "..."
        files = ", ".join(_inputs(args)) or "no input file"
        print(
            f"dmlib {args.command}: internal error reading {files}: {type(err).__name__}: {text} "
            "(a bug in dmlib; please report it with the file)",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def _inputs(args: argparse.Namespace) -> list[str]:
    """The paths named on the command line (``LABEL=PATH``, ``RUN:STEP=PATH`` and
    ``ARM=PATH,PATH`` included)."""
    out: list[str] = []
    for key, value in vars(args).items():
        if key in ("func", "command"):
            continue
        for v in value if isinstance(value, list) else [value]:
            if not isinstance(v, str):
                continue
            if os.path.exists(v):
                cands = [v]
            else:
                tail = v.partition("=")[2]
                cands = [tail] if os.path.exists(tail) else tail.split(",")
            out += [c for c in cands if c and os.path.exists(c) and c not in out]
    return out


def add_common_epilog(p: argparse.ArgumentParser) -> None:
    """Give a subcommand parser the shared exit-status text."""
    p.epilog = EXIT_CODES
    p.formatter_class = argparse.RawDescriptionHelpFormatter


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
