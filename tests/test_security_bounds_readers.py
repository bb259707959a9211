"""Bounded work and one reading for the pickle, torch zip, npz, flax msgpack and TOML readers.

Every hostile file is written here by a generator whose content is known by construction
(tests/_support/bombs.py writes pickles opcode by opcode and zips through ``zipfile``) and
opened by ``dmlib`` in a child process whose address space is capped
(``RLIMIT_AS`` = 1.5 GiB) and whose wall time is measured: each refusal must be exit 2,
one line naming the file and the problem, within 20 s. Where a file could be read two
ways, the two readings are shown by independent readers (``torch.load`` and ``zipfile``)
before dmlib is asked.
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import bombs as _bombs  # noqa: E402

import dmlib  # noqa: E402
from dmlib import _limits  # noqa: E402
from dmlib.errors import DmlibError, FormatError, UnsupportedError  # noqa: E402
from dmlib.io import _unpickle  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CAP = 3 << 29  # 1.5 GiB of address space for the child
SECONDS = 20.0

# caps its own address space, runs ``dmlib ARGS``, reports its exit status and peak memory
_CHILD = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
from dmlib.cli import main
code = main(sys.argv[2:])
with open("/proc/self/status") as f:
    peak = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
sys.stderr.write("\n@@" + json.dumps({"code": code, "peak": peak}) + "\n")
"""


def _refused(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, float, int]:
    """(exit status, error line, seconds, peak RSS bytes) of ``dmlib ARGS`` in a capped child."""
    full = {**os.environ, "PYTHONPATH": str(ROOT), "DMLIB_KERNELS": "numpy", **(env or {})}
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(CAP), *args],
        capture_output=True, text=True, env=full, timeout=120, check=False,
    )  # fmt: skip
    seconds = time.perf_counter() - t
    err, _, tail = proc.stderr.rpartition("\n@@")
    assert tail, f"child died (status {proc.returncode}): {proc.stderr[-800:]}"
    doc = json.loads(tail)
    return doc["code"], err.strip(), seconds, doc["peak"]


def _assert_refused(path: Path, *args: str, words: tuple[str, ...] = ()) -> str:
    code, err, seconds, peak = _refused(*args)
    assert code == 2, err
    assert "\n" not in err and "Traceback" not in err, err
    assert str(path) in err, err
    for w in words:
        assert w in err, err
    assert seconds < SECONDS, f"{seconds:.1f} s to refuse {path.name}"
    assert peak < CAP
    return err


# -- names, entries and containers -------------------------------------------------------------


def test_a_long_key_repeated_at_990_levels_is_refused_by_its_length(tmp_path: Path) -> None:
    p = tmp_path / "long.pt"
    _bombs.torch_zip(p, _bombs.pickle_long_key_nest(20_000, 990, 180))
    assert p.stat().st_size < 30_000  # 29 KB: the key is stored once, referred to 989 times
    err = _assert_refused(p, "inspect", str(p), words=("20,000 characters", "4,096"))
    assert "'kkkk" in err  # the name's start, cut


def test_flax_file_of_long_keys_is_refused_by_name_length(tmp_path: Path) -> None:
    pytest.importorskip("msgpack")
    p = tmp_path / "long.msgpack"
    p.write_bytes(_bombs.flax_long_key_nest(2000, 50, 15_000))
    assert p.stat().st_size < 200_000
    _assert_refused(p, "inspect", str(p), words=("characters", "4,096"))


def test_a_name_at_the_limit_reads_and_one_past_it_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("msgpack")
    import msgpack

    ok = tmp_path / "ok.msgpack"
    key = "k" * (_limits.MAX_NAME_CHARS - 2)  # "p." + key: exactly the limit
    ok.write_bytes(msgpack.packb({"p": {key: 1}}))
    with dmlib.open_tensors(ok) as ts:
        assert ts.scalars == {f"p.{key}": 1}
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(msgpack.packb({"p": {key + "k": 1}}))
    with pytest.raises(FormatError, match="4,097 characters"):
        dmlib.open_tensors(bad)
    pt = tmp_path / "bad.pt"
    _bombs.torch_zip(pt, _bombs.pickle_long_key_nest(_limits.MAX_NAME_CHARS + 1, 1, 1))
    with pytest.raises(FormatError, match="4,097 characters"):
        dmlib.open_tensors(pt)
    pt_ok = tmp_path / "ok.pt"  # {K: {K: {"a0": 0}}}: K.K.a0 is 2 * 2000 + 4 characters
    _bombs.torch_zip(pt_ok, _bombs.pickle_long_key_nest(2000, 2, 1))
    with dmlib.open_tensors(pt_ok) as ts:
        assert list(ts.scalars) == [f"{'k' * 2000}.{'k' * 2000}.a0"]


def test_an_integer_key_of_thousands_of_digits_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "int.pt"
    _bombs.torch_zip(p, _bombs.PROTO2 + b"}" + _bombs.p_int(10**5000) + _bombs.p_int(1) + b"s.")
    _assert_refused(p, "inspect", str(p), words=("key too long",))


def test_an_integer_value_of_thousands_of_digits_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "int.pt"  # 10**5000: log2 = 5000 * 3.3219... = 16609.6, so 16,610 bits
    _bombs.torch_zip(p, _bombs.PROTO2 + b"}" + _bombs.p_str("x") + _bombs.p_int(10**5000) + b"s.")
    _assert_refused(p, "inspect", str(p), words=("16,610 bits",))
    ok = tmp_path / "ok.pt"  # 2**4095 - 1 has 4095 bits; -(2**4095) is 4096 bits long
    _bombs.torch_zip(
        ok, _bombs.PROTO2 + b"}" + _bombs.p_str("x") + _bombs.p_int(-(2**4095)) + b"s."
    )
    with dmlib.open_tensors(ok) as ts:
        assert ts.scalars["x"] == -(2**4095)


def test_empty_lists_doubled_40_times_are_refused_by_the_walks_work(tmp_path: Path) -> None:
    p = tmp_path / "doubling.pt"
    _bombs.torch_zip(p, _bombs.pickle_empty_doubling(40))
    assert p.stat().st_size < 1500
    _assert_refused(p, "inspect", str(p), words=("containers",))


def test_dcp_metadata_goes_through_the_same_bounds(tmp_path: Path) -> None:
    folder = tmp_path / "dcp"
    folder.mkdir()
    (folder / ".metadata").write_bytes(_bombs.pickle_empty_doubling(40))
    _assert_refused(folder, "inspect", str(folder), words=("containers",))


def _empty_lists(n: int) -> bytes:
    """``{"x": [[], [], ...]}``: ``n`` empty lists, one byte each (EMPTY_LIST)."""
    return _bombs.PROTO2 + b"}" + _bombs.p_str("x") + b"](" + b"]" * n + b"es."


def test_containers_are_counted_while_unpickling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DMLIB_MAX_ENTRIES", "1000")
    ok = tmp_path / "ok.pt"  # the dict, the outer list and 998 empty lists: 1000
    _bombs.torch_zip(ok, _empty_lists(998))
    with dmlib.open_tensors(ok) as ts:
        assert len(ts) == 0 and not ts.scalars
    bad = tmp_path / "bad.pt"
    _bombs.torch_zip(bad, _empty_lists(999))
    with pytest.raises(FormatError, match="builds more than 1,000 containers"):
        dmlib.open_tensors(bad)


def test_ten_million_empty_lists_are_refused_while_unpickling(tmp_path: Path) -> None:
    p = tmp_path / "empties.pt"
    _bombs.torch_zip(p, _empty_lists(10_000_000))
    if _limits.max_containers() >= 10_000_000:
        pytest.skip("this machine's container limit admits 10M lists")
    _assert_refused(p, "inspect", str(p), words=("containers",))


def test_containers_are_counted_empty_ones_included() -> None:
    # {"x": x3}, x0 = [], x_{i+1} = [x_i, x_i]: x3 expands to 1 + 2 + 4 + 8 = 15 lists,
    # the dict makes 16 containers, and not one leaf
    obj = _unpickle.load(_bombs.pickle_empty_doubling(3), _unpickle.BASE_TABLE, what="p", path=None)
    limits = _unpickle.Limits(max_containers=16)
    assert _unpickle.check_shape(obj, what="p", path=None, limits=limits) == 0
    with pytest.raises(FormatError, match="at least 16 containers"):
        _unpickle.check_shape(obj, what="p", path=None, limits=_unpickle.Limits(max_containers=15))


def test_millions_of_shared_leaves_are_refused_before_the_walk(tmp_path: Path) -> None:
    p = tmp_path / "leaves.pt"
    _bombs.torch_zip(p, _bombs.pickle_shared_leaves(1_200_000, 8))
    assert p.stat().st_size < 1_300_000
    if _limits.max_entries() >= 9_600_000:
        pytest.skip("this machine's entry limit admits 9.6M entries")
    _assert_refused(p, "inspect", str(p), words=("9,600,000 entries", "DMLIB_MAX_ENTRIES"))


def test_the_entry_limit_is_lifted_for_a_trusted_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "leaves.pt"
    _bombs.torch_zip(p, _bombs.pickle_shared_leaves(1000, 8))  # 8 x 1000 Nones
    monkeypatch.setenv("DMLIB_MAX_ENTRIES", "7999")
    with pytest.raises(FormatError, match="8,000 entries"):
        dmlib.open_tensors(p)
    monkeypatch.setenv("DMLIB_MAX_ENTRIES", "8000")
    with dmlib.open_tensors(p) as ts:
        assert len(ts.scalars) == 8000 and ts.scalars["x.7.999"] is None


def test_entry_limit_scales_with_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DMLIB_MAX_ENTRIES", raising=False)
    for mem, want in ((64 << 30, (64 << 30) // 8192), (256 << 20, 100_000)):
        monkeypatch.setattr(_limits, "memory_bytes", lambda mem=mem: mem)
        assert _limits.max_entries() == want == _limits.max_containers()
        assert _limits.max_name_chars_total() == max(mem // 64, 64 << 20)


def test_names_together_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_limits, "max_name_chars_total", lambda: 10)
    budget = _limits.Flattening("f.pt")
    budget.leaf("abcde")
    budget.leaf("fghij")  # 10 characters: at the limit
    with pytest.raises(FormatError, match="more than 10 characters together"):
        budget.leaf("k")


def _empty_arrays(n: int) -> bytes:
    """``{"params": [[], [], ...]}``: ``n`` empty arrays (MessagePack: 0xdd array 32, 0x90)."""
    return b"\x81\xa6params\xdd" + struct.pack(">I", n) + b"\x90" * n


def test_flax_containers_are_counted_while_msgpack_decodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("msgpack")
    monkeypatch.setenv("DMLIB_MAX_ENTRIES", "1000")
    ok = tmp_path / "ok.msgpack"  # 998 empty arrays, their array and the map: 1000
    ok.write_bytes(_empty_arrays(998))
    with dmlib.open_tensors(ok) as ts:
        assert len(ts) == 0 and not ts.scalars
    bad = tmp_path / "bad.msgpack"
    bad.write_bytes(_empty_arrays(999))
    with pytest.raises(FormatError, match="more than 1,000 maps and arrays"):
        dmlib.open_tensors(bad)


def test_ten_million_empty_flax_arrays_are_refused(tmp_path: Path) -> None:
    pytest.importorskip("msgpack")
    p = tmp_path / "empties.msgpack"
    p.write_bytes(_empty_arrays(10_000_000))
    if _limits.max_containers() >= 10_000_000:
        pytest.skip("this machine's container limit admits 10M arrays")
    _assert_refused(p, "inspect", str(p), words=("maps and arrays",))


def test_two_flax_entries_of_one_name_are_refused(tmp_path: Path) -> None:
    msgpack = pytest.importorskip("msgpack")
    p = tmp_path / "clash.msgpack"
    p.write_bytes(msgpack.packb({"a.b": 1, "a": {"b": 2}}))
    with pytest.raises(UnsupportedError, match="two entries flatten to the name 'a.b'"):
        dmlib.open_tensors(p)


@pytest.mark.parametrize(
    "groups, state",
    [([{"params": [[1]]}], {}), ([{"params": [0]}], {0: 5}), ([{"params": [True]}], {})],
    ids=["a list as an id", "a number as a state", "a bool as an id"],
)
def test_malformed_optimizer_groups_keep_their_ids_not_a_bug(
    tmp_path: Path, groups: list[dict[str, object]], state: dict[int, object]
) -> None:
    torch = pytest.importorskip("torch")
    p = tmp_path / "opt.pt"
    torch.save({"model": {"w": torch.ones(2)}, "opt": {"state": state, "param_groups": groups}}, p)
    with dmlib.open_tensors(p) as ts:
        np.testing.assert_array_equal(ts["model.w"].load(), [1.0, 1.0])
    code, err, _, _ = _refused("inspect", str(p))
    assert code == 0, err


def test_renamed_optimizer_state_names_are_bounded(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    p = tmp_path / "opt.pt"  # one parameter named by 5,000 characters: its state is renamed
    long = "p" * 5000
    state = {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": [{"params": [0], "param_names": [long]}]}  # fmt: skip
    torch.save(state, p)
    with pytest.raises(FormatError, match="5,014 characters"):  # "state." + name + ".exp_avg"
        dmlib.open_tensors(p)


# -- huge dimensions and strides -----------------------------------------------------------------


def test_an_expanded_tensor_past_the_limit_is_refused_not_a_memory_error(tmp_path: Path) -> None:
    p = tmp_path / "dim.pt"  # 2**40 float32 elements over one stored element (stride 0)
    _bombs.torch_zip(p, _bombs.pickle_tensor((1 << 40,), (0,)), {"0": bytes(4)})
    torch = pytest.importorskip("torch")
    assert torch.load(p, weights_only=True)["w"].shape == (1 << 40,)  # torch reads it as a view
    _assert_refused(p, "inspect", str(p), words=("repeats", "4.0 TiB"))


def test_a_small_expanded_tensor_reads_as_torch_reads_it(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    p = tmp_path / "expand.pt"
    torch.save({"w": torch.tensor([1.0, 2.0, 3.0]).expand(4, 3)}, p)
    want = torch.load(p, weights_only=True)["w"].numpy()
    with dmlib.open_tensors(p) as ts:
        np.testing.assert_array_equal(ts["w"].load(), want)


def test_a_huge_stride_on_a_length_one_dimension_reads_as_torch_reads_it(tmp_path: Path) -> None:
    p = tmp_path / "stride.pt"
    data = np.array([5.0, 7.0], "<f4")
    _bombs.torch_zip(p, _bombs.pickle_tensor((1, 2), (1 << 62, 1), numel=2), {"0": data.tobytes()})
    torch = pytest.importorskip("torch")
    want = torch.load(p, weights_only=True)["w"].numpy()
    np.testing.assert_array_equal(want, [[5.0, 7.0]])
    with dmlib.open_tensors(p) as ts:
        np.testing.assert_array_equal(ts["w"].load(), want)


def test_a_zero_length_tensor_claiming_2_63_bytes_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "zero.pt"
    _bombs.torch_zip(p, _bombs.pickle_tensor((0, 1 << 62), (1, 1)), {"0": bytes(4)})
    _assert_refused(p, "inspect", str(p), words=("2**63",))


# -- TOML nesting ----------------------------------------------------------------------------------


def _good_pt(p: Path) -> Path:
    _bombs.torch_zip(p, _bombs.pickle_tensor((4,), (1,), numel=4), {"0": bytes(16)})
    return p


@pytest.mark.parametrize(
    "text",
    [
        "x = " + "[" * 5000 + "]" * 5000 + "\n",  # tomllib recurses: RecursionError
        "[" + ".".join(["a"] * 200) + "]\nb = 1\n",  # tables: nested without recursion
    ],
    ids=["arrays", "tables"],
)
def test_deeply_nested_mapping_file_is_refused(tmp_path: Path, text: str) -> None:
    good = _good_pt(tmp_path / "good.pt")
    deep = tmp_path / "deep.toml"
    deep.write_text(text, encoding="utf-8")
    _assert_refused(deep, "compare", str(good), str(good), "--map", str(deep), words=("deep",))


def test_deeply_nested_study_tables_are_refused(tmp_path: Path) -> None:
    study = tmp_path / "study.toml"
    study.write_text("title = 'x'\n[" + ".".join(["a"] * 200) + "]\nb = 1\n", encoding="utf-8")
    _assert_refused(study, "report", str(study), "--out", str(tmp_path / "out"), words=("64",))
    assert not (tmp_path / "out").exists()


def test_nesting_depth_is_measured_without_recursion() -> None:
    assert _limits.nesting_depth(1) == 0
    assert _limits.nesting_depth({"a": [1, {"b": []}]}) == 4  # dict, list, dict, list
    deep: list[object] = []
    for _ in range(100_000):  # far past Python's recursion limit
        deep = [deep]
    assert _limits.nesting_depth(deep, limit=64) == 65


def test_json_objects_of_too_many_keys_are_refused() -> None:
    hook = _limits.json_pairs_hook("trainer_state.json", "log entry")
    n = _limits.MAX_JSON_KEYS
    text = "{" + ",".join(f'"k{i}": {i}' for i in range(n)) + "}"
    assert len(json.loads(text, object_pairs_hook=hook)) == n
    with pytest.raises(FormatError, match=f"{n + 1:,} keys"):
        json.loads(text[:-1] + ', "one more": 0}', object_pairs_hook=hook)


# -- one reading of a zip --------------------------------------------------------------------------


def test_a_storage_member_twice_is_refused_where_torch_and_zipfile_disagree(tmp_path: Path) -> None:
    first = np.arange(4, dtype="<f4")
    p = tmp_path / "dup.pt"
    _bombs.torch_zip_duplicate_storage(p, first.tobytes(), bytes(16))
    with zipfile.ZipFile(p) as z:  # zipfile reads the last of the two
        assert z.read("archive/data/0") == bytes(16)
    torch = pytest.importorskip("torch")
    np.testing.assert_array_equal(torch.load(p, weights_only=True)["w"].numpy(), first)
    good = _good_pt(tmp_path / "zeros.pt")  # what the last member holds
    _assert_refused(p, "compare", str(good), str(p), words=("'archive/data/0'", "twice"))


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("csize", 8, ("sizes",)),
        ("usize", 8, ("sizes",)),
        ("crc", 1, ("CRC",)),
        ("method", 8, ("compression method 8",)),
    ],
)
def test_a_local_header_disagreeing_with_the_directory_is_refused(
    tmp_path: Path, field: str, value: int, words: tuple[str, ...]
) -> None:
    raw = _good_pt(tmp_path / "good.pt").read_bytes()
    p = tmp_path / f"{field}.pt"
    p.write_bytes(_bombs.patched_local_header(raw, "archive/data/0", field, value))
    h = _bombs.zip_local_header(raw, "archive/data/0")  # the patch changed that field only
    assert sum(a != b for a, b in zip(raw, p.read_bytes(), strict=True)) >= 1
    assert raw[:h] == p.read_bytes()[:h]
    _assert_refused(p, "inspect", str(p), words=("archive/data/0", "two readings", *words))


def test_a_local_header_naming_another_member_is_refused(tmp_path: Path) -> None:
    raw = _good_pt(tmp_path / "good.pt").read_bytes()
    p = tmp_path / "name.pt"
    p.write_bytes(_bombs.renamed_local_header(raw, "archive/data/0", "archive/data/9"))
    _assert_refused(p, "inspect", str(p), words=("archive/data/9",))


def test_bytes_before_the_archive_are_refused(tmp_path: Path) -> None:
    raw = _good_pt(tmp_path / "good.pt").read_bytes()
    p = tmp_path / "prefixed.pt"
    p.write_bytes(bytes(100) + raw)
    with zipfile.ZipFile(p) as z:  # zipfile skips the 100 bytes and reads the members
        assert z.read("archive/data/0") == bytes(16)
    _assert_refused(p, "inspect", str(p), words=("100 bytes before the archive",))


def test_an_end_record_counting_other_members_is_refused(tmp_path: Path) -> None:
    raw = bytearray(_good_pt(tmp_path / "good.pt").read_bytes())
    end = raw.rindex(b"PK\x05\x06")
    n = struct.unpack_from("<H", raw, end + 10)[0]
    struct.pack_into("<HH", raw, end + 8, n - 1, n - 1)  # one member fewer than listed
    p = tmp_path / "count.pt"
    p.write_bytes(bytes(raw))
    _assert_refused(p, "inspect", str(p), words=(f"counts {n - 1} members",))


def test_two_archive_folders_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "two.pt"
    _bombs.two_archives(p, bytes(16))
    _assert_refused(p, "inspect", str(p), words=("2 data.pkl",))


def test_a_member_outside_the_archive_folder_is_refused(tmp_path: Path) -> None:
    p = _good_pt(tmp_path / "extra.pt")
    with zipfile.ZipFile(p, "a") as z:
        z.writestr("other/data/0", bytes(16))
    torch = pytest.importorskip("torch")
    with pytest.raises(RuntimeError, match="not in a subdirectory"):
        torch.load(p, weights_only=True)
    _assert_refused(p, "inspect", str(p), words=("'other/data/0'", "outside"))


def test_real_torch_and_numpy_archives_still_read(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    p = tmp_path / "real.pt"  # torch writes data descriptors (flag 0x8) after each member
    state = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(2)}
    torch.save(state, p)
    with dmlib.open_tensors(p) as ts:
        for k, v in state.items():
            np.testing.assert_array_equal(ts[k].load(), v.numpy())
    for save in (np.savez, np.savez_compressed):  # zip64 extra fields in the local headers
        z = tmp_path / f"{save.__name__}.npz"
        save(z, w=np.arange(5, dtype=np.int32))
        with dmlib.open_tensors(z) as ts:
            np.testing.assert_array_equal(ts["w"].load(), np.arange(5))


def test_npz_local_header_disagreeing_with_the_directory_is_refused(tmp_path: Path) -> None:
    z = tmp_path / "w.npz"
    np.savez(z, w=np.zeros(4, np.float32))
    p = tmp_path / "local.npz"
    p.write_bytes(_bombs.patched_local_header(z.read_bytes(), "w.npy", "usize", 8))
    _assert_refused(p, "inspect", str(p), words=("w.npy", "two readings"))


def test_npz_member_twice_is_refused(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate it writes
        with zipfile.ZipFile(buf, "w") as z:
            for arr in (np.zeros(2, "<f4"), np.ones(2, "<f4")):
                with z.open("w.npy", "w") as f:
                    np.lib.format.write_array(f, arr)
    p = tmp_path / "dup.npz"
    p.write_bytes(buf.getvalue())
    _assert_refused(p, "inspect", str(p), words=("'w.npy'", "twice"))


def test_refusals_are_dmlib_errors_in_process(tmp_path: Path) -> None:
    p = tmp_path / "dup.pt"
    _bombs.torch_zip_duplicate_storage(p, bytes(16), bytes(16))
    with pytest.raises(DmlibError, match="twice"):
        dmlib.open_tensors(p)
