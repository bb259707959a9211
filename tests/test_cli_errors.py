"""Every ``dmlib`` subcommand, on every class of bad input: one line on stderr, exit 2.

Subcommands are discovered from the parser, so a new one is covered as soon as it is
registered; ``ARGV`` says how to call those that need more than input paths.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import dmlib
from dmlib.cli import build_parser, main
from dmlib.io.burnpack import encode_burnpack


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _good_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "layer.u": rng.standard_normal((4, 2)).astype(np.float32),
        "layer.s": np.array([2.0, 1.0], np.float32),
        "layer.v": rng.standard_normal((3, 2)).astype(np.float32),
        "layer.bias": np.zeros(3, np.float32),
    }


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("good")
    p = d / "good.bpk"
    p.write_bytes(encode_burnpack(_good_tensors(), scalars={"step": 1}))
    p2 = d / "good-step2.bpk"
    p2.write_bytes(encode_burnpack({k: v * 1.5 for k, v in _good_tensors().items()}, scalars={"step": 2}))
    return {"ckpt": p, "step2": p2}


@pytest.fixture(scope="module")
def good_capture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch = pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("cap") / "cap"
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with torch.no_grad(), dmlib.capture(model, d):
        model(torch.ones(1, 3))
    return d


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
    "ladder": lambda bad, good: [f"r:1={bad}", f"r:2={_step2(good)}", f"s:1={good}", f"s:2={_step2(good)}"],
    "gapcheck": lambda bad, good: [f"a={bad}", f"b={good}"],
}
# the same with the bad input second, where the command takes two or more inputs
CKPT_ARGV_SECOND: dict[str, Callable[[str, str], list[str]]] = {
    "compare": lambda bad, good: [good, bad],
    "matrix": lambda bad, good: [f"a={good}", f"b={bad}"],
    "factors": lambda bad, good: [good, bad, "--group", "svd:{prefix}.u,{prefix}.s,{prefix}.v"],
    "firstcol": lambda bad, good: [f"a={good}", f"b={bad}"],
    "ladder": lambda bad, good: [f"r:1={good}", f"r:2={_step2(good)}", f"s:1={good}", f"s:2={bad}"],
    "gapcheck": lambda bad, good: [f"a={good}", f"b={bad}"],
}
CAPTURE_COMMANDS = {"localize"}  # inputs are capture directories


def _generic_argv(sub: argparse.ArgumentParser, bad: str, good: str) -> list[str]:
    argv: list[str] = []
    for a in sub._actions:
        if a.option_strings:
            if a.required:
                pytest.fail(f"subcommand needs option {a.option_strings}: add it to CKPT_ARGV in {__file__}")
            continue
        argv += [bad] if not argv else [good]
        if a.nargs in ("+", "*"):
            argv.append(good)
    return argv


def _bad_inputs(root: Path, good_ckpt: Path) -> dict[str, Path]:
    raw = good_ckpt.read_bytes()
    out = {"missing": root / "missing.bpk", "directory": root / "a_directory"}
    out["directory"].mkdir(exist_ok=True)
    (root / "empty.bpk").write_bytes(b"")
    out["empty"] = root / "empty.bpk"
    (root / "magic.bpk").write_bytes(b"XXXX" + raw[4:])
    out["wrong-magic"] = root / "magic.bpk"
    (root / "cut.bpk").write_bytes(raw[: len(raw) - 3])
    out["truncated"] = root / "cut.bpk"
    (root / "noise.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    out["corrupt-header"] = root / "noise.safetensors"
    return out


BAD_KINDS = ["missing", "directory", "empty", "wrong-magic", "truncated", "corrupt-header"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse usage errors exit here
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _check_one_line(rc: int, err: str, bad: Path, argv: list[str]) -> None:
    assert rc == 2, f"{argv}: exit {rc}, stderr {err!r}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{argv}: stderr has {len(lines)} lines: {err!r}"
    assert str(bad) in lines[0] or bad.name in lines[0], f"{argv}: the message does not name {bad}: {lines[0]}"


# known departures from the contract, each failing as described (strict: fixed => noticed)
KNOWN_BAD: dict[str, str] = {}


def _commands(names: set[str]) -> list:
    return [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BAD[c])) if c in KNOWN_BAD else c
        for c in sorted(names)
    ]


@pytest.mark.parametrize("kind", BAD_KINDS)
@pytest.mark.parametrize("command", _commands(set(subcommands()) - CAPTURE_COMMANDS))
def test_checkpoint_commands_on_bad_input(command: str, kind: str, good: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _bad_inputs(tmp_path, good["ckpt"])[kind]
    sub = subcommands()[command]
    build = CKPT_ARGV.get(command, lambda b, g: _generic_argv(sub, b, g))
    argvs = [build(str(bad), str(good["ckpt"]))]
    if command in CKPT_ARGV_SECOND:
        argvs.append(CKPT_ARGV_SECOND[command](str(bad), str(good["ckpt"])))
    for argv in argvs:
        rc, _, err = _run([command, *argv], capsys)
        _check_one_line(rc, err, bad, [command, *argv])


def _bad_captures(root: Path, good: Path) -> dict[str, Path]:
    out = {"missing": root / "missing_capture"}
    (root / "empty_dir").mkdir()
    out["directory-without-manifest"] = root / "empty_dir"
    (root / "plain_file").write_bytes(b"")
    out["empty-file"] = root / "plain_file"
    (root / "cut").mkdir()
    text = (good / "manifest.json").read_text()
    (root / "cut" / "manifest.json").write_text(text[: len(text) // 2])
    out["truncated-manifest"] = root / "cut"
    (root / "wrong").mkdir()
    (root / "wrong" / "manifest.json").write_text(json.dumps({"format": "something else", "version": 99}))
    out["wrong-format"] = root / "wrong"
    return out


CAPTURE_KINDS = ["missing", "directory-without-manifest", "empty-file", "truncated-manifest", "wrong-format"]


@pytest.mark.parametrize("kind", CAPTURE_KINDS)
@pytest.mark.parametrize("command", sorted(CAPTURE_COMMANDS & set(subcommands())))
def test_capture_commands_on_bad_input(command: str, kind: str, good_capture: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = _bad_captures(tmp_path, good_capture)[kind]
    for argv in ([str(bad), str(good_capture)], [str(good_capture), str(bad)]):
        rc, _, err = _run([command, *argv], capsys)
        _check_one_line(rc, err, bad, [command, *argv])


def test_the_good_inputs_are_accepted(good: dict[str, Path], good_capture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bad-input tests start from inputs each command accepts, so each fails for one reason."""
    rc, out, err = _run(["inspect", str(good["ckpt"])], capsys)
    assert rc == 0 and "layer.u" in out, err
    rc, out, err = _run(["compare", str(good["ckpt"]), str(good["ckpt"])], capsys)
    assert rc == 0, err
    if "localize" in subcommands():
        rc, out, err = _run(["localize", str(good_capture), str(good_capture)], capsys)
        assert rc == 0, err


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_help_documents_exit_codes(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "exit status:" in out
    for line in ("0  success", "1  a comparison found a difference", "2  bad input"):
        assert line in out, f"{command} --help lacks {line!r}"


def test_usage_errors_exit_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["inspect"], ["no-such-command"], ["inspect", "--no-such-option", "x"]):
        rc, _, err = _run(argv, capsys)
        assert rc == 2 and "Traceback" not in err
        assert len([ln for ln in err.splitlines() if "error" in ln]) == 1, err
