"""Hostile Orbax checkpoints: bounded by this machine, confined to the checkpoint, exit 2.

Each input is built here (``tests/_support/orbax_hostile.py``: zarr metadata, zstd and
gzip streams, OCDBT frames written by hand from tensorstore's format description) and
read by ``dmlib inspect`` or ``dmlib compare`` in a child process whose address space is
capped (``RLIMIT_AS``), so that a regression fails here instead of exhausting the
machine. Every refusal must be exit 2 with one line naming the checkpoint and the
problem, within 20 s, with the child's peak resident memory (``VmHWM``) under 1.5 GB,
while the inputs declare 2 GiB to 1 TiB. Values that do read are checked against the
fixtures' reference ``.npz`` (numpy) or against bytes known by construction.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import orbax_hostile as H  # noqa: E402

from dmlib import _limits  # noqa: E402
from dmlib.errors import DmlibError  # noqa: E402

pytest.importorskip("zstandard")
pytest.importorskip("crc32c")

ROOT = Path(__file__).resolve().parents[1]
JAX = (ROOT / ".." / "shared" / "fixtures" / "jax").resolve()
GIB = 1 << 30
PEAK = 1536 << 20  # 1.5 GB: the most a refusal may hold
CAP = 4 * GIB  # the child's address space: a regression runs out here, not the machine
WALL = 20.0

# runs ``dmlib <args>`` under an address-space cap; reports exit status and peak memory
_CHILD = r"""
import json, resource, sys
cap = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
from dmlib.cli import main
code = main(sys.argv[2:])
with open("/proc/self/status") as f:
    peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
sys.stdout.flush()
sys.stderr.write("\n@@" + json.dumps({"code": code, "peak": peak}) + "\n")
"""


def _dmlib(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str, int]:
    """(exit status, stdout, the error line, peak RSS bytes) of ``dmlib ARGS`` in a child,
    which must finish within ``WALL`` seconds."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(CAP), *args],
        capture_output=True, text=True, env=full, timeout=WALL, check=False,
    )  # fmt: skip
    assert time.monotonic() - t0 < WALL
    err, _, tail = proc.stderr.rpartition("\n@@")
    assert tail, f"child died (status {proc.returncode}): {proc.stderr[-800:]}"
    doc = json.loads(tail)
    return doc["code"], proc.stdout, err.strip(), doc["peak"]


def _refused(path: Path, *words: str, args: tuple[str, ...] = ()) -> str:
    """``dmlib inspect PATH`` (or ``args``) is exit 2, one line naming ``path`` and ``words``,
    in bounded memory."""
    code, _, err, peak = _dmlib(*(args or ("inspect", str(path))))
    assert code == 2, err
    assert "\n" not in err and "Traceback" not in err, err
    assert str(path) in err, err
    for w in words:
        assert w in err, err
    assert peak < PEAK, f"peak {peak} bytes"
    return err


@pytest.fixture
def jax_fixtures() -> Path:
    if not JAX.is_dir():
        pytest.skip(f"real JAX fixtures not found at {JAX}")
    return JAX


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    for dirpath, dirs, files in os.walk(dst):
        for n in dirs + files:
            os.chmod(os.path.join(dirpath, n), 0o755 if n in dirs else 0o644)
    return dst


# -- decompression: bounded by the machine, never by what the file declares ------------------


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(H.zarr2_zstd_bomb, id="zarr2-zstd"),
        pytest.param(H.zarr3_zstd_bomb, id="zarr3-zstd"),
        pytest.param(H.zarr3_gzip_bomb, id="zarr3-gzip", marks=pytest.mark.slow),  # 6-10 s
    ],
)
def test_a_small_chunk_declared_as_2_gib_is_refused(tmp_path: Path, build) -> None:
    ck = build(tmp_path / "ck")
    stored = sum(p.stat().st_size for p in ck.rglob("*") if p.is_file())
    assert stored < 4 << 20  # a few MiB at most for 2 GiB declared
    _refused(ck, "chunk w/", "set DMLIB_MAX_DECOMPRESSED")


def test_a_zstd_chunk_without_a_content_size_stops_at_the_limit(tmp_path: Path) -> None:
    ck = H.item(
        tmp_path / "ck",
        {"w": H.zarray([GIB // 2], [GIB // 2])},
        {"w/0": H.zstd_zeros(2 * GIB, content_size=False)},
    )
    _refused(ck, "chunk w/0", "decodes to more than")


def test_an_honest_chunk_reads_and_the_limit_can_be_lifted(tmp_path: Path) -> None:
    """A chunk inflating past what its stored bytes may become is read when the user lifts
    the ratio; the values are the zeros it was built from."""
    floor = _limits.ratio_floor()
    if floor > GIB:
        pytest.skip(f"the ratio floor here ({floor} bytes) makes the honest chunk too large")
    n = (floor + (64 << 20)) // 4  # float32 elements just past the floor
    ck = H.item(tmp_path / "ck", {"w": H.zarray([n], [n])}, {"w/0": H.zstd_zeros(4 * n)})
    _refused(ck, "zstd frame claims")
    code, out, err, _ = _dmlib("inspect", str(ck), "--json", env={"DMLIB_MAX_RATIO": "1000000"})
    assert code == 0, err
    (t,) = json.loads(out)["tensors"]
    h = hashlib.sha256()
    zeros = bytes(16 << 20)
    left = 4 * n
    while left:
        h.update(zeros[: min(left, len(zeros))])
        left -= min(left, len(zeros))
    assert t["data_hash"] == h.hexdigest() and t["shape"] == [n]


@pytest.mark.parametrize("content_size", [True, False])
def test_an_ocdbt_node_is_bounded_by_dmlib_not_by_its_manifest(
    tmp_path: Path, content_size: bool
) -> None:
    # the manifest allows 2**32-byte nodes; the node inflates to 3 GiB
    db = H.ocdbt_node_bomb(tmp_path / "db", content_size=content_size)
    err = _refused(db, "B+tree node d/f@0")
    assert str(_limits.MAX_TREE_NODE) in err


def test_ocdbt_keys_spelled_by_shared_prefixes_are_bounded(tmp_path: Path) -> None:
    """60,000 keys of 64 KiB each (3.9 GB) from a 400 KiB node: refused when the keys made
    pass 1/64 of memory, before they exhaust it."""
    db = H.ocdbt_key_bomb(tmp_path / "db")
    assert (db / "d/f").stat().st_size < 512 << 10
    _refused(db, "B+tree node d/f@0", "keys and data file paths of more than")
    # the same shape, small, reads: three keys of 64 KiB
    from dmlib.io import ocdbt

    small = H.ocdbt_key_bomb(tmp_path / "small", n=3)
    assert sorted(len(k) for k in ocdbt.open_store(small).keys) == [1 << 16] * 3


# -- the chunk grid: never enumerated, never allocated whole ---------------------------------


def test_absent_chunks_allocate_nothing_at_open_and_a_nonzero_fill_is_bounded(
    tmp_path: Path,
) -> None:
    ck = H.absent_chunks(tmp_path / "ck", 2 * GIB, fill=1.5)
    code, out, err, peak = _dmlib("inspect", str(ck), "--no-hash")
    assert code == 0 and "536870912" in out, err  # the declared shape, shown
    assert peak < 256 << 20
    _refused(ck, "absent chunks would fill 2.0 GiB", "1.5")


def test_absent_chunks_of_zeros_read_without_touching_memory(tmp_path: Path) -> None:
    ck = H.absent_chunks(tmp_path / "ck", GIB, fill=0)
    code, out, err, peak = _dmlib("inspect", str(ck), "--json")
    assert code == 0, err
    (t,) = json.loads(out)["tensors"]
    h = hashlib.sha256()
    zeros = bytes(16 << 20)
    for _ in range(GIB // len(zeros)):
        h.update(zeros)
    assert t["data_hash"] == h.hexdigest()
    assert peak < PEAK


@pytest.mark.parametrize(
    ("shape", "chunks"), [([10**12], [1]), ([10**6, 10**6], [1, 1])], ids=["1e12", "1e6x1e6"]
)
def test_a_vast_chunk_grid_opens_at_once_and_is_refused_when_read(
    tmp_path: Path, shape: list[int], chunks: list[int]
) -> None:
    ck = H.huge_grid(tmp_path / "ck", shape, chunks)
    code, _, err, peak = _dmlib("inspect", str(ck), "--no-hash")
    assert code == 0 and peak < 256 << 20, err
    _refused(ck, "the array declares 931.3 GiB", "set DMLIB_MAX_DECOMPRESSED")


def test_a_grid_of_many_chunks_is_walked_only_as_far_as_the_stored_ones(tmp_path: Path) -> None:
    """2**28 one-byte chunks (256 MiB, within the machine), one stored: the missing one is
    named at once; with the writer's word, the array reads as that chunk then zeros."""
    ck = H.item(
        tmp_path / "ck",
        {"w": H.zarray([1 << 28], [1], "|u1", compressor=None)},
        {"w/0": b"\x07"},
    )
    _refused(ck, "chunk w/1 is missing")
    md = H.metadata(["w"], store_array_data_equal_to_fill_value=False)
    (ck / "_METADATA").write_text(json.dumps(md))
    import dmlib

    t0 = time.monotonic()
    with dmlib.open_tensors(ck) as ts:
        got = ts["w"].load()
        assert got.shape == (1 << 28,) and got[0] == 7 and not got[1:].any()
    assert time.monotonic() - t0 < WALL


def test_a_stored_key_outside_a_vast_grid_is_refused_at_open(tmp_path: Path) -> None:
    ck = H.huge_grid(tmp_path / "ck", [10**6, 10**6], [1, 1])
    (ck / "w/1000000.0").write_bytes(b"\x00")
    _refused(ck, "w/1000000.0", "not a chunk of its grid")


def test_a_1_tib_shard_is_refused(tmp_path: Path) -> None:
    _refused(H.tib_shard(tmp_path / "ck"), "the array declares 1.0 TiB")


def test_a_shard_index_larger_than_the_shard_is_refused(tmp_path: Path) -> None:
    n = 1 << 20  # a 1 MiB array in one shard of 1-byte inner chunks: a 16 MiB index
    shard = {"name": "sharding_indexed", "configuration": {
        "chunk_shape": [1], "codecs": [H.BYTES], "index_codecs": [H.BYTES]}}  # fmt: skip
    ck = H.item(
        tmp_path / "ck", {"w": H.zarr_json([n], [n], [shard], "uint8")}, {"w/c/0": bytes(64)}
    )
    _refused(ck, "shorter than its index (16777216)")


# -- JSON nested deeply ------------------------------------------------------------------------


def test_deeply_nested_metadata_is_bad_input(tmp_path: Path) -> None:
    _refused(H.deep_metadata(tmp_path / "a"), "_METADATA is nested too deeply")
    _refused(H.deep_zarray(tmp_path / "b"), "w: array metadata is nested too deeply")
    # zarr.json, and 65 levels (deeper than the limit, far from the interpreter's)
    ck = H.item(tmp_path / "c", {"w": H.zarr_json([2], [2], [H.BYTES])}, {"w/c/0": bytes(8)})
    md = json.loads((ck / "w/zarr.json").read_text())
    (ck / "w/zarr.json").write_text(json.dumps({**md, "attributes": {"x": _nest(65)}}))
    _refused(ck, "w: array metadata is nested too deeply")


def _nest(depth: int) -> list:
    out: list = []
    for _ in range(depth - 1):
        out = [out]
    return out


# -- confined to the checkpoint: symlinks leading out, FIFOs, devices --------------------------


def _outside(tmp_path: Path, src: Path) -> Path:
    """Move ``src`` (file or folder) out of the checkpoint and leave a symlink in its place."""
    away = tmp_path / "elsewhere" / src.name
    away.parent.mkdir(exist_ok=True)
    shutil.move(str(src), str(away))
    src.symlink_to(away)
    return away


def _biggest(folder: Path) -> Path:
    return max((p for p in folder.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.mark.parametrize(
    ("layout", "pick", "named"),
    [
        ("orbax_no_ocdbt", lambda s: s / "default/model.l1.kernel/0.0", "model.l1.kernel/0.0"),
        ("orbax_no_ocdbt", lambda s: s / "default/model.l1.kernel", "model.l1.kernel/.zarray"),
        ("orbax_ocdbt_zarr2", lambda s: _biggest(s / "default/ocdbt.process_0/d"), "data file"),
        ("orbax_ocdbt_zarr2", lambda s: s / "default/ocdbt.process_0", "data file ocdbt.process_0"),
        ("orbax_ocdbt_zarr2", lambda s: s / "default/manifest.ocdbt", "manifest.ocdbt"),
        ("orbax_ocdbt_zarr2", lambda s: s / "default/_METADATA", "_METADATA"),
    ],
    ids=["chunk", "leaf-folder", "data-file", "data-folder", "manifest", "metadata"],
)
def test_a_symlink_leading_out_of_the_checkpoint_is_refused_naming_it(
    jax_fixtures: Path, tmp_path: Path, layout: str, pick, named: str
) -> None:
    step = _copy(jax_fixtures / layout / "A_step10", tmp_path / "10")
    target = pick(step)
    away = _outside(tmp_path, target)
    err = _refused(
        step, named, "leads outside the checkpoint",
        args=("compare", str(step), str(jax_fixtures / layout / "A_step10")),
    )  # fmt: skip
    assert str(away.parent) in err  # where it leads
    # a symlink whose target is missing leads out just the same (not "a missing chunk")
    if away.is_file():
        away.unlink()
        _refused(step, named, "leads outside the checkpoint")


@pytest.mark.parametrize("layout", ["orbax_no_ocdbt", "orbax_ocdbt_zarr2", "orbax_ocdbt_zarr3"])
def test_symlinks_that_stay_inside_the_checkpoint_are_read(
    jax_fixtures: Path, tmp_path: Path, layout: str
) -> None:
    import dmlib

    step = _copy(jax_fixtures / layout / "A_step10", tmp_path / "10")
    item = step / "default"
    # a leaf folder or the per-process database moved aside and linked back (relative link),
    # and one chunk or data file linked by an absolute path
    moved = item / ("model.l1.kernel" if layout == "orbax_no_ocdbt" else "ocdbt.process_0")
    moved.rename(item / "moved")
    moved.symlink_to("moved")
    one = (item / "moved/0.0") if layout == "orbax_no_ocdbt" else _biggest(item / "moved/d")
    (item / "kept").write_bytes(one.read_bytes())
    one.unlink()
    one.symlink_to(item / "kept")
    # the checkpoint itself opened through a symlink
    link = tmp_path / "latest"
    link.symlink_to(step)
    z = np.load(jax_fixtures / "reference/A_step_10.npz")
    with dmlib.open_tensors(link) as ts:
        by_ref = {n.removesuffix(".value"): n for n in ts}
        assert sorted(by_ref) == sorted(z.files)
        for name in z.files:
            assert ts[by_ref[name]].load().tobytes() == z[name].tobytes(), name


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
@pytest.mark.parametrize(
    ("layout", "pick"),
    [
        ("orbax_no_ocdbt", lambda s: s / "default/model.l1.kernel/0.0"),
        ("orbax_ocdbt_zarr2", lambda s: _biggest(s / "default/ocdbt.process_0/d")),
        ("orbax_ocdbt_zarr2", lambda s: s / "default/manifest.ocdbt"),
        ("orbax_ocdbt_zarr2", lambda s: s / "default/_METADATA"),
    ],
    ids=["chunk", "data-file", "manifest", "metadata"],
)
def test_a_fifo_is_refused_without_waiting_on_it(
    jax_fixtures: Path, tmp_path: Path, layout: str, pick
) -> None:
    step = _copy(jax_fixtures / layout / "A_step10", tmp_path / "10")
    target = pick(step)
    target.unlink()
    os.mkfifo(target)
    _refused(step, target.name, "not a regular file")
    # where absent chunks hold the fill value, a FIFO is still not an absent chunk
    if layout == "orbax_no_ocdbt":
        md_path = step / "default/_METADATA"
        md = json.loads(md_path.read_text())
        md_path.write_text(json.dumps({**md, "store_array_data_equal_to_fill_value": False}))
        _refused(step, target.name, "not a regular file")


def test_a_device_behind_a_symlink_is_refused(jax_fixtures: Path, tmp_path: Path) -> None:
    step = _copy(jax_fixtures / "orbax_no_ocdbt/A_step10", tmp_path / "10")
    chunk = step / "default/model.l1.kernel/0.0"
    chunk.unlink()
    chunk.symlink_to("/dev/zero")
    _refused(step, "model.l1.kernel/0.0", "/dev/zero")
    # opened through a symlink: the message names the folder as it was given
    link = tmp_path / "latest"
    link.symlink_to(step)
    _refused(link, "default/model.l1.kernel/0.0", "/dev/zero")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this platform")
def test_a_fifo_swapped_in_after_the_check_is_not_waited_on(tmp_path: Path) -> None:
    """read_regular opens without blocking and checks what it opened."""
    from dmlib.safepaths import confined_file, read_regular

    f = tmp_path / "chunk"
    f.write_bytes(b"abc")
    real, size = confined_file(str(tmp_path.resolve()), f, what="chunk") or ("", 0)
    assert size == 3 and read_regular(real, 1, what="chunk", where="ck") == b"bc"
    f.unlink()
    os.mkfifo(f)
    t0 = time.monotonic()
    with pytest.raises(DmlibError, match="chunk is not a regular file"):
        read_regular(real, what="chunk", where="ck")
    assert time.monotonic() - t0 < 5


# -- names and metadata sizes ------------------------------------------------------------------


def test_long_leaf_names_and_large_metadata_are_refused(tmp_path: Path) -> None:
    # a leaf name joined from its keys past the 4096 characters a name may have
    md = H.metadata(["w"])
    md["tree_metadata"]["('w',)"]["key_metadata"] = [{"key": "k" * 3000}, {"key": "w" * 3000}]
    ck = H.item(tmp_path / "a", {}, md=md)
    _refused(ck, "a leaf name of 6,001 characters starting", "kkkk")
    # an array's metadata file far larger than any real one (1 MiB at most)
    ck = H.item(tmp_path / "b", {"w": H.zarray([2], [2], compressor=None)}, {"w/0": bytes(8)})
    md_w = json.loads((ck / "w/.zarray").read_text())
    (ck / "w/.zarray").write_text(json.dumps({**md_w, "pad": " " * (2 << 20)}))
    _refused(ck, "leaf 'w': .zarray of", "more than 1048576")
    # a _METADATA larger than a text file read whole may be
    ck = H.item(tmp_path / "c", {"w": H.zarray([2], [2], compressor=None)}, {"w/0": bytes(8)})
    with open(ck / "_METADATA", "a") as f:
        f.write(" " * (_limits.MAX_TEXT_BYTES + 1))
    size = (ck / "_METADATA").stat().st_size
    _refused(ck, f"_METADATA is {size:,} bytes, more than the {_limits.MAX_TEXT_BYTES:,} bytes")
