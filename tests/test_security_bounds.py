"""Bounded work for any input: small files that declare gigabytes are refused, exit 2, one line.

Each bomb is built here (tests/_support/bombs.py: deflate streams of zeros, honest sizes and CRCs
checked by zipfile/gzip in ``test_the_bomb_builders_write_what_they_declare``) and opened by
``dmlib inspect`` in a child process; the child's peak resident memory (its own high-water
mark, ``VmHWM``, or ``getrusage`` where /proc is absent) must stay far below what the bomb
declares. Sizes are taken from :mod:`dmlib._limits` as this machine computes them, so every
bomb exceeds the limit it targets by construction, on any machine.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import bombs as _bombs  # noqa: E402

from dmlib import _limits  # noqa: E402
from dmlib.errors import DmlibError, FormatError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20

# runs ``dmlib <args>`` in this process, then reports its exit status and peak memory
_CHILD = r"""
import json, resource, sys
from dmlib.cli import main
code = main(sys.argv[1:])
peak = None
try:
    with open("/proc/self/status") as f:
        peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
except (OSError, StopIteration):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
sys.stderr.write("\n@@" + json.dumps({"code": code, "peak": peak}) + "\n")
"""


def _dmlib(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, int]:
    """(exit status, the error line, peak RSS bytes) of ``dmlib ARGS`` in a child process."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, *args],
        capture_output=True, text=True, env=full, timeout=120, check=False,
    )  # fmt: skip
    err, _, tail = proc.stderr.rpartition("\n@@")
    assert tail, f"child died (status {proc.returncode}): {proc.stderr[-500:]}"
    doc = json.loads(tail)
    assert proc.returncode == 0  # the child itself exits 0 after reporting
    return doc["code"], err.strip(), doc["peak"]


def _one_line_naming(err: str, path: Path, *words: str) -> None:
    assert "\n" not in err and "Traceback" not in err, err
    assert str(path) in err, err
    for w in words:
        assert w in err, err


BOUND = 500 * MIB  # far below every bomb's declared size below


# -- the bomb builders, checked by the real readers ----------------------------------------


def test_the_bomb_builders_write_what_they_declare(tmp_path: Path) -> None:
    npz = tmp_path / "z.npz"
    declared = _bombs.npz_zeros(npz, members=2, mib_each=3)
    with zipfile.ZipFile(npz) as zf:  # zipfile checks each member's CRC and size
        data = [zf.read(n) for n in zf.namelist()]
    assert sum(len(d) for d in data) == declared
    arr = np.load(npz)["w1"]
    assert arr.shape == (3 * MIB // 4,) and not arr.any()
    gz = tmp_path / "r.mpk.gz"
    size = _bombs.mpk_gz_zeros(gz, mib=2)
    raw = gzip.decompress(gz.read_bytes())  # gzip checks the CRC and ISIZE
    assert len(raw) == size and raw.endswith(bytes(2 * MIB))
    import msgpack

    doc = msgpack.unpackb(raw)
    assert doc["item"]["w"]["param"]["shape"] == [2 * MIB // 4]


# -- npz -------------------------------------------------------------------------------------


def test_npz_member_inflating_past_the_ratio_floor_is_refused_in_bounded_memory(
    tmp_path: Path,
) -> None:
    floor = _limits.ratio_floor()
    if floor + 64 * MIB >= 1 << 32:
        pytest.skip(f"the ratio floor here ({floor} bytes) needs a zip64 bomb")
    p = tmp_path / "bomb.npz"
    declared = _bombs.npz_zeros(p, members=1, mib_each=floor // MIB + 64)
    assert declared > floor and p.stat().st_size * 200 < declared  # a ratio above 200
    code, err, peak = _dmlib("inspect", str(p))
    assert code == 2
    _one_line_naming(err, p, "refused", "w0.npy", "inflate")
    assert peak < BOUND, f"peak {peak} bytes for a refused {declared}-byte bomb"


def test_npz_members_inflating_together_past_the_limit_are_refused(tmp_path: Path) -> None:
    floor = _limits.ratio_floor()
    each = 16  # MiB per member: each alone is under the floor
    members = floor // (each * MIB) + 2
    if members > 2000:
        pytest.skip(f"the ratio floor here ({floor} bytes) needs {members} members")
    p = tmp_path / "many.npz"
    declared = _bombs.npz_zeros(p, members=members, mib_each=each)
    assert declared > floor
    code, err, peak = _dmlib("inspect", str(p))
    assert code == 2
    _one_line_naming(err, p, "refused", "members would inflate")
    assert peak < BOUND


def test_npz_member_larger_than_one_member_may_take_is_refused(tmp_path: Path) -> None:
    # the size cap (a quarter of memory) lowered to 64 MiB, as on a 256 MiB machine
    p = tmp_path / "big.npz"
    _bombs.npz_zeros(p, members=1, mib_each=80)
    code, err, peak = _dmlib("inspect", str(p), env={"DMLIB_MAX_DECOMPRESSED": "64M"})
    assert code == 2
    _one_line_naming(err, p, "refused", "one member may take")
    assert peak < BOUND


def test_npz_members_are_decompressed_when_loaded_not_at_open(tmp_path: Path) -> None:
    import dmlib

    good = np.arange(12, dtype=np.float32).reshape(3, 4)
    p = tmp_path / "lazy.npz"
    np.savez_compressed(p, good=good, bad=np.ones(1000, np.int32))
    # damage the bad member's CRC in the central directory: only reading it can tell
    raw = bytearray(p.read_bytes())
    with zipfile.ZipFile(p) as zf:
        info = zf.getinfo("bad.npy")
    start = 0
    while True:  # the central directory entry naming bad.npy
        cd = raw.index(b"PK\x01\x02", start)
        name_len = struct.unpack_from("<H", raw, cd + 28)[0]
        if raw[cd + 46 : cd + 46 + name_len] == b"bad.npy":
            break
        start = cd + 4
    struct.pack_into("<I", raw, cd + 16, info.CRC ^ 1)
    struct.pack_into("<I", raw, info.header_offset + 14, info.CRC ^ 1)
    p.write_bytes(bytes(raw))
    with dmlib.open_tensors(p) as ts:  # opening reads headers only
        assert sorted(ts) == ["bad", "good"]
        np.testing.assert_array_equal(ts["good"].load(), good)
        with pytest.raises(FormatError, match="bad.npy"):
            ts["bad"].load()


# -- .mpk.gz -----------------------------------------------------------------------------------


def test_mpk_gz_declaring_more_than_allowed_is_refused_before_inflating(tmp_path: Path) -> None:
    pytest.importorskip("msgpack")
    floor = _limits.ratio_floor()
    p = tmp_path / "bomb.mpk.gz"
    size = _bombs.mpk_gz_zeros(p, mib=floor // MIB + 64)
    assert size > _limits.allowed_output(p.stat().st_size)
    code, err, peak = _dmlib("inspect", str(p))
    assert code == 2
    _one_line_naming(err, p, "refused", "declare")
    assert peak < BOUND


def test_mpk_gz_lying_about_its_size_stops_inflating_at_the_limit(tmp_path: Path) -> None:
    pytest.importorskip("msgpack")
    floor = _limits.ratio_floor()
    p = tmp_path / "liar.mpk.gz"
    size = _bombs.mpk_gz_zeros(p, mib=floor // MIB + 512, isize=100)  # the trailer says 100
    allowed = _limits.allowed_output(p.stat().st_size)
    code, err, peak = _dmlib("inspect", str(p))
    assert code == 2
    _one_line_naming(err, p, "refused", "inflate past the 100 bytes")
    # what it held is bounded by the limit, not by the bomb (the bomb is 512 MiB larger)
    assert peak < allowed + 300 * MIB < size


def test_mpk_larger_than_one_record_may_take_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("msgpack")
    p = tmp_path / "big.mpk"
    with open(p, "wb") as f:  # a sparse file: 80 MiB declared, nothing written
        f.write(_bombs.mpk_record_prefix(80 * MIB))
        f.truncate(80 * MIB + 200)
    code, err, peak = _dmlib("inspect", str(p), env={"DMLIB_MAX_DECOMPRESSED": "64M"})
    assert code == 2
    _one_line_naming(err, p, "refused", "decoded whole in memory")
    assert peak < BOUND


# -- counts and sizes declared in headers ----------------------------------------------------


def _safetensors_4tib(p: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4]}})
    hb = header.encode()
    p.write_bytes(struct.pack("<Q", len(hb)) + hb + bytes(4))


def _npy_4tib(p: Path) -> None:
    p.write_bytes(_bombs.npy_header("<f4", (1 << 40,)) + bytes(16))


def _npz_member_header_4tib(p: Path) -> None:
    header = _bombs.npy_header("<f4", (1 << 40,))
    data, crc, size = _bombs.deflate_zeros(header, 0)
    _bombs.write_zip(p, [("w.npy", data, crc, size)])


def _gguf_counts(p: Path) -> None:
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 1 << 60, 1 << 60) + bytes(64))


def _gguf_string_length(p: Path) -> None:
    # one key whose length prefix claims 2**60 bytes
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 60) + bytes(64))


def _mpk_bin_length(p: Path) -> None:
    p.write_bytes(_bombs.mpk_record_prefix(0xFFFFFFF0) + bytes(64))


@pytest.mark.parametrize(
    "name, build",
    [
        ("w.safetensors", _safetensors_4tib),
        ("w.npy", _npy_4tib),
        ("w.npz", _npz_member_header_4tib),
        ("counts.gguf", _gguf_counts),
        ("key.gguf", _gguf_string_length),
        ("bin.mpk", _mpk_bin_length),
    ],
)
def test_huge_counts_and_sizes_in_headers_are_refused_in_bounded_memory(
    tmp_path: Path, name: str, build
) -> None:
    if name.endswith(".mpk"):
        pytest.importorskip("msgpack")
    p = tmp_path / name
    build(p)
    code, err, peak = _dmlib("inspect", str(p))
    assert code == 2, err
    _one_line_naming(err, p)
    assert peak < BOUND


def test_gguf_long_string_array_is_kept_as_its_digest(tmp_path: Path) -> None:
    import dmlib

    n = 20_000
    items = b"".join(struct.pack("<Q", 3) + b"tok" for _ in range(n))
    key = b"tokenizer.tokens"
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 8, n) + items
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv
    p = tmp_path / "vocab.gguf"
    p.write_bytes(head + bytes(-len(head) % 32))
    with dmlib.open_tensors(p) as ts:
        value = ts.metadata["tokenizer.tokens"]
    digest = hashlib.sha256(items).hexdigest()[:16]  # the element bytes as written above
    assert value == f"<array of {n} str, sha256 {digest}>"


# -- the limits themselves ---------------------------------------------------------------------


def test_limits_scale_with_the_machines_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DMLIB_MAX_DECOMPRESSED", raising=False)
    monkeypatch.delenv("DMLIB_MAX_RATIO", raising=False)
    for mem in (4 << 30, 64 << 30):
        monkeypatch.setattr(_limits, "memory_bytes", lambda mem=mem: mem)
        assert _limits.max_decompressed() == mem // 4
        assert _limits.ratio_floor() == mem // 64
        assert _limits.allowed_output(1000) == mem // 64  # 200 x 1000 is below the floor
        big = mem // 64  # 200 x that is far above a quarter of memory
        assert _limits.allowed_output(big) == mem // 4
        mid = mem // 64 // 100  # 200 x mid = twice the floor
        assert _limits.allowed_output(mid) == 200 * mid


def test_limits_can_be_lifted_for_a_trusted_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_limits, "memory_bytes", lambda: 8 << 30)
    monkeypatch.setenv("DMLIB_MAX_DECOMPRESSED", "3G")
    monkeypatch.setenv("DMLIB_MAX_RATIO", "5000")
    assert _limits.max_decompressed() == 3 << 30
    assert _limits.allowed_output(100 << 10) == 5000 * (100 << 10)
    monkeypatch.setenv("DMLIB_MAX_RATIO", "lots")
    with pytest.raises(DmlibError, match="DMLIB_MAX_RATIO"):
        _limits.max_ratio()


def test_memory_is_read_from_this_machine() -> None:
    _limits.memory_bytes.cache_clear()
    mem = _limits.memory_bytes()
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < mem <= pages  # never more than the RAM the kernel reports


# -- exit codes --------------------------------------------------------------------------------


def test_deeply_nested_study_toml_is_bad_input_not_a_bug(tmp_path: Path) -> None:
    study = tmp_path / "study.toml"
    study.write_text("title = 'x'\nx = " + "[" * 5000 + "]" * 5000 + "\n", encoding="utf-8")
    code, err, _ = _dmlib("report", str(study), "--out", str(tmp_path / "out"))
    assert code == 2, err
    _one_line_naming(err, study, "nest too deeply")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("path", ["/proc", "/proc/self/status", "/dev/zero", "/dev/null"])
@pytest.mark.parametrize("fmt", [None, "npy", "safetensors", "torch", "burn-mpk", "dcp"])
def test_proc_and_device_paths_are_bad_input(path: str, fmt: str | None) -> None:
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    args = ["inspect", path] + ([] if fmt is None else ["--format", fmt])
    code, err, _ = _dmlib(*args)
    assert code == 2, err
    assert "\n" not in err and path in err, err
