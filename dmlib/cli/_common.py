"""What every subcommand parser and every command's ending share.

- :func:`add_common`: ``--json``, ``--format``, ``--dask`` where a command has them, and
  the exit-status text under ``--help``;
- :func:`print_json`: the one JSON document a ``--json`` command prints;
- :func:`exit_code`: the process exit status computed from a command's result.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

EXIT_CODES = """exit status:
  0  success (for comparisons: every compared tensor is bit-identical)
  1  a comparison found a difference
  2  bad input or usage: one line on stderr naming the file and the problem
  4  internal error (a bug in dmlib): one line on stderr naming the input files
  5  not comparable (dmlib logprobs: the inputs do not score the same tokens)
  130  interrupted (Ctrl-C): one line on stderr
  143  terminated (SIGTERM): one line on stderr"""

EXIT_SAME = 0
EXIT_DIFFERS = 1
EXIT_BAD_INPUT = 2
EXIT_INCONCLUSIVE = 3
EXIT_INTERNAL = 4
EXIT_NOT_COMPARABLE = 5  # an identity gate failed: nothing was compared
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM

ONE_DOCUMENT = "print one JSON document"  # the help of most commands' --json


def add_common(
    p: argparse.ArgumentParser,
    *,
    json: str | None = None,
    format: bool = False,
    dask: bool = False,
    epilog: str = EXIT_CODES,
) -> None:
    """Give a subcommand parser the options and help text every command words alike.

    ``json``: the help of ``--json`` (None: the command has no JSON output); ``format``:
    ``--format`` (read every input as one format); ``dask``: ``--dask``; ``epilog``: the
    exit-status text ``--help`` ends with (the shared one unless the command has its own).
    """
    if json is not None:
        p.add_argument("--json", action="store_true", help=json)
    if format:
        add_format(p)
    if dask:
        from dmlib.cli._dask import add_dask

        add_dask(p)
    p.epilog = epilog
    p.formatter_class = HelpFormatter


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` fitted to the terminal's width (``COLUMNS``, as argparse reads it).

    A paragraph of prose (blank lines between paragraphs) is filled to the width; a table
    such as the exit-status text (a heading, then indented lines) keeps its lines, each
    wrapped under its text (``  130  interrupted ...`` continues under ``interrupted``).
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        import re
        import textwrap

        out = []
        for para in text.split("\n\n"):
            lines = para.splitlines()
            if not any(line[:1].isspace() for line in lines):  # prose: refilled
                out.append(
                    textwrap.fill(
                        " ".join(line.strip() for line in lines),
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent,
                        break_on_hyphens=False,
                    )
                )
                continue
            rows = []
            for line in _joined_rows(lines):
                hang = re.match(r"\s*\S+\s+", line) if line[:1].isspace() else None
                rows.append(
                    textwrap.fill(
                        line,
                        width,
                        initial_indent=indent,
                        subsequent_indent=indent + " " * (len(hang.group(0)) if hang else 2),
                        break_on_hyphens=False,
                        drop_whitespace=True,
                    )
                    if len(indent + line) > width
                    else indent + line
                )
            out.append("\n".join(rows))
        return "\n\n".join(out)


def _joined_rows(lines: list[str]) -> list[str]:
    """A table's lines with each continuation line (indented deeper than the rows, as the
    source broke it) joined to its row, so that the row is wrapped once, at the width."""
    depth = [len(line) - len(line.lstrip()) for line in lines]
    row_depth = min(
        (d for d, line in zip(depth, lines, strict=True) if d and line.strip()), default=0
    )
    out: list[str] = []
    for d, line in zip(depth, lines, strict=True):
        if out and row_depth and d > row_depth:
            out[-1] = out[-1].rstrip() + " " + line.strip()
        else:
            out.append(line)
    return out


def add_format(p: argparse.ArgumentParser) -> None:
    """``--format``: read every input checkpoint as this format instead of detecting it."""
    from dmlib.io import FORMATS

    p.add_argument(
        "--format",
        choices=list(FORMATS),
        metavar="FORMAT",
        help=f"read every input as this format (skip detection): {', '.join(FORMATS)}",
    )


def print_json(doc: Any, *, default: Callable[[Any], Any] | None = str) -> None:
    """Print ``doc`` as one indented JSON document (:func:`dmlib._json.jsonable` rules:
    NaN and NA as null, infinity as ``"inf"``; ``default`` for anything else)."""
    from dmlib._json import jsonable

    print(json.dumps(jsonable(doc, default=default), indent=1))


def exit_code(result: Any = None, *, differs: bool | None = None) -> int:
    """The exit status of a comparison: 0 nothing differs, 1 something differs (or a
    control failed, or no verdict was reached), 3 inconclusive (capture comparisons), 5
    not comparable (an identity gate failed).

    ``result`` is what the library returned, recognised by its type: a typed verdict
    (:class:`~dmlib.kernels.verdict.Verdict`: ``bool()`` says same; ``status`` "not
    comparable" is 5, "inconclusive" with no divergence and no failed control 3), an
    :class:`~dmlib.localize.arbitrate.Arbitration` or a
    :class:`~dmlib.localize.rates.RepeatStudy` (``bool()`` says same); two Trainer runs
    compared are a :class:`~dmlib.stats.verdicts.RunsVerdict` (``bool()`` is ``bit_exact``).
    ``differs``: a command that judges its table itself says so here instead. Bad input
    never gets here: a :class:`dmlib.errors.DmlibError` is exit 2 in :func:`dmlib.cli.main`.
    """
    if differs is not None:
        return EXIT_DIFFERS if differs else EXIT_SAME
    from dmlib.kernels.verdict import Verdict

    if isinstance(result, Verdict):  # Summary, RunsVerdict, CaptureVerdict...: bool() is "same"
        if result:
            return EXIT_SAME
        status = getattr(result, "status", None)
        if status == "not comparable":  # LogprobVerdict's identity gate
            return EXIT_NOT_COMPARABLE
        # inconclusive: no divergence found and no control failed (CaptureVerdict's fields)
        if (
            status == "inconclusive"
            and getattr(result, "first_divergent_boundary", None) is None
            and not getattr(result, "failed_control", False)
        ):
            return EXIT_INCONCLUSIVE
        return EXIT_DIFFERS
    from dmlib.localize.arbitrate import Arbitration
    from dmlib.localize.rates import RepeatStudy

    if isinstance(result, (Arbitration, RepeatStudy)):  # bool() is "same"
        return EXIT_SAME if result else EXIT_DIFFERS
    raise TypeError(f"no exit status for {type(result).__name__}")
