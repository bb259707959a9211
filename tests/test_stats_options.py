"""CompareOptions: one frozen object holding every comparison setting, validated once."""

import dataclasses

import numpy as np
import pytest

import dmlib
from dmlib.errors import DmlibError
from dmlib.stats.options import CompareOptions


def test_defaults():
    o = CompareOptions()
    assert o.include is None and o.exclude is None and o.rename is None and o.mapping is None
    assert o.file_hashes is False and o.cross_dtype is False and o.progress is None
    assert o.chunk_bytes == 4 * 1024 * 1024
    assert o.engine == "local"
    assert o.hash is None and o.hash_name == "blake3-64MiB"  # None: the default scheme


def test_hash_names():
    assert CompareOptions(hash="sha256").hash_name == "sha256"
    assert CompareOptions(hash="none").hash_name is None
    assert CompareOptions(hash="NONE").hash_name is None


def test_frozen():
    o = CompareOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.chunk_bytes = 1  # type: ignore[misc]
    o2 = o.with_(chunk_bytes=1024)
    assert o2.chunk_bytes == 1024 and o.chunk_bytes == 4 << 20


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"chunk_bytes": 0}, "chunk_bytes must be a positive number of bytes, got 0"),
        ({"chunk_bytes": -5}, "chunk_bytes must be a positive number of bytes, got -5"),
        ({"chunk_bytes": 1.5}, "chunk_bytes must be a positive number of bytes, got 1.5"),
        ({"chunk_bytes": True}, "chunk_bytes must be a positive number of bytes, got True"),
        ({"engine": "spark"}, "unknown engine 'spark': use one of local, dask"),
        ({"hash": "md5"}, "unknown hash 'md5'"),
        ({"hash": "none", "file_hashes": True}, "need a hash scheme: blake3 or sha256, not none"),
        ({"engine": "dask", "file_hashes": True}, "file_hashes=True reads whole files here"),
        ({"mapping": {}, "rename": "a:x.="}, "mapping= does not combine with rename="),
        ({"mapping": {}, "engine": "dask"}, "mapping= does not combine with engine="),
        ({"mapping": {}, "file_hashes": True}, "mapping= does not combine with file_hashes="),
    ],
)
def test_each_refusal(kw, message):
    pattern = message.replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(DmlibError, match=pattern):
        CompareOptions(**kw)
    # the public function refuses the same, before it opens anything
    with pytest.raises(DmlibError, match=pattern):
        dmlib.compare("/nonexistent/a.npy", "/nonexistent/b.npy", **kw)


def test_validation_with_():
    with pytest.raises(DmlibError, match="chunk_bytes"):
        CompareOptions().with_(chunk_bytes=0)


def test_numpy_integer_chunk_accepted():
    a = dmlib.ArrayTensorSet({"w": np.arange(6, dtype=np.float32)})
    b = dmlib.ArrayTensorSet({"w": np.arange(6, dtype=np.float32) + 1})
    df = dmlib.compare(a, b, chunk_bytes=np.int64(8), progress=False)
    assert int(df["n_diff"].iloc[0]) == 6


def test_matrix_refuses_settings_it_does_not_apply():
    from dmlib.stats.matrix import matrix_records

    runs = {k: dmlib.ArrayTensorSet({"w": np.zeros(2, np.float32)}) for k in ("x", "y")}
    with pytest.raises(DmlibError, match="matrix does not take cross_dtype="):
        matrix_records(runs, cross_dtype=True)
    with pytest.raises(DmlibError, match="chunk_bytes"):
        matrix_records(runs, chunk_bytes=0)
    rows, attrs = matrix_records(runs, hash="none")
    assert attrs["verdict"]["always_identical"] is True
