"""Every checkpoint subcommand takes ``--format``; an unexpected exception exits 4 in one line."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
from _support.cli_argv import CAPTURE_COMMANDS, CKPT_ARGV, subcommands

import dmlib.io
import dmlib.io.numpy_
from dmlib.cli import EXIT_INTERNAL, main

# notebooks copies the report notebooks and reads only a study file: no checkpoint
CHECKPOINT_COMMANDS = sorted(set(subcommands()) - CAPTURE_COMMANDS - {"notebooks"})
# report and study read their files through a study (study.toml), which names no format per
# run: --format does not apply to them (they still exit 4 on an unexpected exception)
FORMAT_COMMANDS = sorted(set(CHECKPOINT_COMMANDS) - {"report", "study"})


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _npz_without_suffix(path: Path, scale: float) -> Path:
    """An .npz archive under a name no suffix rule knows (detected by its members)."""
    rng = np.random.default_rng(0)
    arrays = {
        "layer.u": rng.standard_normal((4, 2)).astype(np.float32) * scale,
        "layer.s": np.array([2.0, 1.0], np.float32),
        "layer.v": rng.standard_normal((3, 2)).astype(np.float32),
        # per-token log-probs, so that the log-prob commands read the same archive
        "logprobs": np.log(np.array([[0.5, 0.25], [0.75, 0.125]], np.float32)) * scale,
    }
    np.savez(path.with_suffix(".npz"), **arrays)
    path.with_suffix(".npz").rename(path)
    assert zipfile.is_zipfile(path)
    return path


@pytest.mark.parametrize("command", FORMAT_COMMANDS)
def test_every_checkpoint_command_takes_format(command, tmp_path, capsys):
    a = _npz_without_suffix(tmp_path / "run_a.data", 1.0)
    b = _npz_without_suffix(tmp_path / "run_b.data", 1.0)
    argv = [command, *CKPT_ARGV[command](str(a), str(b))]
    if command == "ladder":  # its builder names a second step file beside the good one
        argv = [command, f"r:1={a}", f"r:2={b}", f"s:1={a}", f"s:2={b}"]
    # the option reaches the reader: forced to the wrong format, the archive is refused
    rc, _, err = _run([*argv, "--format", "safetensors"], capsys)
    assert rc == 2 and str(a) in err and "Traceback" not in err, (rc, err)
    rc, out, err = _run([*argv, "--format", "npz"], capsys)
    assert "unrecognised" not in err and "Traceback" not in err
    # the files were read: success or a found difference; gapcheck reads them and then
    # refuses an archive whose tensors have no place in the file to look between
    if command == "gapcheck":
        assert rc == 2 and "no file offset" in err, (rc, err)
    else:
        assert rc in (0, 1), (rc, err)


@pytest.mark.parametrize("command", CHECKPOINT_COMMANDS)
def test_unexpected_exception_exits_internal_in_one_line(command, tmp_path, capsys, monkeypatch):
    a = _npz_without_suffix(tmp_path / "a.npz.bin", 1.0)
    b = _npz_without_suffix(tmp_path / "b.npz.bin", 2.0)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("planted\nover two lines")

    monkeypatch.setattr(dmlib.io.numpy_, "open_npz", broken)  # every command reads through it
    argv = [command, *CKPT_ARGV[command](str(a), str(b))]
    if command == "ladder":
        argv = [command, f"r:1={a}", f"r:2={b}", f"s:1={a}", f"s:2={b}"]
    rc, _, err = _run(argv, capsys)
    assert rc == EXIT_INTERNAL == 4, (rc, err)
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "internal error" in lines[0] and "ZeroDivisionError: planted over two lines" in lines[0]
    assert str(a) in lines[0]


def test_help_documents_the_internal_error_code(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert "4  internal error" in capsys.readouterr().out
