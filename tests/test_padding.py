"""Padding across runs: planted dirty slots at known offsets must be found exactly."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import dmlib
from dmlib.io.burnpack import encode_burnpack, write_burnpack, write_records
from dmlib.padding import padding_summary

NAN_BITS = 0x7FC00000
TENSORS = {
    "a": np.arange(10, dtype=np.float32),  # 40 bytes: a 216-byte gap follows
    "b": np.ones((3, 5), dtype=np.float32),  # 60 bytes: a 196-byte gap follows
    "c": np.full(7, -2.0, dtype=np.float32),
}


def _f32(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def _filler(plants: dict[int, dict[int, int]], seen: list[int]):
    """pad_fill planting u32 words at slot indexes of the k-th gap (k in call order)."""

    def fill(offset: int, nbytes: int) -> bytes:
        k = len(seen)
        seen.append(offset)
        buf = bytearray(nbytes)
        for slot, word in plants.get(k, {}).items():
            buf[4 * slot : 4 * slot + 4] = struct.pack("<I", word)
        return bytes(buf)

    return fill


@pytest.fixture
def runs(tmp_path):
    plants = {
        "A": {0: {0: NAN_BITS, 3: _f32(1e31)}},
        "B": {0: {0: NAN_BITS, 5: _f32(2.5)}, 1: {10: _f32(-1e35)}},
    }
    paths, gap_starts = {}, {}
    for label, plant in plants.items():
        seen: list[int] = []
        paths[label] = tmp_path / f"{label}.bpk"
        write_burnpack(paths[label], TENSORS, pad_fill=_filler(plant, seen))
        gap_starts[label] = seen
    assert gap_starts["A"] == gap_starts["B"]  # same layout
    return paths, gap_starts["A"]


def test_planted_slots_found_exactly(runs):
    paths, (g0, g1) = runs
    df = dmlib.padding_across_runs(paths)
    cols = ["run", "offset", "bits", "dirty", "differs"]
    got = {(r, o): (b, d, x) for r, o, b, d, x in df[cols].itertuples(index=False)}
    expected = {
        # slot 0 of gap 0: the same NaN in both runs -> dirty, not differing
        ("A", g0): (NAN_BITS, True, False),
        ("B", g0): (NAN_BITS, True, False),
        ("A", g0 + 12): (_f32(1e31), True, True),
        ("B", g0 + 12): (0, False, True),
        ("A", g0 + 20): (0, False, True),
        ("B", g0 + 20): (_f32(2.5), True, True),
        ("A", g1 + 40): (0, False, True),
        ("B", g1 + 40): (_f32(-1e35), True, True),
    }
    assert got == expected
    assert set(df["kind"]) == {"between-tensors"}
    assert df["inside_tensor"].isna().all()
    assert df.attrs["inside_tensor"] == 0
    assert df.attrs["differs"] is True and df.attrs["same_layout"] is True
    b = df[df["run"] == "B"].set_index("offset")
    assert b.loc[g0 + 20, "value"] == 2.5
    assert b.loc[g1 + 40, "value"] == np.float32(-1e35)
    assert bool(b.loc[g1 + 40, "huge"]) and bool(b.loc[g0, "nan"])
    summary = padding_summary(df).set_index("run")
    counts = ["dirty_slots", "nan", "huge", "differing_slots", "inside_tensor"]
    assert summary.loc["A", counts].tolist() == [2, 1, 1, 3, 0]
    assert summary.loc["B", counts].tolist() == [3, 1, 1, 3, 0]
    # padding = the zero bytes after the metadata (header read by hand) + the two gaps
    head = paths["A"].read_bytes()[:10]
    meta_end = 10 + struct.unpack("<I", head[6:10])[0]
    after_meta = -(-meta_end // 256) * 256 - meta_end
    assert summary.loc["A", "padding_bytes"] == after_meta + 216 + 196
    planted_a = struct.pack("<II", NAN_BITS, _f32(1e31))
    assert summary.loc["A", "nonzero_bytes"] == sum(x != 0 for x in planted_a)


def test_clean_runs_report_nothing(tmp_path):
    paths = []
    for i in range(3):
        paths.append(tmp_path / f"r{i}.bpk")
        write_burnpack(paths[-1], TENSORS)
    df = dmlib.padding_across_runs(paths)
    assert len(df) == 0 and df.attrs["differs"] is False
    s = padding_summary(df)
    assert list(s["dirty_slots"]) == [0, 0, 0] and len(s) == 3


def test_between_records_gap(tmp_path):
    recs = [
        encode_burnpack({"w": np.ones(3, np.float32)}),
        encode_burnpack({"m": np.zeros(5, np.float32)}),
    ]
    gap_at: list[int] = []

    def gap_fill(offset: int, nbytes: int) -> bytes:
        gap_at.append(offset)
        return struct.pack("<I", NAN_BITS) + bytes(nbytes - 4)

    p1, p2 = tmp_path / "one.bpk", tmp_path / "two.bpk"
    write_records(p1, recs, pad_fill=gap_fill)
    write_records(p2, recs)
    df = dmlib.padding_across_runs({"dirty": p1, "clean": p2})
    d = df[df["run"] == "dirty"]
    assert len(d) == 1
    assert d.iloc[0]["offset"] == gap_at[0] and d.iloc[0]["kind"] == "between-records"
    assert bool(d.iloc[0]["nan"]) and d.iloc[0]["inside_tensor"] is None


def test_slot_inside_a_tensor_of_another_layout_is_named(tmp_path, runs):
    paths, (g0, _) = runs
    other = dict(TENSORS)
    other["a"] = np.zeros(64, dtype=np.float32)  # 256 bytes: covers run A's first gap
    c = tmp_path / "C.bpk"
    write_burnpack(c, other)
    df = dmlib.padding_across_runs({"A": paths["A"], "C": c})
    a = df[df["run"] == "A"].set_index("offset")
    # A's dirty slots lie where C holds tensor "a": named, and not compared as padding
    assert a.loc[g0, "inside_tensor"] == "a" and a.loc[g0 + 12, "inside_tensor"] == "a"
    assert not a["differs"].any()
    assert df.attrs["inside_tensor"] == 2
    assert df.attrs["same_layout"] is False


def test_in_memory_sets_are_refused():
    ts = dmlib.ArrayTensorSet({"x": np.ones(3)})
    with pytest.raises(dmlib.DmlibError):
        dmlib.padding_across_runs([ts])


@pytest.mark.parametrize(
    ("start", "end", "grid"),
    [(0, 4, (0, 4)), (1, 9, (4, 8)), (5, 7, (8, 4)), (8, 8, (8, 8)), (3, 16, (4, 16))],
)
def test_slot_grid_by_hand(start, end, grid):
    from dmlib.padding import slot_grid

    assert slot_grid(start, end) == grid


def test_huge_is_at_least_1e30_and_never_nan():
    from dmlib.padding import is_huge

    v = np.array([1e30, -1e30, 9.99e29, np.inf, -np.inf, np.nan, 0.0])
    assert is_huge(v).tolist() == [True, True, False, True, True, False, False]
