"""Sentences of report.prose written out by hand, and the notebooks' setup call."""

from __future__ import annotations

import pandas as pd
import pytest

from dmlib import report
from dmlib.report import prose


def _rec(named, pad, nonzero=0, nan=0, huge=0):
    return {
        "named_slots": named,
        "padding_slots": pad,
        "padding_nonzero_slots": nonzero,
        "nan": nan,
        "huge": huge,
    }


def test_anatomy_sentences_for_clean_and_dirty_padding() -> None:
    slots = {
        "a.bpk": [_rec(1000, 12)],
        "b.bpk": [_rec(600, 3, nonzero=2, nan=1, huge=0), _rec(400, 5, nonzero=1, huge=1)],
    }
    facts = [
        {"a": "a.bpk", "b": "b.bpk", "tensors": 7, "identical_tensors": True,
         "file_sha256_equal": False},
        {"a": "a.bpk", "b": "c.bpk", "tensors": 7, "identical_tensors": True,
         "file_sha256_equal": True},
        {"a": "b.bpk", "b": "c.bpk", "tensors": 7, "identical_tensors": False,
         "file_sha256_equal": False},
    ]  # fmt: skip
    finding, lines = prose.anatomy(slots, facts, n_files=3)
    assert finding == (
        "2 burnpack file(s) mapped; 1 with non-zero padding; "
        "1 pair(s) hold identical tensors in different files."
    )
    assert lines == [
        "`a.bpk`: 1,000 named slots and 12 padding slots over 1 record(s); "
        "the padding is all zero bytes.",
        "`b.bpk`: 1,000 named slots and 8 padding slots over 2 record(s); 3 padding slots "
        "hold non-zero bytes (1 NaN, 1 |v| >= 1e30): a flat read counts them as parameters.",
        "`a.bpk` and `b.bpk`: 7 tensors, bit-identical, yet the files differ: compare named "
        "tensors, never file hashes.",
        "`a.bpk` and `c.bpk`: 7 tensors, bit-identical, and the files are byte-identical.",
        "`b.bpk` and `c.bpk`: 7 tensors, not identical.",
    ]


def test_anatomy_without_burnpack_files_or_pairs() -> None:
    assert prose.anatomy({}, [], n_files=2) == ("2 file(s) listed, none burnpack.", [])


def test_anatomy_names_cannot_carry_markup() -> None:
    _, lines = prose.anatomy({"x`<b>": [_rec(1, 0)]}, [], n_files=1)
    # a code span whose fence is longer than the backtick run inside: the name stays literal
    assert lines[0].startswith("``x`<b>``: 1 named slots")


def test_not_burnpack_names_the_file_and_its_format() -> None:
    assert prose.not_burnpack("w.npz", "npz") == (
        "w.npz is a npz file: the byte-layout map and padding census read burnpack files"
    )


def test_setup_configures_the_folder_and_name_and_loads_the_study(tmp_path, monkeypatch) -> None:
    ckpt = tmp_path / "a.npz"
    import numpy as np

    np.savez(ckpt, w=np.zeros(2, np.float32))
    (tmp_path / "study.toml").write_text('title = "t"\n[runs]\na = "a.npz"\n')
    monkeypatch.setattr(report.notebook, "_config", {"figure_dir": None, "notebook": None})
    with pd.option_context("display.width", 80, "display.max_columns", 5):
        study = report.setup(tmp_path / "study.toml", tmp_path / "figs", "nb_x")
        assert pd.get_option("display.width") == 160
        assert pd.get_option("display.max_columns") == 20
    assert study.title == "t" and list(study.runs) == ["a"]
    assert report.figure_dir() == tmp_path / "figs"
    assert report.numbers_path() == tmp_path / "numbers" / "nb_x.json"


def _study(tmp_path, labels, control=None):
    import numpy as np

    for k in labels:
        np.savez(tmp_path / f"{k}.npz", w=np.zeros(2, np.float32))
    runs = "".join(f'{k} = "{k}.npz"\n' for k in labels)
    head = f'title = "t"\ncontrol = "{control}"\n' if control else 'title = "t"\n'
    (tmp_path / "study.toml").write_text(head + "[runs]\n" + runs)
    return report.load_study(tmp_path / "study.toml")


def test_runs_at_last_step_puts_the_control_last_and_small_keeps_three(tmp_path) -> None:
    study = _study(tmp_path, ["ctl", "a", "b", "c", "d"], control="ctl")
    labels, files, _ = report.runs_at_last_step(study)
    assert labels == ["a", "b", "c", "d", "ctl"]
    assert {k: p.name for k, p in files.items()} == {k: f"{k}.npz" for k in labels}
    labels, files, _ = report.runs_at_last_step(study, small=True)
    assert labels == ["a", "b", "c", "ctl"] and list(files) == labels


def test_runs_at_last_step_without_a_control(tmp_path) -> None:
    study = _study(tmp_path, ["a", "b", "c", "d"])
    assert report.runs_at_last_step(study, small=True)[0] == ["a", "b", "c"]


def _toy_study(tmp_path):
    """Captures of the toy model alone (twice), packed (twice): a study file naming them."""
    pytest.importorskip("torch")
    from _support.toymodel import Toy, run_capture

    for name, kind in (("alone", "alone"), ("alone_r", "alone"), ("packed", "packed"),
                       ("packed_r", "packed"), ("other", "packed")):  # fmt: skip
        run_capture(Toy(), tmp_path / name, kind, modules="*")
    (tmp_path / "study.toml").write_text(
        'title = "toy"\n[captures]\nrequest = "r"\nreference = "alone"\n'
        '[captures.folders]\nalone = "alone"\npacked = "packed"\nother = "other"\n'
        '[captures.repeats]\nalone = "alone_r"\npacked = "packed_r"\n'
    )
    return report.load_study(tmp_path / "study.toml")


def test_compare_study_captures_passes_each_comparison_its_controls(tmp_path) -> None:
    import dmlib

    study = _toy_study(tmp_path)
    got = report.compare_study_captures(study)
    assert list(got) == ["alone vs packed", "alone vs other", "alone vs its repeat"]
    d = tmp_path
    want = {
        "alone vs packed": dmlib.compare_captures(
            d / "alone", d / "packed", request="r", repeat=(d / "alone_r", d / "packed_r")
        ),
        "alone vs other": dmlib.compare_captures(
            d / "alone", d / "other", request="r", repeat=(d / "alone_r",)
        ),
        "alone vs its repeat": dmlib.compare_captures(d / "alone", d / "alone_r", request="r"),
    }
    for label, df in want.items():
        pd.testing.assert_frame_equal(got[label], df)
        assert got[label].attrs["repeat_control"] == df.attrs["repeat_control"]
    assert got["alone vs packed"].attrs["repeat_control"] is not None
    assert got["alone vs its repeat"].attrs["repeat_control"] is None


def _verdict(control, pairs, identical, **kw):
    return {"control": control, "pairs": pairs, "identical_pairs": identical, **kw}


def test_ulp_finding_in_ulp_not_rel_fro() -> None:
    same = {"a": "a", "b": "b", "control": False}
    with_c = [{"a": "a", "b": "c", "control": True}, {"a": "b", "b": "c", "control": True}]
    v = _verdict("c", [same, *with_c], [], same_max_ulp=3, same_worst_median_ulp=1.0,
                 control_max_ulp=8388608)  # fmt: skip
    assert prose.ulp_finding(v, "at step 5") == (
        "At step 5: none of the 1 pairs without the control is bit-identical; they differ by "
        "at most 3 ULP (the largest per-tensor median 1 ULP); every pair with the control c "
        "reaches at least 8388608 ULP in its worst tensor."
    )
    v = _verdict(None, [same, {"a": "a", "b": "d", "control": False}], ["a/b"],
                 same_max_ulp=2, same_worst_median_ulp=2.0)  # fmt: skip
    assert prose.ulp_finding(v, "at step 5") == (
        "At step 5: 1 of 2 pairs bit-identical; the others differ by at most 2 ULP "
        "(the largest per-tensor median 2 ULP)."
    )
    v = _verdict(None, [same], ["a/b"], same_max_ulp=0, same_worst_median_ulp=0.0)
    assert prose.ulp_finding(v, "at step 5") == "At step 5: all 1 pairs bit-identical (0 ULP)."


def test_matrix_finding_quotes_the_weights_apart_from_the_optimizer() -> None:
    """Training checkpoints: the headline's worst rel_fro is the weights' (a training user's
    first question), the optimizer moments' said apart; numbers from numpy."""
    import numpy as np

    from dmlib.stats.matrix import matrix
    from dmlib.tensor import ArrayTensorSet

    g = np.random.default_rng(0)
    w = g.standard_normal((6, 4))
    m = np.abs(g.standard_normal((6, 4))) * 1e-3
    w_rep, m_rep = w.copy(), m.copy()
    w_rep[0, 0] = np.nextafter(w_rep[0, 0], np.inf)
    m_rep *= 1.5  # the moments differ far more than the weights
    w_ctl = g.standard_normal((6, 4))
    runs = {
        label: ArrayTensorSet({"model.w": a, "optimizer.state.0.exp_avg_sq": b})
        for label, (a, b) in {"base": (w, m), "rep": (w_rep, m_rep), "seed1": (w_ctl, m)}.items()
    }
    df = matrix(runs, control="seed1")
    v = df.attrs["verdict"]

    def rel(a, b):
        return float(np.linalg.norm(a - b) / np.linalg.norm(a))

    weights, moments = rel(w, w_rep), rel(m, m_rep)
    assert v["same_worst_rel_fro"] == pytest.approx(moments)  # the verdict pools them
    ctrl = min(rel(w, w_ctl), rel(w_rep, w_ctl))
    finding, _ = prose.matrix(v, "at step 5", n_tensors=2, differing=[], frame=df)
    head, _, rest = finding.partition("Apart from the weights")
    assert "model weights only" in head
    assert prose.fmt(weights) in head and prose.fmt(moments) not in head
    assert prose.fmt(ctrl) in head
    assert f"{np.log10(ctrl / weights):.1f} orders of magnitude" in head
    assert "optimizer state: at most " + prose.fmt(moments) in rest
    plain, _ = prose.matrix(v, "at step 5", n_tensors=2, differing=[])  # no frame: as before
    assert "model weights only" not in plain and prose.fmt(moments) in plain


def test_captures_finding_names_every_entry_point_and_counts_routing_flips_apart() -> None:
    """The lab's moe_packed bf16 captures (committed files): two boundaries have identical
    inputs and a differing output (the rows whose role is culprit: layer 1's attention and
    layer 0's recurrent state), and four expert boundaries hold the flipped token in one run
    only. The finding names both entry points and counts the four apart, not as four
    boundaries that 'could not be judged'."""
    from pathlib import Path

    import dmlib
    from dmlib.report import prose

    data = Path(__file__).resolve().parent.parent / "data" / "moe_packed" / "bf16"
    df = dmlib.compare_captures(data / "alone", data / "packed", request="probe")
    culprits = df.loc[df["role"] == "culprit", "boundary"].tolist()
    assert len(culprits) == 2
    flipped = [b for b, n in zip(df["boundary"], df["note"], strict=True)
               if ":expert" in b and isinstance(n, str) and n.startswith("not judged: routing flip")]  # fmt: skip
    finding, _ = prose.captures({"alone vs packed": df})
    for c in culprits:
        assert f"`{c}`" in finding
    assert len(flipped) == 4
    assert f"{len(flipped)} expert boundaries hold a token routed" in finding
    assert "could not be judged" not in finding
