"""compare_captures finds the planted divergence: boundary, blocks, roles, controls."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _support.toymodel import NUDGE, F, Toy, run_capture  # noqa: E402

import dmlib  # noqa: E402
from dmlib.errors import CaptureError  # noqa: E402
from dmlib.localize.boundaries import element_stats, planted_control, repeat_control  # noqa: E402

DUMP = ["blocks.1.quirk", "blocks.1.act", "inp"]


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    root = tmp_path_factory.mktemp("caps")
    model = Toy()
    for name, kind in (
        ("alone", "alone"),
        ("alone2", "alone"),
        ("packed", "packed"),
        ("packed2", "packed"),
    ):
        run_capture(model, root / name, kind, modules="*", dump=DUMP, dump_requests=["r"])
    model.blocks[1].quirk.active = False
    run_capture(model, root / "packed_clean", "packed", modules="*", dump=DUMP, dump_requests=["r"])
    return root


def test_planted_boundary_blocks_and_roles(caps):
    df = dmlib.compare_captures(caps / "alone", caps / "packed", request="r")
    at = df.attrs
    assert at["first_divergent_boundary"] == "blocks.1.quirk"
    assert at["culprit"] == "blocks.1.quirk" and at["culprits"] == ["blocks.1.quirk"]
    t = df.set_index("boundary")
    # every boundary before the quirk's output is identical
    first = df.index[df["boundary"] == "blocks.1.quirk"][0]
    assert df.loc[: first - 1, "identical"].all()
    q = t.loc["blocks.1.quirk"]
    assert q["role"] == "culprit"
    assert q["diff_blocks"] == [0, 2] and q["new_blocks"] == [0, 2] and q["inherited_blocks"] == []
    # planted: two positions (5 and 20) x F features, each moved by NUDGE
    assert (q["n_diff"], q["n_diff_rows"]) == (2 * F, 2)
    assert 0.5 * NUDGE < q["max_abs"] < 1.5 * NUDGE
    assert q["max_ulp"] > 0 and 0 < q["rel_fro"] < 1
    assert (
        t.loc["blocks.1.quirk:input0", "role"] == "clean"
        and t.loc["blocks.1.quirk:input1", "role"] == "clean"
    )
    act = t.loc["blocks.1.act"]
    assert act["role"] == "carrier" and act["diff_blocks"] == [0, 2] and act["new_blocks"] == []
    assert (
        t.loc["blocks.1", "role"] == "encloses-culprit"
    )  # clean inputs, but a child is the culprit
    assert t.loc["blocks.2.fc:input0", "role"] == "carrier"
    # cumsum spreads position 5 to 6..23: block 1 is new at the mix
    mix = t.loc["blocks.2.mix"]
    assert mix["role"] == "carrier" and mix["diff_blocks"] == [0, 1, 2] and mix["new_blocks"] == [1]
    assert mix["inherited_blocks"] == [0, 2]
    # not dumped -> hash-only, statistics null and said so
    assert pd_isna(mix["n_diff"]) and "blocks.2.mix" in at["stats_missing"]
    assert at["block_index"] == [["r", 0, 0, 8], ["r", 1, 8, 16], ["r", 2, 16, 24]]
    assert at["repeat_control"] is None and at["valid"] is None


def pd_isna(v) -> bool:
    import pandas as pd

    return v is None or v is pd.NA or (isinstance(v, float) and np.isnan(v))


def test_same_computation_in_two_layouts_is_identical(caps):
    df = dmlib.compare_captures(caps / "alone", caps / "packed_clean", request="r")
    assert df.attrs["first_divergent_boundary"] is None and df.attrs["culprit"] is None
    assert set(df["role"]) == {"clean"} and df["identical"].all()
    assert (df["diff_blocks"].map(len) == 0).all()


def test_repeat_control_validates(caps):
    df = dmlib.compare_captures(
        caps / "alone", caps / "packed", request="r", repeat=(caps / "alone2", caps / "packed2")
    )
    rc = df.attrs["repeat_control"]
    assert rc["held"] and len(rc["checks"]) == 2 and df.attrs["valid"] is True
    bad = dmlib.compare_captures(
        caps / "alone", caps / "packed", request="r", repeat=caps / "packed"
    )
    assert bad.attrs["repeat_control"]["held"] is False and bad.attrs["valid"] is False
    # a "repeat" in another layout differs at every boundary (whole tensors differ in shape)
    assert bad.attrs["repeat_control"]["checks"][0]["n_differing"] == len(bad)


def test_repeat_control_catches_nondeterminism(tmp_path):
    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Identity()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.lin(x + 1e-3 * self.calls)  # differs from call to call

    m = Noisy()
    x = torch.ones(1, 4, 2)
    for name in ("a", "b"):
        with dmlib.capture(m, tmp_path / name, row_map=[("q", i) for i in range(4)], modules="*"):
            m(x)
    rc = repeat_control(tmp_path / "a", tmp_path / "b")
    assert rc["held"] is False and rc["differing"] == ["lin:input0", "lin"]


def test_negative_controls(caps, tmp_path):
    df = dmlib.compare_captures(
        caps / "alone", caps / "packed", request="r", negative=caps / "packed"
    )
    nc = df.attrs["negative_control"]
    planted = nc["checks"][0]
    assert planted["kind"] == "planted" and planted["passed"] and planted["hashes_match_dump"]
    assert planted["blocks_flagged"] == [planted["block"]] and planted["n_diff"] == 1
    assert nc["checks"][1] == {
        "kind": "different-input",
        "capture": str(caps / "packed"),
        "passed": True,
    }
    # an "other input" that is the same input: the sensitivity check must fail
    same = dmlib.compare_captures(
        caps / "alone",
        caps / "packed",
        request="r",
        negative=caps / "alone2",
        repeat=caps / "alone2",
    )
    assert same.attrs["negative_control"]["passed"] is False and same.attrs["valid"] is False


def test_planted_control_fails_on_tampered_dump(caps, tmp_path):
    import shutil

    shutil.copytree(caps / "alone", tmp_path / "t")
    cap = dmlib.open_capture(tmp_path / "t")
    b = cap.boundary("inp")
    rows = np.array(cap.tensor(b, "r"))
    rows[3, 1] += 1.0  # the dumped bytes no longer match the recorded hashes
    dmlib.write_safetensors(tmp_path / "t" / b.dump["file"], {"request:r": rows})
    res = planted_control(tmp_path / "t", request="r")
    assert res["boundary"] == "inp" and res["hashes_match_dump"] is False and res["passed"] is False


def test_bad_inputs(caps, tmp_path):
    with pytest.raises(CaptureError, match="request 'zz'"):
        dmlib.compare_captures(caps / "alone", caps / "packed", request="zz")
    run_capture(Toy(), tmp_path / "b4", "alone", block_rows=4)
    with pytest.raises(CaptureError, match="block_rows"):
        dmlib.compare_captures(caps / "alone", tmp_path / "b4")
    with pytest.raises(CaptureError, match="manifest"):
        dmlib.compare_captures(caps / "alone", tmp_path)


def test_request_none_compares_common_requests(caps):
    df = dmlib.compare_captures(caps / "packed", caps / "packed_clean")
    assert df.attrs["requests"] == ["a", "b", "r"]
    # quirk hits positions 5 and 20 of every request that has them: a(30) r(24) b(11, only 5)
    q = df.set_index("boundary").loc["blocks.1.quirk"]
    index = df.attrs["block_index"]
    assert sorted((index[i][0], index[i][1]) for i in q["diff_blocks"]) == [
        ("a", 0),
        ("a", 2),
        ("b", 0),
        ("r", 0),
        ("r", 2),
    ]
    assert json.dumps(df.attrs["block_index"])  # JSON-able


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        # hand-computed: one element differs by 0.5 -> rel_fro = 0.5 / ||a|| = 0.5 / 3
        (np.array([[1.0, 2.0], [2.0, 0.0]], np.float32), np.array([[1.0, 2.0], [2.5, 0.0]], np.float32),
         {"n_diff": 1, "n_diff_rows": 1, "max_abs": 0.5, "rel_fro": 0.5 / 3.0, "max_ulp": 2**21}),
        # 1.0 and its float32 successor: one ULP
        (np.array([[1.0]], np.float32), np.array([[np.nextafter(np.float32(1), np.float32(2))]], np.float32),
         {"n_diff": 1, "n_diff_rows": 1, "max_abs": 2.0**-23, "rel_fro": 2.0**-23, "max_ulp": 1}),
        # -0.0 vs +0.0: different bits, zero distance
        (np.array([[0.0]], np.float32), np.array([[-0.0]], np.float32),
         {"n_diff": 1, "n_diff_rows": 1, "max_abs": 0.0, "rel_fro": 0.0, "max_ulp": 0}),
        (np.array([[1, 2], [3, 4]], np.int64), np.array([[1, 2], [3, 9]], np.int64),
         {"n_diff": 1, "n_diff_rows": 1, "max_abs": 5.0, "max_ulp": None}),
    ],
)  # fmt: skip
def test_element_stats_hand_cases(a, b, expected):
    got = element_stats(a, b)
    for k, v in expected.items():
        assert got[k] == (pytest.approx(v) if isinstance(v, float) else v), k
