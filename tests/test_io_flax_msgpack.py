"""flax msgpack checkpoints (``flax.serialization.to_bytes``) and 0-d arrays in memory.

Oracles: the real files of ``../shared/fixtures/jax/msgpack`` (flax 0.12.8) against their
reference ``.npz``; files built here with the msgpack package in flax's encoding (ext 1:
``(shape, dtype name, bytes)``), whose contents are known by construction.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import dmlib
from dmlib.cli import main
from dmlib.errors import DmlibError

msgpack = pytest.importorskip("msgpack")

# ../shared/fixtures beside the checkout, as tests/conftest.py locates it
JAX = (Path(__file__).resolve().parent.parent / ".." / "shared" / "fixtures" / "jax").resolve()


@pytest.fixture
def jax_fixtures():
    if not JAX.is_dir():
        pytest.skip(
            f"real JAX fixtures not found at {JAX} (../shared/fixtures beside the checkout)"
        )
    return JAX


def _ext(a: np.ndarray, code: int = 1):
    return msgpack.ExtType(code, msgpack.packb((a.shape, a.dtype.name, a.tobytes())))


@pytest.mark.parametrize("run", ["A", "B", "D"])
def test_fixture_equals_reference(jax_fixtures, run):
    z = np.load(jax_fixtures / "reference" / f"{run}_step_10.npz")
    with dmlib.open_tensors(jax_fixtures / "msgpack" / f"{run}_step_10.msgpack") as ts:
        assert ts.format == "flax-msgpack"
        assert sorted(ts) == sorted(z.files)
        for n in z.files:
            t = ts[n]
            assert (t.shape, t.dtype) == (z[n].shape, z[n].dtype), n
            assert t.load().tobytes() == z[n].tobytes(), n
        assert ts["optimizer.step"].shape == () and ts.scalars["step"] == 10


def test_compare_fixtures(jax_fixtures, capsys):
    m = jax_fixtures / "msgpack"
    assert main(["compare", str(m / "A_step_10.msgpack"), str(m / "B_step_10.msgpack")]) == 0
    assert main(["compare", str(m / "A_step_10.msgpack"), str(m / "D_step_10.msgpack")]) == 1
    assert "DIFFERENT" in capsys.readouterr().out


def test_built_file_every_leaf_kind(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16)
    f8 = rng.standard_normal(5).astype(ml_dtypes.float8_e4m3fn)
    big = np.arange(10, dtype="<i2")
    state = {
        "params": {"dense": {"kernel": _ext(w), "bias": _ext(np.zeros(4, "<f4"))}},
        "f8": _ext(f8),
        "count": _ext(np.array(3, "<i4"), code=3),  # a numpy scalar: ext 3
        "lr": 0.5,
        "name": "run-1",
        "layers": [_ext(np.ones(2, "<f8")), _ext(np.full(2, 2.0, "<f8"))],
        # flax's encoding of an array above its chunk limit: flattened pieces
        "huge": {
            "__msgpack_chunked_array__": True,
            "shape": {"0": 2, "1": 5},
            "chunks": {"0": _ext(big[:6]), "1": _ext(big[6:])},
        },
    }
    path = tmp_path / "state.msgpack"
    path.write_bytes(msgpack.packb(state))
    with dmlib.open_tensors(path) as ts:
        assert ts["params.dense.kernel"].load().tobytes() == w.tobytes()
        assert ts["params.dense.kernel"].dtype == np.dtype(ml_dtypes.bfloat16)
        assert ts["f8"].load().tobytes() == f8.tobytes()
        assert ts["count"].shape == () and ts.scalars["step"] == 3
        assert ts["layers.1"].load().tolist() == [2.0, 2.0]
        assert ts["huge"].shape == (2, 5) and ts["huge"].load().tobytes() == big.tobytes()
        assert ts.scalars["lr"] == 0.5 and ts.scalars["name"] == "run-1"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (msgpack.packb({"w": msgpack.ExtType(99, b"x")}), "extension type 99"),
        (
            msgpack.packb({"w": msgpack.ExtType(1, msgpack.packb(((4,), "float32", b"abc")))}),
            "3 bytes",
        ),
        (
            msgpack.packb({"w": msgpack.ExtType(1, msgpack.packb(((2,), "os.system", b"")))}),
            "dtype",
        ),
        (msgpack.packb({"w": msgpack.ExtType(1, msgpack.packb(((-1,), "float32", b"")))}), "shape"),
        (
            msgpack.packb({"w": msgpack.ExtType(1, msgpack.packb(((1,), "object", b"12345678")))}),
            "not a numeric",
        ),
        (msgpack.packb([1, 2]), "not a map"),
        (msgpack.packb({"w": 1})[:-1] + b"\xc1", "not a valid msgpack"),
    ],
)
def test_bad_files_are_one_line(tmp_path, capsys, payload, message):
    path = tmp_path / "bad.msgpack"
    path.write_bytes(payload)
    with pytest.raises(DmlibError, match=message):
        dmlib.open_tensors(path)
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(path) in err and "\n" not in err


def test_truncated_fixture(jax_fixtures, tmp_path, capsys):
    raw = (jax_fixtures / "msgpack" / "A_step_10.msgpack").read_bytes()
    path = tmp_path / "cut.msgpack"
    path.write_bytes(raw[: len(raw) // 2])
    assert main(["inspect", str(path)]) == 2
    assert str(path) in capsys.readouterr().err


def test_detected_without_suffix(tmp_path):
    path = tmp_path / "ckpt_10"
    path.write_bytes(msgpack.packb({"w": _ext(np.ones(3, "<f4"))}))
    assert dmlib.detect_format(path) == "flax-msgpack"


def test_array_tensor_set_keeps_0d_arrays_0d():
    ts = dmlib.ArrayTensorSet(
        {"count": np.int32(7), "step": np.array(3, np.uint32), "w": np.ones(2)}
    )
    assert ts["count"].shape == () and ts["step"].shape == () and ts["w"].shape == (2,)
    assert ts["count"].load().shape == () and int(ts["count"].load()) == 7
    assert ts["count"].numel == 1 and ts["count"].nbytes == 4
    # non-contiguous input is still copied to C order
    a = np.arange(12.0).reshape(3, 4)[:, ::2]
    t = dmlib.ArrayTensorSet({"a": a})["a"]
    assert t.shape == (3, 2) and t.load().tolist() == a.tolist()


def test_mapping_api_scalar_stays_scalar():
    """A ``{name: array}`` mapping given to the API: a 0-d array compares as shape ()."""
    a = {"count": np.array(5, np.int32), "w": np.ones(3, np.float32)}
    b = {"count": np.array(5, np.int32), "w": np.ones(3, np.float32)}
    df = dmlib.compare(a, b)
    assert list(df.loc[df["name"] == "count", "shape"].iloc[0]) == []
    assert list(df.loc[df["name"] == "w", "shape"].iloc[0]) == [3]


def _nested_maps(levels: int) -> dict:
    """``levels`` maps one inside the next under the key a, the innermost holding w, a
    float32 array (a leaf, not a level)."""
    node: dict = {"w": _ext(np.array([1.0, 2.0], "<f4"))}
    for _ in range(levels - 1):
        node = {"a": node}
    return node


def test_nesting_is_bounded_by_the_one_nesting_limit(tmp_path, monkeypatch):
    """64 maps deep is read (its tensor named by 63 'a's and 'w'), 65 refused naming the
    file: the limit is _limits.MAX_NESTING, the one every reader's nesting has."""
    from dmlib import _limits

    assert _limits.MAX_NESTING == 64
    ok = tmp_path / "deep64.msgpack"
    ok.write_bytes(msgpack.packb(_nested_maps(64)))
    with dmlib.open_tensors(ok) as ts:
        assert list(ts) == [".".join(["a"] * 63 + ["w"])]
        assert ts[".".join(["a"] * 63 + ["w"])].load().tolist() == [1.0, 2.0]
    bad = tmp_path / "deep65.msgpack"
    bad.write_bytes(msgpack.packb(_nested_maps(65)))
    with pytest.raises(DmlibError, match="nested deeper than 64") as info:
        dmlib.open_tensors(bad)
    assert str(info.value).startswith(str(bad))
    monkeypatch.setattr(_limits, "MAX_NESTING", 63)  # the reader reads the shared constant
    with pytest.raises(DmlibError, match="nested deeper than 63"):
        dmlib.open_tensors(ok)


def test_a_file_over_what_one_piece_may_take_is_refused_naming_it(tmp_path, monkeypatch):
    """Decoded whole: a file larger than _limits.max_decompressed() is refused before it
    is read, naming the file and the variable that lifts the limit; one at it is read."""
    path = tmp_path / "state.msgpack"
    path.write_bytes(msgpack.packb({"w": _ext(np.arange(300, dtype="<f4"))}))
    size = path.stat().st_size
    monkeypatch.setenv("DMLIB_MAX_DECOMPRESSED", str(size))
    with dmlib.open_tensors(path) as ts:
        assert ts["w"].load().tolist() == list(range(300))
    monkeypatch.setenv("DMLIB_MAX_DECOMPRESSED", str(size - 1))
    with pytest.raises(DmlibError, match="decoded whole in memory.*DMLIB_MAX_DECOMPRESSED") as e:
        dmlib.open_tensors(path)
    assert str(e.value).startswith(f"{path}: is {size:,} bytes, more than the {size - 1:,} bytes")
