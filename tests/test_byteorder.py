"""Big-endian data: values are compared as values, hashes are over the stored bytes.

Oracles: numpy on native-order copies (values, float64 differences and norms), and a
Python-int reading of the sign-magnitude bits for ULP distances.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
from blake3 import blake3

import dmlib
from dmlib.cli import main
from dmlib.kernels.ulp import ulp_distance

WIDTH = {"f2": (np.uint16, 16), "f4": (np.uint32, 32), "f8": (np.uint64, 64)}


def oracle_ulp(a: np.ndarray, b: np.ndarray, nbits: int) -> list[int]:
    """|rank difference| from the sign-magnitude bits of native-order arrays, in Python ints."""
    ubits = WIDTH[a.dtype.str[1:]][0]

    def line(x: np.ndarray) -> list[int]:
        out = []
        for v in x.view(ubits).tolist():
            mag = v & ((1 << (nbits - 1)) - 1)
            out.append(-mag if v >> (nbits - 1) else mag)
        return out

    return [abs(p - q) for p, q in zip(line(a), line(b))]


@pytest.mark.parametrize("code", ["f2", "f4", "f8"])
def test_ulp_distance_on_big_endian_matches_native(code):
    ubits, nbits = WIDTH[code]
    rng = np.random.default_rng(nbits)
    xa = rng.integers(0, np.iinfo(ubits).max, 4000, dtype=ubits, endpoint=True)
    xb = xa.copy()
    xb[::2] += rng.integers(0, 50, xb[::2].size).astype(ubits)  # near pairs
    xb[1::4] = rng.integers(0, np.iinfo(ubits).max, xb[1::4].size, dtype=ubits, endpoint=True)
    a, b = xa.view("<" + code), xb.view("<" + code)
    keep = ~(np.isnan(a) | np.isnan(b))
    a, b = a[keep], b[keep]
    want = oracle_ulp(a, b, nbits)
    big_a, big_b = a.astype(">" + code), b.astype(">" + code)
    assert big_a.tobytes() != a.tobytes()  # really stored the other way round
    assert [int(x) for x in ulp_distance(big_a, big_b)] == want
    # one side in each order: still the values that count
    assert [int(x) for x in ulp_distance(big_a, b.astype("<" + code))] == want


def _planted(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n).astype(np.float32)
    b = a.copy()
    # differences only past element n/4: where a byte-index reading went out of bounds
    idx = np.array([n // 4 + 3, n // 2, n - 1])
    b[idx] = np.nextafter(b[idx], np.float32(np.inf))
    b[idx[1]] += np.float32(0.5)
    return a, b, idx


def test_compare_two_big_endian_npy(tmp_path):
    a, b, idx = _planted(4000, 1)
    pa, pb = tmp_path / "a.npy", tmp_path / "b.npy"
    np.save(pa, a.astype(">f4"))
    np.save(pb, b.astype(">f4"))
    df = dmlib.compare(pa, pb)
    (row,) = df.to_dict("records")
    assert row["dtype"] == "float32"
    assert row["n_diff"] == 3
    assert row["first_diff"] == (int(idx[0]),)
    d = b.astype(np.float64) - a.astype(np.float64)
    assert row["max_abs"] == np.max(np.abs(d))
    assert int(row["max_ulp"]) == max(oracle_ulp(a, b, 32))
    assert row["rel_fro"] == pytest.approx(
        np.linalg.norm(d) / np.linalg.norm(a.astype(np.float64)), rel=1e-12
    )
    # hashes are over the stored (big-endian) bytes
    assert row["data_hash_a"] == "blake3-64MiB:" + blake3(a.astype(">f4").tobytes()).hexdigest()
    assert row["data_hash_b"] == "blake3-64MiB:" + blake3(b.astype(">f4").tobytes()).hexdigest()


def test_big_endian_against_little_endian_same_values(tmp_path):
    a, _, _ = _planted(1000, 2)
    np.save(tmp_path / "big.npy", a.astype(">f4"))
    np.save(tmp_path / "little.npy", a.astype("<f4"))
    df = dmlib.compare(tmp_path / "big.npy", tmp_path / "little.npy", hash="sha256")
    (row,) = df.to_dict("records")
    assert row["n_diff"] == 0 and int(row["max_ulp"]) == 0
    # same values, other bytes: never "identical", and each hash is of its own file's bytes
    assert row["data_hash_a"] == "sha256:" + hashlib.sha256(a.astype(">f4").tobytes()).hexdigest()
    assert row["data_hash_b"] == "sha256:" + hashlib.sha256(a.astype("<f4").tobytes()).hexdigest()
    assert dmlib.summarize(df)["identical"] is False


def test_big_endian_ints_and_values(tmp_path):
    a = np.arange(-500, 500, dtype=">i4")
    b = a.copy()
    b[900] = 7
    np.savez(tmp_path / "a.npz", w=a, f=np.linspace(-1, 1, 64).astype(">f8"))
    np.savez(tmp_path / "b.npz", w=b, f=np.linspace(-1, 1, 64).astype(">f8"))
    with dmlib.open_tensors(tmp_path / "a.npz") as ts:
        np.testing.assert_array_equal(ts["w"].load(), a)  # values, whatever the byte order
    df = dmlib.compare(tmp_path / "a.npz", tmp_path / "b.npz").set_index("name")
    assert df.loc["w", "n_diff"] == 1
    assert df.loc["w", "max_abs"] == abs(400 - 7)
    assert df.loc["w", "first_diff"] == (900,)
    assert df.loc["f", "n_diff"] == 0


def test_cli_compare_big_endian(tmp_path, capsys):
    a, b, idx = _planted(4000, 3)
    np.save(tmp_path / "a.npy", a.astype(">f4"))
    np.save(tmp_path / "b.npy", b.astype(">f4"))
    rc = main(["compare", str(tmp_path / "a.npy"), str(tmp_path / "b.npy"), "--json"])
    assert rc == 1
    doc = json.loads(capsys.readouterr().out)
    (row,) = doc["rows"]
    assert row["n_diff"] == 3 and row["first_diff"] == [int(idx[0])]
    assert math.isfinite(row["rel_fro"]) and row["max_ulp"] > 0


def test_equal_values_in_two_byte_orders_without_hashes(tmp_path, capsys):
    # no hash to tell the bytes apart: the byte orders themselves must keep "identical" off
    a, _, _ = _planted(1000, 2)
    np.save(tmp_path / "big.npy", a.astype(">f4"))
    np.save(tmp_path / "little.npy", a.astype("<f4"))
    assert a.astype(">f4").tobytes() != a.astype("<f4").tobytes()  # the premise
    df = dmlib.compare(tmp_path / "big.npy", tmp_path / "little.npy", hash="none")
    (row,) = df.to_dict("records")
    assert row["n_diff"] == 0 and row["data_hash_a"] is None and row["data_hash_b"] is None
    assert df.attrs["hash"] is None and df.attrs["byte_order_diff"] == ["big"]
    s = dmlib.summarize(df)
    assert s["identical"] is False and s["byte_order_diff"] == ["big"]
    # the command line hashes nothing in text mode: same verdict, said in the summary
    rc = main(["compare", str(tmp_path / "big.npy"), str(tmp_path / "little.npy")])
    out = capsys.readouterr().out
    assert rc == 1 and out.startswith("DIFFERENT: 0 of 1 compared tensors differ")
    assert "equal values stored in another byte order (e.g. big)" in out
    # a matrix of the two: not a bit-identical pair either
    rc = main(["matrix", f"x={tmp_path / 'big.npy'}", f"y={tmp_path / 'little.npy'}"])
    out = capsys.readouterr().out
    assert rc == 1 and "bit-identical pairs: none" in out
