"""No code runs from any pickle dmlib reads: every reader refuses a corpus of payloads.

Each payload is written here, opcode by opcode, and fed to every reader that unpickles:
a torch zip (``data.pkl``), a legacy torch file, a DCP ``.metadata`` and a DCP chunk
(a ``torch.save`` image inside a ``.distcp`` file). Each must be refused with one line
that names the file and the global (or opcode, or limit) at fault, and the payload's
command (``touch SENTINEL``) must never have run. The payloads are live: a control runs
some of them through Python's own ``pickle`` and sees the sentinel appear.
"""

from __future__ import annotations

import pickle
import shutil
import struct
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dmlib
from dmlib.cli import main
from dmlib.errors import FormatError, UnsafePickleError

# -- pickle opcodes, spelled out ------------------------------------------------------------


def _str(s: str) -> bytes:
    b = s.encode()
    return b"\x8c" + bytes([len(b)]) + b if len(b) < 256 else b"X" + struct.pack("<I", len(b)) + b


def _glob(module: str, name: str) -> bytes:  # protocol 2 GLOBAL
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _sglob(module: str, name: str) -> bytes:  # protocol 4 STACK_GLOBAL
    return _str(module) + _str(name) + b"\x93"


def _call(func: bytes, *args: bytes) -> bytes:  # func(*args) by REDUCE
    return func + b"(" + b"".join(args) + b"tR"


def _p2(body: bytes) -> bytes:
    return b"\x80\x02" + body + b"."


def _p4(body: bytes) -> bytes:
    return b"\x80\x04" + body + b"."


def _storage_pid(key: str = "0", cls: bytes = _glob("torch", "FloatStorage"), n: int = 4) -> bytes:
    return (
        b"(" + _str("storage") + cls + _str(key) + _str("cpu") + b"J" + struct.pack("<i", n) + b"tQ"
    )


def _tensor_args(storage: bytes, offset: int = 0, size: int = 4) -> bytes:
    return (
        storage
        + b"J"
        + struct.pack("<i", offset)
        + b"J"
        + struct.pack("<i", size)
        + b"\x85K\x01\x85\x89"
    )


def _payloads(cmd: str) -> dict[str, tuple[bytes, tuple[str, ...]]]:
    """name -> (pickle, fragments of which the refusal names at least one)."""
    sh = _str(cmd)
    # l0 = [0, 0]; l_{i+1} = [l_i, l_i] (BINPUT 0, MARK, BINGET 0 twice, LIST): 2**27 leaves
    sharing = b"(K\x00K\x00l" + b"q\x00(h\x00h\x00l" * 26
    nested = b"]" * 100_000 + b"a" * 99_999  # a list in a list ... 100,000 deep
    return {
        "os.system by GLOBAL": (_p2(_call(_glob("os", "system"), sh)), ("os.system",)),
        "posix.system by GLOBAL": (_p2(_call(_glob("posix", "system"), sh)), ("posix.system",)),
        "dotted name inside an allowed module (STACK_GLOBAL)": (
            _p4(_call(_sglob("torch.distributed.checkpoint.filesystem", "os.system"), sh)),
            ("os.system",),
        ),
        "dotted qualname through torch._utils": (
            _p2(_call(_glob("torch._utils", "os.system"), sh)),
            ("torch._utils.os.system",),
        ),
        "subprocess by STACK_GLOBAL": (
            _p4(
                _call(
                    _sglob("subprocess", "check_call"), b"(" + _str("sh") + _str("-c") + sh + b"l"
                )
            ),
            ("subprocess.check_call",),
        ),
        "builtins.eval": (
            _p2(_call(_glob("builtins", "eval"), _str(f"__import__('os').system({cmd!r})"))),
            ("builtins.eval",),
        ),
        "builtins.getattr": (
            _p2(_call(_call(_glob("builtins", "getattr"), _glob("os", "path"), _str("join")), sh)),
            ("builtins.getattr",),
        ),
        "__builtin__.__import__": (
            _p2(_call(_glob("__builtin__", "__import__"), _str("os"))),
            ("__builtin__.__import__",),
        ),
        "functools.partial": (
            _p2(_call(_call(_glob("functools", "partial"), _glob("os", "system"), sh))),
            ("functools.partial",),
        ),
        "numpy _reconstruct of another class": (
            _p2(
                _call(
                    _glob("numpy.core.multiarray", "_reconstruct"),
                    _glob("torch", "FloatStorage"),
                    b"K\x00\x85",
                    b"C\x01b",
                )
            ),
            ("not a plain ndarray", "numpy.core.multiarray._reconstruct"),
        ),
        "numpy object array": (
            _p2(_call(_glob("numpy", "dtype"), _str("O"), b"\x89\x88")),
            ("numpy.dtype",),
        ),
        "_rebuild_from_type_v2 with a hostile func": (
            _p2(
                _call(
                    _glob("torch._tensor", "_rebuild_from_type_v2"),
                    _glob("collections", "OrderedDict"),
                    _glob("torch", "Tensor"),
                    b")",
                    b"N",
                )
            ),
            ("_rebuild_from_type_v2",),
        ),
        "_rebuild_parameter with hooks": (
            _p2(
                _call(
                    _glob("torch._utils", "_rebuild_parameter"),
                    _call(
                        _glob("torch._utils", "_rebuild_tensor_v2"),
                        _tensor_args(_storage_pid()),
                        _call(_glob("collections", "OrderedDict")),
                    ),
                    b"\x88",
                    b"}K\x01" + _str("hook") + b"s",
                )
            ),  # fmt: skip
            ("_rebuild_parameter", "_rebuild_tensor_v2", "backward hooks", "persistent id"),
        ),
        "_rebuild_tensor on a string as storage": (
            _p2(
                _call(_glob("torch._utils", "_rebuild_tensor"), _tensor_args(_str("not a storage")))
            ),
            ("_rebuild_tensor", "not a storage"),
        ),
        "_rebuild_tensor outside its storage": (
            _p2(
                _call(
                    _glob("torch._utils", "_rebuild_tensor"),
                    _tensor_args(_storage_pid(), offset=3, size=4),
                )
            ),
            ("_rebuild_tensor", "storage", "persistent id"),
        ),
        "INST opcode": (b"(S'" + cmd.encode() + b"'\nios\nsystem\n.", ("INST",)),
        "OBJ opcode": (b"\x80\x02(" + _glob("os", "system") + sh + b"o.", ("os.system",)),
        "NEWOBJ of a table function": (
            _p2(_glob("collections", "OrderedDict") + b")\x81"),
            ("NEWOBJ",),
        ),
        "BUILD on a dict": (_p2(b"}}" + _str("__class__") + b"K\x01sb"), ("BUILD",)),
        "EXT1 opcode": (_p2(b"\x82\x01"), ("EXT1",)),
        "memo index bomb": (_p2(b"]r\xff\xff\xff\xff"), ("memo index",)),
        "nesting 100,000 deep": (_p2(nested), ("deep",)),
        "shared-reference bomb": (_p2(sharing), ("expands to at least",)),
        "a list that contains itself": (_p2(b"]q\x00h\x00a"), ("contains itself",)),
        "a dict keyed by a nested tuple": (_p2(b"}K\x00\x85\x85K\x01s"), ("dictionary key",)),
    }


CMD_SENTINEL = "dmlib-sentinel"


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[Path, dict[str, tuple[bytes, tuple[str, ...]]]]:
    sentinel = tmp_path / CMD_SENTINEL
    return sentinel, _payloads(f"touch {sentinel}")


# -- the readers ----------------------------------------------------------------------------


def _torch_zip(path: Path, payload: bytes) -> Path:
    p = path / "payload.pt"
    with zipfile.ZipFile(p, "w", zipfile.ZIP_STORED) as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/data/0", bytes(16))
        z.writestr("archive/version", "3\n")
    return p


def _torch_legacy(path: Path, payload: bytes) -> Path:
    p = path / "payload.bin"
    info = {
        "protocol_version": 1001,
        "little_endian": True,
        "type_sizes": {"short": 2, "int": 4, "long": 4},
    }
    head = b"".join(pickle.dumps(x, protocol=2) for x in (0x1950A86A20F9469CFC6C, 1001, info))
    p.write_bytes(head + payload + pickle.dumps([], protocol=2))
    return p


def _dcp_metadata(path: Path, payload: bytes) -> Path:
    d = path / "dcp_md"
    d.mkdir()
    (d / ".metadata").write_bytes(payload)
    return d


def _dcp_blob(path: Path, payload: bytes) -> Path:
    """A real DCP checkpoint whose one chunk is replaced by a torch.save image of ``payload``."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    template, d = path.parent / "dcp_template", path / "dcp_blob"
    if not template.exists():  # one dcp.save per test, copied for each payload
        with pytest.warns(UserWarning, match="single process"):
            dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(template), no_dist=True)
    shutil.copytree(template, d)
    image = _torch_zip(path, payload).read_bytes()
    (d / "__0_0.distcp").write_bytes(image)
    md = pickle.loads((d / ".metadata").read_bytes())  # the test's own trusted copy
    for info in md.storage_data.values():
        info.offset, info.length = 0, len(image)
    (d / ".metadata").write_bytes(pickle.dumps(md))
    return d


READERS: dict[str, Callable[[Path, bytes], Path]] = {
    "torch-zip": _torch_zip,
    "torch-legacy": _torch_legacy,
    "dcp-metadata": _dcp_metadata,
    "dcp-blob": _dcp_blob,
}


def _read_all(path: Path) -> None:
    with dmlib.open_tensors(path) as ts:
        for t in ts.values():
            t.load()


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_payload_is_refused_naming_the_global_and_runs_nothing(
    tmp_path: Path, corpus: tuple[Path, dict], reader: str
) -> None:
    sentinel, payloads = corpus
    results = {}
    for name, (payload, fragments) in payloads.items():
        where = tmp_path / f"{reader}-{len(results)}"
        where.mkdir()
        path = READERS[reader](where, payload)
        start = time.perf_counter()
        with pytest.raises(FormatError) as info:
            _read_all(path)
        took = time.perf_counter() - start
        msg = str(info.value)
        assert "\n" not in msg and len(msg) < 600, (name, msg)
        assert msg.startswith(str(path)), (name, msg)
        assert any(f in msg for f in fragments), (name, msg)
        assert took < 5.0, (name, took)  # bombs are refused, not expanded (that took minutes)
        assert not sentinel.exists(), name
        results[name] = type(info.value).__name__
    assert len(results) == len(payloads) >= 25


@pytest.mark.slow
def test_the_payloads_are_live(tmp_path: Path) -> None:
    """A control: Python's own unpickler runs them (so the refusals above are not vacuous)."""
    sentinel = tmp_path / "control"
    payloads = _payloads(f"touch {sentinel}")
    live = ["os.system by GLOBAL", "subprocess by STACK_GLOBAL", "builtins.eval", "INST opcode",
            "OBJ opcode", "dotted name inside an allowed module (STACK_GLOBAL)"]  # fmt: skip
    for name in live:
        code = "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"
        subprocess.run([sys.executable, "-c", code], input=payloads[name][0], timeout=60)
        assert sentinel.exists(), name
        sentinel.unlink()


@pytest.mark.slow
def test_real_dcp_checkpoint_whose_metadata_runs_a_command_first_is_refused(tmp_path: Path) -> None:
    """The critical case: a genuine dcp.save directory, its .metadata prefixed by a command."""
    torch = pytest.importorskip("torch")
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    d = tmp_path / "ck"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(d), no_dist=True)
    genuine = (d / ".metadata").read_bytes()
    assert genuine[:2] == b"\x80\x04"
    control, sentinel = tmp_path / "control", tmp_path / "sentinel"

    def evil(target: Path) -> bytes:
        run = _call(
            _sglob("torch.distributed.checkpoint.filesystem", "os.system"), _str(f"touch {target}")
        )
        return b"\x80\x04" + run + b"0" + genuine[2:]  # the command, then the genuine metadata

    code = "import pickle, sys, torch.distributed.checkpoint; print(type(pickle.loads(sys.stdin.buffer.read())).__name__)"
    out = subprocess.run(
        [sys.executable, "-c", code], input=evil(control), capture_output=True, timeout=120
    )
    assert control.exists() and b"Metadata" in out.stdout  # live: runs, then loads the metadata
    (d / ".metadata").write_bytes(evil(sentinel))
    for argv in (["inspect", str(d)], ["compare", str(d), str(d)]):
        assert main(argv) == 2
        assert not sentinel.exists()
    with pytest.raises(UnsafePickleError, match=r"os\.system"):
        dmlib.open_tensors(d)


def test_sharing_bomb_is_refused_fast_and_small(tmp_path: Path) -> None:
    """A 1 KiB torch file nesting 2**26 references: refused in well under a second."""
    payload = _payloads("true")["shared-reference bomb"][0]
    assert len(payload) < 1024
    path = _torch_zip(tmp_path, payload)
    start = time.perf_counter()
    with pytest.raises(FormatError, match="expands to at least"):
        dmlib.open_tensors(path)
    assert time.perf_counter() - start < 0.5


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(body=st.binary(max_size=64), proto=st.sampled_from([b"", b"\x80\x02", b"\x80\x04"]))
def test_arbitrary_bytes_are_read_or_refused_never_another_error(body: bytes, proto: bytes) -> None:
    """Whatever the bytes, the unpickler returns or raises dmlib's refusal (or hands over)."""
    from dmlib.io import _unpickle, torch_zip

    try:
        _unpickle.load(proto + body, torch_zip.TABLE, what="data.pkl", path="x.pt",
                       torch_only=torch_zip.TORCH_ONLY)  # fmt: skip
    except (FormatError, _unpickle.NeedsTorch):
        pass


_TOKENS = [
    b"]", b"}", b")", b"(", b"K\x01", b"K\x00", b"N", b"\x88", b"\x89", b"t", b"l", b"a", b"e",
    b"s", b"u", b"b", b"R", b"\x81", b"\x85", b"\x86", b"\x87", b"0", b"2", b"1", b"q\x00",
    b"h\x00", b"q\x01", b"h\x01", b"\x94", b"\x8f", b"\x90", b"\x91", b"C\x04abcd", b"Q",
    _str("u4"), _str("latin1"), _str("storage"), _str("0"), b"J\xff\xff\xff\x7f",
    _glob("torch._utils", "_rebuild_tensor_v2"), _glob("torch._utils", "_rebuild_parameter"),
    _glob("collections", "OrderedDict"), _glob("torch", "Size"), _glob("numpy", "dtype"),
    _glob("numpy.core.multiarray", "_reconstruct"), _glob("numpy", "ndarray"),
    _glob("torch", "FloatStorage"), _glob("_codecs", "encode"), _glob("torch", "Tensor"),
    _glob("torch._tensor", "_rebuild_from_type_v2"), _glob("builtins", "set"),
    _glob("torch", "device"), _glob("torch", "bfloat16"), _sglob("torch", "float32"),
]  # fmt: skip


@settings(max_examples=600, deadline=None, derandomize=True, database=None)
@given(tokens=st.lists(st.sampled_from(_TOKENS), max_size=40))
def test_opcode_sequences_of_the_table_are_read_or_refused(tokens: list[bytes]) -> None:
    """Sequences of the very opcodes and globals the readers allow, in any order."""
    from dmlib.io import _unpickle, torch_zip

    for table in (torch_zip.TABLE, __import__("dmlib.io.dcp", fromlist=["_TABLE"])._TABLE):
        try:
            _unpickle.load(b"\x80\x02" + b"".join(tokens) + b".", table, what="p", path="x",
                           torch_only=torch_zip.TORCH_ONLY)  # fmt: skip
        except (FormatError, _unpickle.NeedsTorch):
            pass


@pytest.mark.parametrize("reader", ["torch-zip", "torch-legacy"])
def test_what_is_handed_to_torch_is_vetted_by_the_same_table(tmp_path: Path, reader: str) -> None:
    """A construct left to torch.load (a quantized tensor), then os.system: dmlib refuses
    the file itself, naming the global, before torch sees it."""
    sentinel = tmp_path / "sentinel"
    payload = _p2(
        b"(" + _glob("torch._utils", "_rebuild_qtensor")
        + _call(_glob("os", "system"), _str(f"touch {sentinel}")) + b"l"
    )  # fmt: skip
    path = READERS[reader](tmp_path, payload)
    with pytest.raises(UnsafePickleError, match=r"names os\.system, which is not in its table"):
        _read_all(path)
    assert not sentinel.exists()
