"""The one reader of files an input names (``safepaths.read_regular``) keeps each caller's
guarantee: a Trainer or ``save_pretrained`` folder's member (``_folderfiles.read_member``:
inside the folder), a mapping file (``mapping.spec.load_mapping``), a folder format's file
found by ``safepaths.confined_file`` (the Orbax and OCDBT readers), a flax msgpack file
(``io.flax_msgpack.open_flax_msgpack``). For each: a FIFO is refused without being waited
on (in a subprocess under a timeout: a reader that waits never returns), a file over its
size limit is refused naming it, and a symbolic link out of the folder is refused where
the caller has a folder."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dmlib import _limits
from dmlib.errors import DmlibError, FormatError

pytestmark = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")

# each caller's call, as the subprocess runs it on the file at sys.argv[1]
CALLS = {
    "read_member": (
        "from dmlib.io._folderfiles import read_member\n"
        "read_member(os.path.dirname(p), os.path.basename(p))"
    ),
    "load_mapping": "from dmlib.mapping.spec import load_mapping\nload_mapping(p)",
    # called directly: format detection, which refuses a FIFO first, bypassed
    "open_flax_msgpack": "from dmlib.io.flax_msgpack import open_flax_msgpack\nopen_flax_msgpack(p)",
    "confined_file+read_regular": (
        "from dmlib.safepaths import confined_file, read_regular\n"
        "top = os.path.realpath(os.path.dirname(p))\n"
        "real, size = confined_file(top, p, what='chunk')\n"
        "read_regular(real, what='chunk', where=top)"
    ),
}


def _run(call: str, path: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    script = "import os, sys\np = sys.argv[1]\n" + textwrap.dedent(
        """
        from dmlib.errors import DmlibError
        try:
        {}
        except DmlibError as err:
            print("REFUSED", err)
            raise SystemExit(0)
        print("READ")
        """
    ).format(textwrap.indent(call, "    "))
    t0 = time.monotonic()
    try:
        r = subprocess.run(
            [sys.executable, "-c", script, str(path)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"the reader waited on the FIFO {path} for 30 s")
    return r, time.monotonic() - t0


@pytest.mark.parametrize("caller", sorted(CALLS))
def test_a_fifo_is_refused_without_waiting(tmp_path: Path, caller: str) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    r, seconds = _run(CALLS[caller], fifo)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("REFUSED") and "not a regular file" in r.stdout, r.stdout
    # named: by its path, or (a folder format's member) by its name in the folder
    assert str(fifo) in r.stdout or "chunk is not" in r.stdout, r.stdout
    assert seconds < 30


@pytest.mark.parametrize("caller", sorted(CALLS))
def test_a_fifo_behind_a_link_inside_the_folder_is_refused_without_waiting(
    tmp_path: Path, caller: str
) -> None:
    os.mkfifo(tmp_path / "pipe")
    os.symlink("pipe", tmp_path / "state.json")
    r, _ = _run(CALLS[caller], tmp_path / "state.json")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("REFUSED") and "not a regular file" in r.stdout, r.stdout


def test_read_member_refuses_a_link_out_of_the_folder(tmp_path: Path) -> None:
    from dmlib.io._folderfiles import read_member

    outside = tmp_path / "secret.json"
    outside.write_text("{}")
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    os.symlink(outside, folder / "config.json")
    with pytest.raises(FormatError, match="outside the checkpoint folder") as info:
        read_member(str(folder), "config.json")
    assert str(folder / "config.json") in str(info.value) and str(outside) in str(info.value)
    # a link that stays inside is read, as it was before
    os.unlink(folder / "config.json")
    (folder / "real.json").write_text('{"a": 1}')
    os.symlink("real.json", folder / "config.json")
    assert read_member(str(folder), "config.json") == b'{"a": 1}'


def test_confined_file_refuses_a_link_out_of_the_folder(tmp_path: Path) -> None:
    from dmlib.safepaths import confined_file

    outside = tmp_path / "elsewhere"
    outside.write_bytes(b"x")
    top = tmp_path / "ck"
    top.mkdir()
    os.symlink(outside, top / "chunk")
    with pytest.raises(DmlibError, match="leads outside the checkpoint") as info:
        confined_file(str(top.resolve()), top / "chunk", what="chunk")
    assert str(outside.resolve()) in str(info.value)


def test_read_member_refuses_an_oversized_file_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dmlib.io._folderfiles import read_member

    (tmp_path / "trainer_state.json").write_bytes(b"{}" + b" " * 4096)  # 4098 bytes
    monkeypatch.setattr(_limits, "MAX_TEXT_BYTES", 4098)
    assert len(read_member(str(tmp_path), "trainer_state.json")) == 4098  # at the limit: read
    monkeypatch.setattr(_limits, "MAX_TEXT_BYTES", 4097)
    with pytest.raises(
        FormatError, match="is 4,098 bytes, more than the 4,097 bytes a JSON file of a checkpoint"
    ) as info:
        read_member(str(tmp_path), "trainer_state.json")
    assert str(info.value).startswith(str(tmp_path / "trainer_state.json") + ": ")


def test_load_mapping_refuses_an_oversized_file_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dmlib.mapping.spec import load_mapping

    p = tmp_path / "m.toml"
    p.write_text('version = 1\n[[rule]]\nsource = "w"\ntarget = "v"\n')
    size = p.stat().st_size
    monkeypatch.setattr(_limits, "MAX_TEXT_BYTES", size)
    assert load_mapping(p).rules[0].targets == ("v",)
    monkeypatch.setattr(_limits, "MAX_TEXT_BYTES", size - 1)
    with pytest.raises(DmlibError, match="a mapping file may take") as info:
        load_mapping(p)
    assert str(info.value).startswith(str(p) + ": ")


def test_read_regular_refuses_past_its_limit_naming_the_file(tmp_path: Path) -> None:
    from dmlib.safepaths import read_regular

    f = tmp_path / "_METADATA"
    f.write_bytes(b"a" * 100)
    assert read_regular(str(f), where=str(f), limit=100) == b"a" * 100
    with pytest.raises(DmlibError, match="is 100 bytes, more than the 99 bytes") as info:
        read_regular(str(f), what="_METADATA", where=str(tmp_path), limit=99)
    assert str(info.value).startswith(f"{tmp_path}: _METADATA is 100 bytes")


def test_read_regular_does_not_follow_a_final_link(tmp_path: Path) -> None:
    """A link put where the caller resolved a file is refused, not followed out."""
    from dmlib.safepaths import read_regular

    (tmp_path / "target").write_bytes(b"secret")
    os.symlink(tmp_path / "target", tmp_path / "link")
    with pytest.raises(DmlibError, match="cannot be read"):
        read_regular(str(tmp_path / "link"), where=str(tmp_path / "link"))


def test_read_regular_refuses_a_file_whose_size_is_not_what_it_holds(tmp_path: Path) -> None:
    """Read whole, a file must hold exactly the bytes fstat gave when it was opened: the
    kernel's /proc files report size 0 and hold more; a file that shrank holds fewer."""
    from dmlib.safepaths import read_regular

    status = "/proc/self/status"
    if not os.path.isfile(status) or os.stat(status).st_size != 0:
        pytest.skip("no /proc file reporting size 0 here")
    with pytest.raises(DmlibError, match="changed while reading"):
        read_regular(status, where=status)

    f = tmp_path / "shrinks"
    f.write_bytes(b"x" * 10)
    real_fstat = os.fstat

    def fstat_before_the_truncation(fd: int) -> os.stat_result:
        st = real_fstat(fd)
        os.truncate(f, 4)  # the file shrinks after its size was taken
        return st

    import dmlib.safepaths as sp

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sp.os, "fstat", fstat_before_the_truncation)
        with pytest.raises(DmlibError, match="changed while reading"):
            read_regular(str(f), where=str(f))
    # a byte range asks for what it names: a short range is the caller's to check
    assert read_regular(str(f), 2, 8, where=str(f)) == b"xx"
