"""The ``dmlib`` command line.

Each command group lives in a module under ``dmlib.cli`` named for what it holds
(:data:`_COMMAND_MODULES`) and exposes ``register(subparsers)``, which adds its parser(s)
and sets ``func`` to a callable taking the parsed arguments and returning the exit
status. The options and help text every command shares, and the exit status of a
result, are in ``dmlib.cli._common``.

Exit status, for every subcommand: 0 success (for comparisons: nothing differs),
1 a comparison found a difference, 2 bad input or usage (one line on stderr, no traceback),
4 an internal error (an exception dmlib did not expect: one line naming the input files;
never 1, which would read as a found difference; 3 is left to "inconclusive"), 5 not
comparable (``logprobs``: the inputs do not score the same tokens), 130
interrupted (Ctrl-C: one line, no traceback), 143 terminated (SIGTERM: the same, one line).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from dmlib.cli._common import (
    EXIT_BAD_INPUT,
    EXIT_CODES,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    HelpFormatter,
)
from dmlib.errors import DmlibError
from dmlib.textsafe import SafeStream, clip

# Modules that contribute subcommands, in the order ``dmlib --help`` lists them.
_COMMAND_MODULES = (
    "dmlib.cli.inspect",  # inspect
    "dmlib.cli.compare",  # compare, matrix
    "dmlib.cli.map",  # map suggest
    "dmlib.cli.structure",  # factors, firstcol
    "dmlib.cli.ladder",  # ladder
    "dmlib.cli.logprobs",  # logprobs, logprob-ladder
    "dmlib.cli.padding",  # gapcheck
    "dmlib.cli.localize",  # localize, arbitrate, repeats
    "dmlib.cli.report",  # report
    "dmlib.cli.study",  # study init
)

__all__ = ["EXIT_CODES", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """argparse that exits 2 with one line, like every other dmlib failure."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """Exit 2 with one line naming the command and the problem."""
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``dmlib`` parser with every command module's subcommands registered."""
    parser = _Parser(
        prog="dmlib",
        description="Numerical-reproducibility forensics: read checkpoints, compare runs, "
        "localise where two runs first diverge.",
        epilog=EXIT_CODES,
        formatter_class=HelpFormatter,
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
    """Run one command; every way it can end is an exit status and at most one line.

    While it runs, ``sys.stdout`` and ``sys.stderr`` escape control characters
    (:class:`dmlib.textsafe.SafeStream`) and SIGTERM is handled like Ctrl-C, so that
    ``with`` blocks (temporary folders) are left on either (exit 130 for Ctrl-C, 143 for
    SIGTERM).
    """
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = SafeStream(out), SafeStream(err)
    previous = _on_sigterm()
    sigbus = _exit_on_sigbus()
    command = "dmlib"
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        command = f"dmlib {args.command}" if getattr(args, "command", None) else "dmlib"
        return _run(parser, args)
    except _Terminated:  # SIGTERM: 128 + 15, as a shell reports a process it ended
        _say(f"{command}: terminated")
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        _say(f"{command}: interrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `dmlib inspect x | head`
        _quiet_stdout()
        return 0
    finally:
        _restore_sigterm(previous)
        if sigbus:
            from dmlib.kernels.signals import restore_sigbus

            restore_sigbus()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        sys.stdout, sys.stderr = out, err


# what a command says when a memory-mapped input shrank under a read (SIGBUS: no Python
# runs then, so no file name; see dmlib.kernels.signals.exit_on_sigbus)
SIGBUS_LINE = (
    "dmlib: error: an input file shrank while it was being read (changed while reading: "
    "its memory map was read past the file's new end); nothing computed from it is reported\n"
)


def _exit_on_sigbus() -> bool:
    """Exit 2 with :data:`SIGBUS_LINE` on SIGBUS while a command runs (main thread only)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return False
    from dmlib.kernels.signals import exit_on_sigbus

    return exit_on_sigbus(SIGBUS_LINE)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    from dmlib.io import assumed_format

    try:
        with assumed_format(getattr(args, "format", None)):
            return int(args.func(args) or 0)
    except DmlibError as err:
        _say(f"dmlib {args.command}: error: {err}")
        return EXIT_BAD_INPUT
    except (KeyboardInterrupt, BrokenPipeError):
        raise
    except Exception as err:  # a bug: say so in one line, and never exit 1 ("a difference")
        text = " ".join(str(err).split())
        text = text if len(text) <= 200 else text[:197] + "..."
        files = ", ".join(_inputs(args)) or "no input file"
        _say(
            f"dmlib {args.command}: internal error reading {files}: {type(err).__name__}: {text} "
            "(a bug in dmlib; please report it with the file)"
        )
        return EXIT_INTERNAL


def _say(line: str) -> None:
    """One line on stderr: control characters escaped, at most a few hundred characters."""
    print(clip(line), file=sys.stderr)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be: the command stops the same way."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


def _on_sigterm() -> Any:
    """Handle SIGTERM like SIGINT while a command runs (main thread, default handler only)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous != signal.SIG_DFL:  # someone embedding dmlib chose their own handling
        return None
    signal.signal(signal.SIGTERM, _raise_terminated)
    return previous


def _restore_sigterm(previous: Any) -> None:
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)


def _quiet_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so the exit flush does not complain."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno() if sys.__stdout__ else 1)


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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
