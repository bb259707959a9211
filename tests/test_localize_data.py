"""The committed captures in data/packed (no torch needed).

Element-level facts are re-derived here with numpy from the dumped rows, independently of
the hashes compare_captures uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import dmlib

DATA = Path(__file__).resolve().parent.parent / "data" / "packed"


@pytest.fixture(scope="module")
def index():
    if not (DATA / "index.json").is_file():
        pytest.skip(f"{DATA} not present")
    return json.loads((DATA / "index.json").read_text())


def cap(index, key):
    return DATA / index["captures"][key]


def test_dumped_rows_agree_with_the_claims(index):
    r = index["request"]
    alone, padded, packed = (
        dmlib.open_capture(cap(index, k)) for k in ("alone", "padded", "packed")
    )
    for other in (padded, packed):
        e_a, e_o = alone.tensor("embeddings", r), other.tensor("embeddings", r)
        assert e_a.view(np.uint32).tobytes() == e_o.view(np.uint32).tobytes()
        s_a, s_o = (
            alone.tensor("encoder.layer.0.attention.self", r),
            other.tensor("encoder.layer.0.attention.self", r),
        )
        assert s_a.shape == s_o.shape == (alone.requests[r], 384)
        assert (s_a != s_o).any(axis=1).all()  # every row of the probe differs
        assert 0 < np.abs(s_a.astype(np.float64) - s_o).max() < 1e-5  # rounding-sized


def test_localised_to_layer0_attention_with_valid_controls(index):
    r = index["request"]
    for other, rep in (("padded", None), ("packed", "packed_repeat")):
        repeat = (cap(index, "alone_repeat"),) + ((cap(index, rep),) if rep else ())
        df = dmlib.compare_captures(
            cap(index, "alone"),
            cap(index, other),
            request=r,
            repeat=repeat,
            negative=cap(index, "different"),
        )
        at = df.attrs
        assert (
            at["valid"] is True
            and at["repeat_control"]["held"]
            and at["negative_control"]["passed"]
        )
        assert at["first_divergent_boundary"] == "encoder.layer.0.attention.self" == at["culprit"]
        t = df.set_index("boundary")
        for clean in ("embeddings", "encoder.layer.0.attention.self:input0", "encoder.layer.0.attention.self.query",
                      "encoder.layer.0.attention.self.key", "encoder.layer.0.attention.self.value"):  # fmt: skip
            assert t.loc[clean, "role"] == "clean", clean
        n_blocks = -(-dmlib.open_capture(cap(index, "alone")).requests[r] // index["block_rows"])
        assert t.loc["encoder.layer.0.attention.self", "diff_blocks"] == list(range(n_blocks))
        assert t.loc["encoder.layer.5", "role"] == "carrier"


def test_unpadded_packing_is_identical(index):
    df = dmlib.compare_captures(
        cap(index, "alone"), cap(index, "packed_unpadded"), request=index["request"]
    )
    assert df.attrs["first_divergent_boundary"] is None
