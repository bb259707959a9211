"""The command line's subcommands and, for each checkpoint subcommand, the argv that puts a
bad input first (and second, where it takes two): shared by the tests that run every
subcommand on broken inputs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from dmlib.cli import build_parser


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _step2(good: str) -> str:
    return good.replace("good.bpk", "good-step2.bpk")


# subcommand -> argv with the bad input BAD in first position (and GOOD where another
# input is needed); subcommands not listed get their positionals filled with BAD, GOOD
CKPT_ARGV: dict[str, Callable[[str, str], list[str]]] = {
    "inspect": lambda bad, good: [bad],
    "compare": lambda bad, good: [bad, good],
    "matrix": lambda bad, good: [f"a={bad}", f"b={good}"],
    "factors": lambda bad, good: [bad, good, "--group", "svd:{prefix}.u,{prefix}.s,{prefix}.v"],
    "firstcol": lambda bad, good: [f"a={bad}", f"b={good}"],
    "ladder": lambda bad, good: [
        f"r:1={bad}",
        f"r:2={_step2(good)}",
        f"s:1={good}",
        f"s:2={_step2(good)}",
    ],
    "gapcheck": lambda bad, good: [f"a={bad}", f"b={good}"],
    "repeats": lambda bad, good: [f"a={bad},{good}"],
    "logprobs": lambda bad, good: [bad, good],
    "logprob-ladder": lambda bad, good: [f"r:1={bad},{good}"],
    "report": lambda bad, good: [
        "--run",
        f"a={bad}",
        "--run",
        f"b={good}",
        "--out",
        str(Path(good).parent / "report"),
    ],
    "map": lambda bad, good: ["suggest", bad, good, "--out", str(Path(good).parent / "m.toml")],
    "notebooks": lambda bad, good: [str(Path(good).parent / "nbs"), "--study", bad],
    "study": lambda bad, good: [
        "init",
        "--run",
        f"a={bad}",
        "--run",
        f"b={good}",
        "--out",
        str(Path(good).parent / "s.toml"),
    ],
}
# the same with the bad input second, where the command takes two or more inputs
CKPT_ARGV_SECOND: dict[str, Callable[[str, str], list[str]]] = {
    "compare": lambda bad, good: [good, bad],
    "matrix": lambda bad, good: [f"a={good}", f"b={bad}"],
    "factors": lambda bad, good: [good, bad, "--group", "svd:{prefix}.u,{prefix}.s,{prefix}.v"],
    "firstcol": lambda bad, good: [f"a={good}", f"b={bad}"],
    "ladder": lambda bad, good: [f"r:1={good}", f"r:2={_step2(good)}", f"s:1={good}", f"s:2={bad}"],
    "gapcheck": lambda bad, good: [f"a={good}", f"b={bad}"],
    "repeats": lambda bad, good: [f"a={good},{bad}"],
    "map": lambda bad, good: ["suggest", good, bad, "--out", str(Path(good).parent / "m.toml")],
}
CAPTURE_COMMANDS = {"localize", "arbitrate"}  # inputs are capture directories
