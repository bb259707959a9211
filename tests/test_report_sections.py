"""The matrix notebooks' sections and their once-per-report matrix (dmlib.report.sections,
dmlib.report.cache) on a three-run study written by hand.

Run ``a`` holds ``w = [1, 2, 4]``; ``b`` the same with the 2 moved up one float32 ULP;
the control ``c`` holds ``[2, 2, 4]``. Expected values are computed by hand from those
numbers: a/b differ in one element by 1 ULP, rel_fro = ulp(2) / ||a|| = 2**-22 / sqrt(21);
the control's pairs differ by 2**23 ULP at index 0 (1.0 -> 2.0 in float32).
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import dmlib
import dmlib.stats.matrix as stats_matrix
from dmlib import report
from dmlib.report import cache, sections

W_A = np.array([1.0, 2.0, 4.0], dtype="<f4")
W_B = np.array([1.0, np.nextafter(np.float32(2.0), np.float32(3.0)), 4.0], dtype="<f4")
W_C = np.array([2.0, 2.0, 4.0], dtype="<f4")
REL_AB = 2.0**-22 / math.sqrt(21.0)  # one ULP of 2.0 in float32 is 2**-22


def _write(path: Path, w: np.ndarray) -> None:
    raw = np.ascontiguousarray(w, dtype="<f4").tobytes()
    header = json.dumps(
        {"w": {"dtype": "F32", "shape": [len(w)], "data_offsets": [0, len(raw)]}}
    ).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + raw)


@pytest.fixture()
def lab(tmp_path: Path) -> Path:
    root = tmp_path / "lab"
    root.mkdir()
    for name, w in (("a", W_A), ("b", W_B), ("c", W_C)):
        _write(root / f"{name}.safetensors", w)
    (root / "study.toml").write_text(
        'title = "three runs"\ncontrol = "c"\n\n[runs]\n'
        'a = "a.safetensors"\nb = "b.safetensors"\nc = "c.safetensors"\n'
    )
    report.configure(figure_dir=tmp_path / "stage" / "figures", notebook="sections_test")
    yield root
    report.configure(figure_dir=Path("reports") / "figures", notebook="notebook")


@pytest.fixture()
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the matrices actually computed."""
    seen: list[int] = []
    real = stats_matrix.matrix_records

    def counting(*args, **kwargs):
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(stats_matrix, "matrix_records", counting)
    return seen


def _matrix(root: Path):
    study = report.load_study(root / "study.toml")
    _, files, _ = report.runs_at_last_step(study)
    return study, files, cache.study_matrix(study, files, control=study.control)


def test_cache_hit_on_second_call(lab, calls):
    study, files, first = _matrix(lab)
    assert len(calls) == 1
    _, _, second = _matrix(lab)
    assert len(calls) == 1, "the second call must read the cached matrix"
    pd.testing.assert_frame_equal(first, second)
    assert first.attrs["verdict"].to_dict() == second.attrs["verdict"].to_dict()
    assert len(list(cache.cache_dir().glob("matrix-*.json"))) == 1


def test_cached_frame_matches_matrix_and_hand_values(lab, calls):
    study, files, _ = _matrix(lab)
    _, _, got = _matrix(lab)  # read from the cache
    want = dmlib.matrix(study.sources(files), control="c")
    pd.testing.assert_frame_equal(got, want)
    ab = got[(got["a"] == "a") & (got["b"] == "b")].iloc[0]
    assert ab["n_diff"] == 1 and ab["max_ulp"] == 1
    assert ab["rel_fro"] == pytest.approx(REL_AB, rel=1e-12)
    ac = got[(got["a"] == "a") & (got["b"] == "c")].iloc[0]
    assert ac["n_diff"] == 1 and ac["max_ulp"] == 2**23
    assert ac["first_diff"] == (0,)
    v = got.attrs["verdict"]
    assert v["control"] == "c" and v["identical_pairs"] == []
    assert v["same_worst_rel_fro"] == pytest.approx(REL_AB, rel=1e-12)


def test_cache_missed_when_an_input_file_changes(lab, calls):
    _matrix(lab)
    path = lab / "b.safetensors"
    _write(path, W_A)  # b becomes identical to a
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _, _, after = _matrix(lab)
    assert len(calls) == 2
    ab = after[(after["a"] == "a") & (after["b"] == "b")].iloc[0]
    assert ab["n_diff"] == 0
    assert after.attrs["verdict"]["identical_pairs"] == ["a/b"]


def test_cache_missed_when_the_study_file_changes(lab, calls):
    _matrix(lab)
    text = (lab / "study.toml").read_text()
    (lab / "study.toml").write_text(text.replace('title = "three runs"', 'title = "3 runs"'))
    _matrix(lab)
    assert len(calls) == 2


def test_damaged_or_foreign_cache_file_is_recomputed(lab, calls):
    _, _, first = _matrix(lab)
    (path,) = cache.cache_dir().glob("matrix-*.json")
    path.write_text("{not json")
    _, _, again = _matrix(lab)
    assert len(calls) == 2
    pd.testing.assert_frame_equal(first, again)
    # entries signed with this user's own secret (what dmlib writes), then altered
    key = json.loads(path.read_text().split("\n", 1)[1])["key"]
    secret = cache._read_secret(cache.secret_path())
    data = json.loads(path.read_text().split("\n", 1)[1])
    data["key"] = "0" * 64  # a file whose key does not match is never used
    path.write_text(cache._signed(data, key, secret))
    _matrix(lab)
    assert len(calls) == 3
    data = json.loads(path.read_text().split("\n", 1)[1])
    del data["verdict"]["pairs"]  # the right key but an entry that does not rebuild
    path.write_text(cache._signed(data, key, secret))
    _, _, last = _matrix(lab)
    assert len(calls) == 4
    pd.testing.assert_frame_equal(first, last)


def test_use_cache_false_writes_nothing(lab, calls):
    study = report.load_study(lab / "study.toml")
    _, files, _ = report.runs_at_last_step(study)
    cache.study_matrix(study, files, control="c", use_cache=False)
    assert not cache.cache_dir().exists() or not list(cache.cache_dir().glob("matrix-*"))


def test_sections_record_hand_computed_numbers(lab, calls):
    study = report.load_study(lab / "study.toml")
    mx = sections.study_matrix(study)
    assert mx.labels == ["a", "b", "c"] and mx.when == "with no step recorded"
    assert sections.worst_rel_fro(mx) is None  # said as one line per pair, not a table too
    hist, same, ctrl = sections.ulp_hist_table(mx)
    counts = hist.set_index(["pairs", "bucket"])["count"]
    assert counts[(same, "ulp_1")] == 1 and hist.loc[hist["pairs"].eq(same), "count"].sum() == 1
    # a/c: index 0 (2**23 ULP); b/c: index 0 (2**23) and index 1 (1 ULP)
    assert counts[(ctrl, "ulp_gt_65536")] == 2 and counts[(ctrl, "ulp_1")] == 1
    sections.ulp_histogram(mx)
    top = sections.top_differing(mx)
    assert list(top["name"]) == ["w"] and list(top["max_ulp"]) == [1]
    numbers = report.load_numbers(report.numbers_path())
    assert numbers["runs"] == ["a", "b", "c"]
    assert numbers["worst_rel_fro"]["a/b"] == pytest.approx(REL_AB, rel=1e-12)
    assert numbers["hist_same_total"] == 1 and numbers["hist_control_total"] == 3
    assert numbers["same_max_ulp"] == 1 and numbers["control_max_ulp"] == 2**23
    assert (report.figure_dir() / "ulp_histogram.png").stat().st_size > 1000
    assert "finding" in numbers and len(calls) == 1


def test_effective_weights_skipped_without_factor_groups(lab):
    study = report.load_study(lab / "study.toml")
    mx = sections.study_matrix(study)
    assert sections.effective_weights(mx) is None
    numbers = report.load_numbers(report.numbers_path())
    assert any("no factor groups" in s for s in numbers["skipped"])


def test_prose_matrix_runs_and_ulp_title():
    from dmlib.report import prose

    assert prose.matrix_runs("T", 3, "at step 5", "c") == "T: 3 runs at step 5, control `c`."
    assert (
        prose.matrix_runs("T", 2, "at step 5", None) == "T: 2 runs at step 5, no control declared."
    )
    v = {"separation_orders": 2.0, "same_worst_rel_fro": 0.0, "control_rel_fro": 1.0}
    assert prose.ulp_title(v, "at step 5", None).endswith("worst rel_fro over the pairs 0")
    assert prose.ulp_title(v, "at step 5", "c").endswith(
        "vs control 1, 2.0 orders of magnitude apart"
    )
    assert "orders" not in prose.ulp_title({**v, "separation_orders": math.inf}, "x", "c")


def test_prose_pair_worst_lines():
    from dmlib.report import prose

    pairs = pd.DataFrame({"a": ["a", "a"], "b": ["b", "c"], "worst_rel_fro": [0.0, 1.5e-07]})
    assert prose.pair_worst_lines(pairs) == [
        "a/b: worst rel_fro 0",
        "a/c: worst rel_fro 1.5e-07",
    ]


def test_run_matrix_and_ulp_distributions_state_different_findings(lab):
    study = report.load_study(lab / "study.toml")
    mx = sections.study_matrix(study)
    in_rel_fro = sections.matrix_finding(mx)
    sections.top_differing(mx)
    in_ulp = report.load_numbers(report.numbers_path())["finding"]
    assert in_ulp != in_rel_fro
    # by hand: a/b differ by 1 ULP in one element; a/c and b/c by 2**23 ULP at index 0
    assert "by at most 1 ULP" in in_ulp and f"at least {2**23} ULP" in in_ulp
    assert "rel_fro" in in_rel_fro and "rel_fro" not in in_ulp


def test_ulp_pairs_table_keeps_each_pair(lab):
    mx = sections.study_matrix(report.load_study(lab / "study.toml"))
    per = sections.ulp_pairs_table(mx)
    counts = per.set_index(["pair", "bucket"])["count"]
    # a/b: one element 1 ULP apart; b/c: index 0 by 2**23 ULP (> 65,536) and index 1 by 1
    assert counts[("a/b", "ulp_1")] == 1 and per.loc[per["pair"].eq("a/b"), "count"].sum() == 1
    assert counts[("b/c", "ulp_gt_65536")] == 1 and counts[("b/c", "ulp_1")] == 1
    assert (
        counts[("a/c", "ulp_gt_65536")] == 1 and per.loc[per["pair"].eq("a/c"), "count"].sum() == 1
    )
    assert list(dict.fromkeys(per["pair"])) == ["a/b", "a/c", "b/c"]
    assert set(per.loc[per["pair"].eq("a/b"), "group"]) == {"pairs without the control"}
    # the buckets from the first to the last holding a differing element: 1 ULP .. > 65,536
    assert str(per["bucket"].iloc[0]) == "ulp_1" and str(per["bucket"].iloc[-1]) == "ulp_gt_65536"


def test_ulp_title_quotes_the_weights_when_the_matrix_holds_optimizer_state():
    """A training checkpoint's matrix: the histogram counts weights and optimizer elements,
    so the title says both are counted and quotes the weights' worst rel_fro (worked out by
    hand from the rows below), not the optimizer's larger pooled one."""
    from dmlib.report import prose

    frame = pd.DataFrame(
        [
            {"a": "r1", "b": "r2", "name": "w", "rel_fro": 1e-7, "max_ulp": 3},
            {"a": "r1", "b": "r2", "name": "optimizer.state.0.exp_avg", "rel_fro": 1e-3,
             "max_ulp": 900},
            {"a": "r1", "b": "c", "name": "w", "rel_fro": 1e-2, "max_ulp": 10**6},
            {"a": "r1", "b": "c", "name": "optimizer.state.0.exp_avg", "rel_fro": 0.5,
             "max_ulp": 10**7},
        ]
    )  # fmt: skip
    pooled = {"separation_orders": 2.7, "same_worst_rel_fro": 1e-3, "control_rel_fro": 0.5}
    title = prose.ulp_title(pooled, "at step 5", "c", frame)
    assert "(weights and optimizer elements)" in title
    assert "model weights' worst rel_fro without the control 1e-07" in title
    assert "vs control 0.01, 5.0 orders of magnitude apart" in title
    # weights alone: the title is as before
    only_w = frame[frame["name"].eq("w")]
    assert prose.ulp_title(pooled, "at step 5", "c", only_w) == prose.ulp_title(
        pooled, "at step 5", "c"
    )
