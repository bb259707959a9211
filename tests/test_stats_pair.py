"""The streaming pair loop: equal chunks decided on bytes, side a hashed inside the loop.

Oracles: the ``blake3`` package and ``hashlib`` on the stored bytes, and numpy on the raw
bytes for which elements differ. Differences are planted where a word-wise byte compare
could miss them: in the tail bytes that do not fill an 8-byte word, and in a chunk that
ends mid-word.
"""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import pytest
from blake3 import blake3

import dmlib
from dmlib.kernels.pair import same_bytes
from dmlib.tensor import ArrayTensorSet


def _b3(arr: np.ndarray) -> str:
    return "blake3-64MiB:" + blake3(arr.tobytes()).hexdigest()


def _oracle_diff(a: np.ndarray, b: np.ndarray) -> tuple[int, int | None]:
    """(elements whose stored bytes differ, flat index of the first), on the raw bytes."""
    ra = a.reshape(-1).view(np.uint8).reshape(a.size, -1)
    rb = b.reshape(-1).view(np.uint8).reshape(b.size, -1)
    d = np.flatnonzero((ra != rb).any(axis=1))
    return int(d.size), (int(d[0]) if d.size else None)


def _planted(dtype: str, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n).astype(np.float32)
    a[:4] = [np.nan, np.inf, -0.0, 1e-42]  # NaN, inf, negative zero, a float32 subnormal
    a = a.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else getattr(ml_dtypes, dtype, dtype))
    b = a.copy()
    bits = b.view(f"u{b.dtype.itemsize}")
    bits[2] ^= bits.dtype.type(1 << (8 * b.dtype.itemsize - 1))  # -0 -> +0 (or a sign flip)
    bits[n // 2] += 1
    bits[-1] ^= 1  # the very last element: in the tail after the last whole 8-byte word
    return a, b


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float8_e4m3fn", "float64"])
@pytest.mark.parametrize("chunk_bytes", [3, 100, 4096])
def test_rows_and_hashes_against_raw_bytes(dtype, chunk_bytes):
    a, b = _planted(dtype, 1003, seed=len(dtype) + chunk_bytes)  # odd size: bytes % 8 != 0
    sa, sb = ArrayTensorSet({"w": a}), ArrayTensorSet({"w": b})
    (row,) = dmlib.compare(sa, sb, chunk_bytes=chunk_bytes).to_dict("records")
    n_diff, first = _oracle_diff(a, b)
    assert n_diff == 3
    assert row["n_diff"] == n_diff and row["first_diff"] == (first,)
    assert row["data_hash_a"] == _b3(a) and row["data_hash_b"] == _b3(b)
    # a bit-identical pair: equal bytes, side a's digest, never "differs"
    (same,) = dmlib.compare(sa, ArrayTensorSet({"w": a.copy()}), chunk_bytes=chunk_bytes).to_dict(
        "records"
    )
    assert same["n_diff"] == 0 and same["data_hash_a"] == same["data_hash_b"] == _b3(a)
    # SHA-256 stays on the worker pool: the same rows, its own digests
    (sha,) = dmlib.compare(sa, sb, chunk_bytes=chunk_bytes, hash="sha256").to_dict("records")
    assert sha["data_hash_a"] == "sha256:" + hashlib.sha256(a.tobytes()).hexdigest()
    assert sha["data_hash_b"] == "sha256:" + hashlib.sha256(b.tobytes()).hexdigest()
    assert {k: v for k, v in sha.items() if not k.startswith("data_hash")} == {
        k: v for k, v in row.items() if not k.startswith("data_hash")
    }


def test_memory_mapped_big_endian_pair(tmp_path):
    # stored big-endian: compared on values, hashed over the stored (big-endian) bytes
    a, b = _planted("float32", 4099, seed=3)
    np.save(tmp_path / "a.npy", a.astype(">f4"))
    np.save(tmp_path / "b.npy", b.astype(">f4"))
    np.save(tmp_path / "a2.npy", a.astype(">f4"))
    for chunk in (7, 1 << 12):
        (row,) = dmlib.compare(tmp_path / "a.npy", tmp_path / "b.npy", chunk_bytes=chunk).to_dict(
            "records"
        )
        n_diff, first = _oracle_diff(a, b)
        assert row["n_diff"] == n_diff == 3 and row["first_diff"] == (first,)
        assert row["data_hash_a"] == _b3(a.astype(">f4"))
        assert row["data_hash_b"] == _b3(b.astype(">f4"))
        df = dmlib.compare(tmp_path / "a.npy", tmp_path / "a2.npy", chunk_bytes=chunk)
        assert dmlib.summarize(df)["identical"] is True
        assert df.loc[0, "data_hash_b"] == _b3(a.astype(">f4"))


def test_inline_hash_spans_pieces(monkeypatch):
    # a tensor longer than a piece: the loop's multi-threaded hasher follows the piece rule
    from dmlib import hashing

    monkeypatch.setattr(hashing, "PIECE", 1024)

    def by_hand(arr: np.ndarray) -> str:
        raw = arr.tobytes()
        head = b"dmlib-pieces-v1" + (1024).to_bytes(8, "little") + len(raw).to_bytes(8, "little")
        digests = b"".join(blake3(raw[i : i + 1024]).digest() for i in range(0, len(raw), 1024))
        return "blake3-64MiB:" + blake3(head + digests).hexdigest()

    a = np.arange(5000, dtype=np.float32)
    (row,) = dmlib.compare(
        ArrayTensorSet({"w": a}), ArrayTensorSet({"w": a.copy()}), chunk_bytes=1500
    ).to_dict("records")
    assert row["data_hash_a"] == row["data_hash_b"] == by_hand(a)
    # b differs only after many equal chunks and pieces: its hash goes on from a's state
    for where in (0, 2999, 4999):
        b = a.copy()
        b[where] = -1.0
        (row,) = dmlib.compare(
            ArrayTensorSet({"w": a}), ArrayTensorSet({"w": b}), chunk_bytes=1500
        ).to_dict("records")
        assert row["n_diff"] == 1 and row["first_diff"] == (where,)
        assert row["data_hash_a"] == by_hand(a) and row["data_hash_b"] == by_hand(b)


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 16, 23, (1 << 20) + 13])
def test_same_bytes_sees_every_byte(n, compiled, monkeypatch):
    import dmlib.kernels.stream as K

    if compiled and K._fused is None:
        pytest.skip("dmlib.kernels._fused is not built (no C compiler at install)")
    monkeypatch.setattr(K, "USE_COMPILED", compiled)  # memcmp, or numpy on 8-byte words
    x = np.arange(n, dtype=np.uint8)
    assert same_bytes(x, x.copy())
    # a difference at every position, in the word part and in the tail (and, for the
    # long array, around the 1 MiB blocks the numpy path compares one at a time)
    places = range(n) if n < 100 else [0, 7, 8, (1 << 20) - 1, 1 << 20, n - 9, n - 1]
    for i in places:
        y = x.copy()
        y[i] ^= 0x80
        assert not same_bytes(x, y)
    assert not same_bytes(x, np.zeros(n + 1, np.uint8))
