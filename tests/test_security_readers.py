"""The one reader of files an input names (``safepaths.read_regular``) keeps each caller's
guarantee: a Trainer or ``save_pretrained`` folder's member (``_folderfiles.read_member``:
inside the folder), a mapping file (``mapping.spec.load_mapping``), a folder format's file
found by ``safepaths.confined_file`` (the Orbax and OCDBT readers: a chunk, Orbax's JSON
metadata, the OCDBT manifest), a flax msgpack file (``io.flax_msgpack.open_flax_msgpack``)
and the report's matrix cache entry (``report.cache._read``). For each: a FIFO is refused
without being waited on (in a subprocess under a timeout: a reader that waits never
returns; the cache ignores it and computes again), a file over its size limit is refused
naming it (the cache: ignored), and a symbolic link out of the folder is refused where the
caller has a folder. A size checked on ``confined_file``'s look is checked again on the
file opened: a larger file renamed over it in between is refused all the same."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

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
    "orbax._json": (
        "from dmlib.io.orbax import _json\n_json(p, os.path.dirname(p), os.path.dirname(p))"
    ),
    # the database's manifest is found by its name: the file is given that name
    "ocdbt._read_manifest": "from dmlib.io.ocdbt import open_store\nopen_store(os.path.dirname(p))",
    # a cache entry that cannot be trusted is ignored (None: the matrix computed again)
    "report.cache._read": (
        "from pathlib import Path\nfrom dmlib.report.cache import _read\n"
        "if _read(Path(p), 'k' * 64, bytes(32)) is None:\n"
        "    print('IGNORED')\n"
        "    raise SystemExit(0)"
    ),
}
# the file name each caller's file is given (others: pipe.json)
NAMES = {"ocdbt._read_manifest": "manifest.ocdbt"}


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


def _refused_fifo(r: subprocess.CompletedProcess[str], caller: str) -> None:
    assert r.returncode == 0, r.stderr
    if caller == "report.cache._read":
        assert r.stdout.startswith("IGNORED"), r.stdout
    else:
        assert r.stdout.startswith("REFUSED") and "not a regular file" in r.stdout, r.stdout


@pytest.mark.parametrize("caller", sorted(CALLS))
def test_a_fifo_is_refused_without_waiting(tmp_path: Path, caller: str) -> None:
    fifo = tmp_path / NAMES.get(caller, "pipe.json")
    os.mkfifo(fifo)
    r, seconds = _run(CALLS[caller], fifo)
    _refused_fifo(r, caller)
    # named: by its path, or (a folder format's member) by its name after the folder
    named = (str(fifo), f"{tmp_path}: {fifo.name} is not", f"{tmp_path}: chunk is not")
    assert caller == "report.cache._read" or any(n in r.stdout for n in named), r.stdout
    assert seconds < 30


@pytest.mark.parametrize("caller", sorted(CALLS))
def test_a_fifo_behind_a_link_inside_the_folder_is_refused_without_waiting(
    tmp_path: Path, caller: str
) -> None:
    os.mkfifo(tmp_path / "pipe")
    os.symlink("pipe", tmp_path / NAMES.get(caller, "state.json"))
    r, _ = _run(CALLS[caller], tmp_path / NAMES.get(caller, "state.json"))
    _refused_fifo(r, caller)


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


# -- a size checked on confined_file's look, then the file read ---------------------------

JAX = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "jax"
OCDBT_DB = JAX / "orbax_ocdbt_zarr2" / "A_step0" / "default"


def _ocdbt_copy(tmp_path: Path) -> Path:
    if not OCDBT_DB.is_dir():
        pytest.skip(f"real JAX fixtures not found at {OCDBT_DB}")
    pytest.importorskip("crc32c")
    db = tmp_path / "db"
    shutil.copytree(OCDBT_DB, db)
    for f in db.rglob("*"):
        f.chmod(0o755 if f.is_dir() else 0o644)  # the fixtures are read-only
    return db


def _swapped_after_the_look(mp: pytest.MonkeyPatch, module: Any, name: str, content: bytes) -> None:
    """``module.confined_file`` looks at the file, then a file holding ``content`` is renamed
    over the one called ``name`` before the caller reads it (what another process may do)."""
    real = module.confined_file

    def look_then_swap(top: str, path: str | os.PathLike[str], **kw: Any) -> Any:
        found = real(top, path, **kw)
        if found is not None and os.path.basename(path) == name:
            big = Path(path).with_name(".swap")
            big.write_bytes(content)
            os.replace(big, path)
        return found

    mp.setattr(module, "confined_file", look_then_swap)


def test_orbax_metadata_at_its_limit_is_read_one_byte_over_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dmlib.io import orbax

    f = tmp_path / "_METADATA"
    f.write_bytes(b'{"a": 1}' + b" " * 92)  # 100 bytes
    monkeypatch.setattr(orbax, "_MAX_JSON", 100)
    assert orbax._json(str(f), str(tmp_path), str(tmp_path)) == {"a": 1}
    monkeypatch.setattr(orbax, "_MAX_JSON", 99)
    with pytest.raises(FormatError, match="is 100 bytes, more than the 99 bytes") as info:
        orbax._json(str(f), str(tmp_path), str(tmp_path))
    assert str(info.value).startswith(f"{tmp_path}: _METADATA is 100 bytes")


def test_orbax_metadata_grown_after_its_size_was_taken_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dmlib.io import orbax

    f = tmp_path / "_METADATA"
    f.write_bytes(b"{}")
    monkeypatch.setattr(orbax, "_MAX_JSON", 100)
    _swapped_after_the_look(monkeypatch, orbax, "_METADATA", b'{"a": 1}' + b" " * 200)
    with pytest.raises(FormatError, match="is 208 bytes, more than the 100 bytes") as info:
        orbax._json(str(f), str(tmp_path), str(tmp_path))
    assert str(info.value).startswith(f"{tmp_path}: _METADATA is 208 bytes")


def test_ocdbt_manifest_at_its_limit_is_read_one_byte_over_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dmlib.io import ocdbt

    db = _ocdbt_copy(tmp_path)
    size = (db / "manifest.ocdbt").stat().st_size
    monkeypatch.setattr(ocdbt, "_MAX_MANIFEST", size)
    reference = ocdbt.open_store(OCDBT_DB)
    assert ocdbt.open_store(db).keys.keys() == reference.keys.keys()
    monkeypatch.setattr(ocdbt, "_MAX_MANIFEST", size - 1)
    with pytest.raises(
        FormatError, match=f"is {size} bytes, more than the {size - 1} bytes"
    ) as info:
        ocdbt.open_store(db)
    assert str(info.value).startswith(f"{db}: manifest.ocdbt is {size} bytes")


def test_ocdbt_manifest_grown_after_its_size_was_taken_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dmlib.io import ocdbt

    db = _ocdbt_copy(tmp_path)
    manifest = (db / "manifest.ocdbt").read_bytes()
    monkeypatch.setattr(ocdbt, "_MAX_MANIFEST", len(manifest))
    grown = manifest + bytes(100)
    _swapped_after_the_look(monkeypatch, ocdbt, "manifest.ocdbt", grown)
    with pytest.raises(
        FormatError, match=f"is {len(grown)} bytes, more than the {len(manifest)} bytes"
    ) as info:
        ocdbt.open_store(db)
    assert str(info.value).startswith(f"{db}: manifest.ocdbt is")


def test_the_cache_reads_an_entry_at_its_limit_and_ignores_one_byte_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dmlib.report import cache

    key, secret = "0" * 64, bytes(range(32))
    entry = {"format": cache.CACHE_FORMAT, "key": key, "rows": [{"n_diff": 3}]}
    f = tmp_path / "matrix-0.json"
    f.write_text(cache._signed(entry, key, secret), encoding="utf-8")
    size = f.stat().st_size
    monkeypatch.setattr(_limits, "max_decompressed", lambda: size)
    assert cache._read(f, key, secret) == entry
    monkeypatch.setattr(_limits, "max_decompressed", lambda: size - 1)
    assert cache._read(f, key, secret) is None
    # a link to the entry is not followed (the entry itself is read above)
    monkeypatch.setattr(_limits, "max_decompressed", lambda: size)
    os.symlink(f, tmp_path / "link.json")
    assert cache._read(tmp_path / "link.json", key, secret) is None


def test_orbax_array_metadata_grown_after_its_size_was_taken_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dmlib.io import orbax

    (tmp_path / "w").mkdir()
    zarray = tmp_path / "w" / ".zarray"
    zarray.write_bytes(b"{}")
    monkeypatch.setattr(orbax, "_MAX_ARRAY_JSON", 100)
    store = orbax._DirStore(str(tmp_path), str(tmp_path))
    looked = store.size

    def size_then_swap(key: str) -> int | None:
        n = looked(key)
        (tmp_path / "w" / ".swap").write_bytes(b"{}" + b" " * 198)
        os.replace(tmp_path / "w" / ".swap", zarray)
        return n

    monkeypatch.setattr(store, "size", size_then_swap)
    with pytest.raises(FormatError, match="is 200 bytes, more than the 100 bytes") as info:
        orbax._array_meta(store, "w", str(tmp_path))
    assert str(info.value).startswith(f"{tmp_path}: w/.zarray is 200 bytes")
