"""Verdicts that training state depends on: a differing scalar is a difference, in every
format; an unread file is not "identical"; prose keeps where a divergence began. No
training here (tests/test_hf_trainer.py trains)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import dmlib
from dmlib.cli import main
from dmlib.stats.compare import compare_records, summarize_records
from dmlib.stats.components import components, printable
from dmlib.tensor import ArrayTensorSet

ARR = {"w": np.arange(6, dtype=np.float32)}


def _pair(sa: dict, sb: dict) -> tuple[ArrayTensorSet, ArrayTensorSet]:
    return ArrayTensorSet(ARR, scalars=sa), ArrayTensorSet(ARR, scalars=sb)


def test_a_differing_scalar_makes_compare_different() -> None:
    a, b = _pair({"last_epoch": 3}, {"last_epoch": 12})
    s = dmlib.summarize(dmlib.compare(a, b))
    assert s["n_diff"] == 0 and s["n_scalars_diff"] == 1
    assert s["identical"] is False
    same = dmlib.summarize(dmlib.compare(*_pair({"last_epoch": 3}, {"last_epoch": 3})))
    assert same["identical"] is True


def test_a_scalar_on_one_side_only_is_a_difference() -> None:
    s = dmlib.summarize(dmlib.compare(*_pair({"last_epoch": 3}, {})))
    assert s["identical"] is False and s["scalars_only"] == ["last_epoch"]
    # the recorded step alone on one side (an export that records none) is not a value left
    # uncompared; held by both sides and different it is a difference
    assert dmlib.summarize(dmlib.compare(*_pair({"step": 3}, {})))["identical"] is True
    assert dmlib.summarize(dmlib.compare(*_pair({"step": 3}, {"step": 4})))["identical"] is False


def test_matrix_pair_with_differing_scalars_is_not_identical() -> None:
    a, b = _pair({"lr": 0.1}, {"lr": 0.2})
    c = ArrayTensorSet(ARR, scalars={"lr": 0.1})
    df = dmlib.matrix({"a": a, "b": b, "c": c})
    pairs = {f"{p['a']}/{p['b']}": p["identical"] for p in df.attrs["verdict"]["pairs"]}
    assert pairs == {"a/b": False, "a/c": True, "b/c": False}


@pytest.mark.parametrize("suffix", [".pt", ".npz"])
def test_cli_scalar_only_files_say_different(tmp_path, capsys, suffix: str) -> None:
    """`compare scheduler.pt` of two steps: no tensor, differing scalars -> DIFFERENT, exit 1."""
    pa, pb = tmp_path / f"a{suffix}", tmp_path / f"b{suffix}"
    if suffix == ".pt":
        torch = pytest.importorskip("torch")
        torch.save({"last_epoch": 3, "base_lrs": [0.001]}, pa)
        torch.save({"last_epoch": 12, "base_lrs": [0.001]}, pb)
        want = "last_epoch: 3 vs 12"
    else:  # npz holds no scalars: equal arrays stay identical
        np.savez(pa, w=ARR["w"])
        np.savez(pb, w=ARR["w"])
        want = None
    code = main(["compare", str(pa), str(pb)])
    out = capsys.readouterr().out
    if want is None:
        assert code == 0 and "IDENTICAL" in out
    else:
        assert code == 1
        assert out.splitlines()[-1].startswith("DIFFERENT")
        assert want in out


def test_an_unread_file_is_never_identical() -> None:
    a = ArrayTensorSet(ARR, metadata={"not_read": "rng_state.pth: refused"})
    b = ArrayTensorSet(ARR, metadata={"not_read": "rng_state.pth: refused"})
    rows, attrs = compare_records(a, b)
    s = summarize_records(rows, attrs)
    assert s["identical"] is False and s["not_read"]
    comps = {c["component"]: c["status"] for c in components(rows, attrs)}
    assert comps["rng"] == "not compared"
    assert comps["weights"] == "identical"


def test_rng_generators_compared_one_by_one() -> None:
    a = ArrayTensorSet(
        {"rng.cpu": np.arange(4, dtype=np.uint8), "rng.numpy.1": np.arange(3, dtype=np.uint32)},
        scalars={"rng.python.1.0": 5, "rng.python.0": 3},
    )
    b = ArrayTensorSet(
        {"rng.cpu": np.arange(4, dtype=np.uint8), "rng.numpy.1": np.array([0, 1, 9], np.uint32)},
        scalars={"rng.python.1.0": 5, "rng.python.0": 3},
    )
    rows, attrs = compare_records(a, b)
    rng = next(c for c in components(rows, attrs) if c["component"] == "rng")
    assert rng["status"] == "differs"
    assert dict(rng["generators"]) == {
        "cpu": "same generator state",
        "numpy": "differs",
        "python": "same generator state",
    }


def test_printable_escapes_control_characters() -> None:
    assert printable("a\x1b[31mb\nc") == "a\\x1b[31mb\\nc"


def test_prose_keeps_the_first_step_compared() -> None:
    from dmlib.report import prose

    df = pd.DataFrame(
        {
            "step": [2, 2, 4, 4],
            "pair": ["A/G"] * 4,
            "name": ["w", "v"] * 2,
            "n_diff": [1, 0, 3, 0],
            "rel_fro": [1e-7, 0.0, 2e-7, 0.0],
        }
    )
    finding, lines = prose.ladder(df, "A", {}, pd.DataFrame(columns=["pair", "slope"]), [], 0.0)
    assert "the earliest from step 2 (A/G) (the first step compared)" in finding
    assert any("(the first step compared)" in line for line in lines)
    later = df.assign(n_diff=[0, 0, 3, 0])
    finding, _ = prose.ladder(later, "A", {}, pd.DataFrame(columns=["pair", "slope"]), [], 0.0)
    assert "the earliest from step 4 (A/G)" in finding and "first step compared" not in finding


# -- broken training folders: one line naming the file, never a traceback ---------------


def _folder(tmp_path, state: str) -> object:
    from safetensors.numpy import save_file

    d = tmp_path / "checkpoint-3"
    d.mkdir()
    save_file({"w": ARR["w"]}, str(d / "model.safetensors"))
    (d / "trainer_state.json").write_text(state, encoding="utf-8")
    return d


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ("{not json", "corrupt trainer state"),
        ("[1, 2]", "not an object"),
        ('{"log_history": 5}', "log_history is not a list"),
        ('{"log_history": [7]}', r"log_history\[0\] is not an object"),
    ],
)
def test_broken_trainer_state(tmp_path, capsys, state: str, message: str) -> None:
    pytest.importorskip("safetensors")
    d = _folder(tmp_path, state)
    with pytest.raises(dmlib.DmlibError, match=message) as info:
        dmlib.open_tensors(d)
    assert str(d / "trainer_state.json") in str(info.value)
    assert main(["inspect", str(d)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "trainer_state.json" in err


def test_minimal_folder_and_a_training_args_file_never_unpickled(tmp_path) -> None:
    pytest.importorskip("safetensors")
    d = _folder(tmp_path, '{"global_step": 3, "log_history": [{"step": 1, "loss": 2.5}]}')
    # a pickle that would run code if it were ever unpickled
    (d / "training_args.bin").write_bytes(
        b"cos\nsystem\n(S'touch " + str(tmp_path / "ran").encode() + b"'\ntR."
    )
    with dmlib.open_tensors(d) as ts:
        assert ts.scalars["step"] == 3
        assert ts["trainer.log_history.loss"].load().tolist() == [2.5]
        assert "not read" in ts.metadata["not_tensors"]
    assert not (tmp_path / "ran").exists()


def test_format_hf_trainer_on_a_file(tmp_path) -> None:
    p = tmp_path / "a.npy"
    np.save(p, ARR["w"])
    with pytest.raises(dmlib.DmlibError, match="names a folder"):
        dmlib.open_tensors(p, format="hf-trainer")


# ----------------------------------------------------------------------------------------
# two run folders (compare_runs' RunsVerdict): made by hand, a difference planted


def _run(root, steps: dict[int, np.ndarray]):
    """A Trainer output folder: checkpoint-N/ with model.safetensors (written by the
    safetensors package) and trainer_state.json for each step."""
    import json

    st = pytest.importorskip("safetensors.numpy")
    for step, w in steps.items():
        d = root / f"checkpoint-{step}"
        d.mkdir(parents=True)
        st.save_file({"w": w}, str(d / "model.safetensors"))
        state = {"global_step": step, "log_history": [{"step": step, "loss": 1.5}]}
        (d / "trainer_state.json").write_text(json.dumps(state))
    return root


_W = {1: np.array([1.0, 2.0, 3.0], np.float32), 2: np.array([4.0, 5.0, 6.0], np.float32)}
_KEYS = [
    "steps", "only_in_a", "only_in_b", "by_step", "first_diff", "first_step",
    "first_components", "loss_parts_at", "bit_exact", "inconclusive",
]  # fmt: skip


def test_identical_runs_are_bit_exact_and_exit_0(tmp_path, capsys) -> None:
    import json

    from dmlib.stats.components import compare_runs
    from dmlib.stats.verdicts import RunsVerdict

    a, b = _run(tmp_path / "a", _W), _run(tmp_path / "b", _W)
    r = compare_runs(a, b)
    assert isinstance(r, RunsVerdict) and bool(r) and r["bit_exact"] is True
    assert str(r) == "BIT-EXACT: every component identical at every shared step (1, 2)"
    assert list(r.to_dict()) == _KEYS and r["steps"] == [1, 2] and r["first_step"] is None
    assert main(["compare", str(a), str(b)]) == 0
    assert "BIT-EXACT" in capsys.readouterr().out
    assert main(["compare", str(a), str(b), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc) == _KEYS and doc["bit_exact"] is True and doc["steps"] == [1, 2]


def test_one_planted_ulp_makes_runs_different_and_exit_1(tmp_path, capsys) -> None:
    import json

    from dmlib.stats.components import compare_runs

    planted = {1: _W[1].copy(), 2: _W[2].copy()}
    planted[2][1] = np.nextafter(np.float32(5.0), np.float32(np.inf))  # +1 ULP at step 2
    a, b = _run(tmp_path / "a", _W), _run(tmp_path / "b", planted)
    r = compare_runs(a, b)
    assert not r and r["bit_exact"] is False
    assert r.first_step == 2 and r.first_components == ["weights"]
    assert r.first_diff == {"weights": 2}
    assert str(r) == "DIFFERENT from step 2: weights differ there"
    assert main(["compare", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT from step 2: weights differ there" in out and "BIT-EXACT" not in out
    assert main(["compare", str(a), str(b), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["bit_exact"] is False and doc["first_step"] == 2


def test_runs_sharing_no_step_are_not_bit_exact(tmp_path, capsys) -> None:
    from dmlib.stats.components import compare_runs

    a, b = _run(tmp_path / "a", {1: _W[1]}), _run(tmp_path / "b", {2: _W[2]})
    r = compare_runs(a, b)
    assert not r and r.steps == [] and r.only_in_a == [1] and r.only_in_b == [2]
    assert str(r) == "NOT ALL COMPARED: nothing compared differs, but the runs share no step"
    assert main(["compare", str(a), str(b)]) == 1
    assert "NOT ALL COMPARED" in capsys.readouterr().out
