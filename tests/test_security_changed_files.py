"""Files that change while being read: the result is refused ("changed while reading"), exit 2.

Deterministic: each test opens the TensorSets, then modifies a file, then compares. The
files' modification times are first set an hour back, so an in-place rewrite changes the
mtime whatever the file system's timestamp granularity. A file truncated under a live
memory map would kill the process with SIGBUS when a page past the new end is touched;
the child-process tests check that dmlib exits 2 with one line instead, and a control
run with the checks switched off shows the same scenario does die of SIGBUS.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dmlib
from dmlib.errors import FormatError
from dmlib.io.safetensors import write_safetensors
from dmlib.stats.compare import compare_records

ROOT = Path(__file__).resolve().parents[1]
N = 1 << 18  # float32 elements per tensor: 1 MiB, several chunks at chunk_bytes=64 KiB


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    arrays = {"w": rng.standard_normal(N).astype(np.float32), "b": np.arange(8, dtype=np.int32)}
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_safetensors(a, arrays)
    write_safetensors(b, arrays)
    old = time.time() - 3600
    for p in (a, b):
        os.utime(p, (old, old))
    return a, b


def _flip_last_byte(p: Path) -> None:
    with open(p, "r+b") as f:  # in place: same inode, same size
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))


def test_unchanged_files_compare_as_before(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    assert a.read_bytes() == b.read_bytes()  # the oracle: the files are byte-identical
    with dmlib.open_tensors(a) as sa, dmlib.open_tensors(b) as sb:
        rows, _ = compare_records(sa, sb, chunk_bytes=64 << 10)
    assert [r["n_diff"] for r in rows] == [0, 0]


def test_file_rewritten_in_place_between_open_and_compare_is_refused(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    with dmlib.open_tensors(a) as sa, dmlib.open_tensors(b) as sb:
        _flip_last_byte(b)
        with pytest.raises(FormatError, match="changed while reading") as err:
            compare_records(sa, sb)
    assert str(b) in str(err.value)


def test_file_replaced_between_open_and_compare_is_refused(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    with dmlib.open_tensors(a) as sa, dmlib.open_tensors(b) as sb:
        other = tmp_path / "other.safetensors"
        write_safetensors(other, {"w": np.zeros(N, np.float32), "b": np.zeros(8, np.int32)})
        os.replace(other, b)
        with pytest.raises(FormatError, match="changed while reading.*replaced"):
            compare_records(sa, sb)


def test_truncated_file_is_refused_before_its_map_is_touched(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    with dmlib.open_tensors(a) as sa, dmlib.open_tensors(b) as sb:
        os.truncate(b, 4096)
        with pytest.raises(FormatError, match=r"changed while reading \(size \d+ -> 4096"):
            compare_records(sa, sb)


def test_file_hashes_of_a_changed_file_are_refused(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    with dmlib.open_tensors(a) as sa, dmlib.open_tensors(b) as sb:
        _flip_last_byte(a)
        with pytest.raises(FormatError, match="changed while reading"):
            sa.file_hash()
        with pytest.raises(FormatError, match="changed while reading"):
            compare_records(sa, sb, file_hashes=True)
        with pytest.raises(FormatError, match="changed while reading"):
            sa["w"].data_hash()
        sb["w"].data_hash()  # b is untouched: its tensors still read


def test_matrix_of_runs_with_one_changed_is_refused(tmp_path: Path) -> None:
    from dmlib.stats.matrix import matrix_records

    a, b = _pair(tmp_path)
    c = tmp_path / "c.safetensors"
    c.write_bytes(a.read_bytes())
    with dmlib.open_tensors(a) as sa, dmlib.open_tensors(b) as sb, dmlib.open_tensors(c) as sc:
        _flip_last_byte(c)
        with pytest.raises(FormatError, match="changed while reading"):
            matrix_records({"a": sa, "b": sb, "c": sc})


def test_npz_rewritten_after_open_is_refused_at_load(tmp_path: Path) -> None:
    p = tmp_path / "x.npz"
    np.savez_compressed(p, w=np.arange(100, dtype=np.float32))
    old = time.time() - 3600
    os.utime(p, (old, old))
    with dmlib.open_tensors(p) as ts:
        np.savez_compressed(p, w=np.arange(100, dtype=np.float32) + 1)
        with pytest.raises(FormatError, match="changed while reading"):
            ts["w"].load()


# -- in a child process: exit status 2, never death by SIGBUS ----------------------------------

_TRUNCATE_MID_COMPARE = """
import os, sys
import dmlib
from dmlib.stats.compare import compare_records
from dmlib.errors import DmlibError
from dmlib.kernels import pair as _pair
from dmlib.tensor import Tensor
a, b, checks = sys.argv[1], sys.argv[2], sys.argv[3] == "on"
if not checks:  # the control: what happens without the stamps
    Tensor.check_unchanged = lambda self, recent=False: None
    import dmlib.tensor
    dmlib.tensor.FileStamp.check = lambda self, recent=False: None
same = _pair.same_bytes
calls = []
def truncating(ca, cb):  # once the first chunk is compared, b shrinks to its header
    out = same(ca, cb)
    if not calls:
        os.truncate(b, 4096)
    calls.append(1)
    return out
_pair.same_bytes = truncating
try:
    with dmlib.open_tensors(a) as sa, dmlib.open_tensors(b) as sb:
        # hash="none": this process's one reader is the chunk loop, whose guards are under
        # test; a hashing thread reading b at the instant it shrinks is the residual window
        # (docs/formats.md), which the command line turns into exit 2 (tests below)
        compare_records(sa, sb, include=["w"], chunk_bytes=64 << 10, hash="none")
except DmlibError as err:
    print(err, file=sys.stderr)
    sys.exit(2)
sys.exit(0)
"""


def _child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DMLIB_WORKERS": "1"},
    )  # fmt: skip


def test_file_truncated_while_its_map_is_compared_exits_2_not_sigbus(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    proc = _child(_TRUNCATE_MID_COMPARE, str(a), str(b), "on")
    assert proc.returncode == 2, proc.stderr
    assert "changed while reading" in proc.stderr and str(b) in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_the_truncation_scenario_does_kill_a_reader_without_the_checks(tmp_path: Path) -> None:
    # the control for the test above: the same child, stamps switched off, dies of SIGBUS
    a, b = _pair(tmp_path)
    proc = _child(_TRUNCATE_MID_COMPARE, str(a), str(b), "off")
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr[-300:])


_CLI_CHANGING = """
import os, sys
import dmlib.io
from dmlib.cli import main
how, target = sys.argv[1], sys.argv[3]
real = dmlib.io.open_tensors
def opening(path, **kw):  # the CLI opens the file, then it changes, then it is compared
    ts = real(path, **kw)
    if os.fspath(path) == target:
        if how == "truncate":
            os.truncate(target, 4096)
        else:
            with open(target, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                last = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([last[0] ^ 1]))
    return ts
dmlib.io.open_tensors = opening
sys.exit(main(["compare", *sys.argv[2:4]] + sys.argv[4:]))
"""


@pytest.mark.parametrize("how", ["truncate", "rewrite"])
@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_cli_compare_of_a_file_changed_after_open_exits_2(
    tmp_path: Path, how: str, extra: list[str]
) -> None:
    a, b = _pair(tmp_path)
    proc = _child(_CLI_CHANGING, how, str(a), str(b), *extra)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-300:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "changed while reading" in lines[0] and str(b) in lines[0]
    assert "IDENTICAL" not in proc.stdout and "DIFFERENT" not in proc.stdout


# -- the residual window: a read at the instant the file shrinks --------------------------

_SIGBUS_RAW = """
import mmap, os, sys
from dmlib.kernels import signals as K
path, install = sys.argv[1], sys.argv[2] == "on"
if install:
    assert K.exit_on_sigbus("shrank under a read\\n")
with open(path, "r+b") as f:
    m = mmap.mmap(f.fileno(), 0)
os.truncate(path, 0)
print(m[100_000])  # past the new end: SIGBUS
"""

_SIGBUS_CLI = """
import os, sys
import numpy as np
from dmlib.cli import main
from dmlib.kernels import pair
b = sys.argv[2]
def shrinking(ca, cb):  # b shrinks in the instant its chunk is read
    os.truncate(b, 4096)
    return bool(np.asarray(cb).sum() == np.asarray(ca).sum())
pair.same_bytes = shrinking
sys.exit(main(["compare", sys.argv[1], b, "--hash", "none"]))
"""


def _compiled() -> bool:
    from dmlib.kernels import signals

    return signals._fused is not None and hasattr(signals._fused, "exit_on_sigbus")


needs_compiled = pytest.mark.skipif(
    not _compiled() or not hasattr(signal, "SIGBUS"),
    reason="the SIGBUS handler is in the compiled module (dmlib/kernels/_fused.c), not built "
    "here, or this platform has no SIGBUS",
)


@needs_compiled
@pytest.mark.parametrize("install", ["on", "off"])
def test_a_read_past_a_shrunk_map_exits_2_with_the_handler(tmp_path: Path, install: str) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(1 << 20))
    proc = _child(_SIGBUS_RAW, str(p), install)
    if install == "on":
        assert proc.returncode == 2 and proc.stderr == "shrank under a read\n", proc
    else:  # the control: the same read kills a process without it
        assert proc.returncode == -signal.SIGBUS, proc


@needs_compiled
def test_cli_compare_of_a_file_shrinking_mid_read_exits_2_in_one_line(tmp_path: Path) -> None:
    from dmlib.cli import SIGBUS_LINE

    a, b = _pair(tmp_path)
    proc = _child(_SIGBUS_CLI, str(a), str(b))
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-300:])
    assert proc.stderr == SIGBUS_LINE and proc.stdout == ""
