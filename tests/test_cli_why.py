"""``dmlib arbitrate`` and ``dmlib repeats`` in-process: exit codes, text, JSON, bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dmlib.cli import main

torch = pytest.importorskip("torch")
from _support.opsmodel import Net, layout  # noqa: E402

import dmlib  # noqa: E402
from dmlib.io.safetensors import write_safetensors  # noqa: E402
from dmlib.localize.ops import op_table  # noqa: E402


def mm_capture(path, x, w):
    m = torch.nn.Module()
    m.forward = lambda a, b: torch.mm(a, b)
    with torch.no_grad(), dmlib.capture(m, path, modules="", ops=True, dump="*"):
        m(x, w)
    return dmlib.open_capture(path)


@pytest.fixture(scope="module")
def mms(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm")
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 16, generator=g), torch.randn(16, 4, generator=g)
    a = mm_capture(root / "a", x, w)
    mm_capture(root / "b", x, w)
    mm_capture(root / "bad", x, w)
    out = op_table(a)[0].outputs[0]
    # plant a wrong result in the dumped output of one run (hashes are not read here)
    bad = dmlib.open_capture(root / "bad")
    file = root / "bad" / bad.boundary(out).dump["file"]
    wrong = np.array(bad.tensor(out)) + np.float32(1e-2)
    write_safetensors(file, {"tensor": wrong})
    return root, op_table(a)[0].id


def test_arbitrate_both_close_exit_0(mms, capsys):
    root, op = mms
    assert main(["arbitrate", str(root / "a"), str(root / "b"), "--op", op]) == 0
    out = capsys.readouterr().out
    assert "both-close" in out and out.splitlines()[0].split()[:3] == ["run", "op", "dtype"]


def test_arbitrate_departure_exit_1_and_json(mms, capsys):
    root, op = mms
    assert main(["arbitrate", str(root / "a"), str(root / "bad"), "--op", op, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "b-departs" and doc["op"] == op
    assert [r["run"] for r in doc["rows"]] == ["a", "b"] and doc["rows"][1]["max_abs"] > 9e-3


def test_arbitrate_numpy_backend_gives_the_same_verdict(mms, capsys):
    """The planted 1e-2 on run b's output is found by the numpy float64 replay too."""
    root, op = mms
    assert main(["arbitrate", str(root / "a"), str(root / "bad"), "--op", op, "--json",
                 "--backend", "numpy"]) == 1  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "b-departs"
    by_torch = dmlib.arbitrate(root / "a", root / "bad", op, backend="torch").table
    assert [r["max_ulp"] for r in doc["rows"]] == list(by_torch["max_ulp"])
    wrong = np.asarray(dmlib.open_capture(root / "bad").tensor(op))
    right = np.asarray(dmlib.open_capture(root / "a").tensor(op))
    assert doc["rows"][1]["max_abs"] == pytest.approx(
        np.abs(wrong.astype(np.float64) - right).max(), abs=1e-6
    )


def test_arbitrate_custom_op_is_inconclusive_exit_1(tmp_path, capsys):
    model = Net()
    for kind in ("alone", "packed"):
        x, rows = layout(kind)
        with torch.no_grad(), dmlib.capture(model, tmp_path / kind, modules="*", row_map=rows,
                                            ops=True, dump="*"):  # fmt: skip
            model(x)
    rc = main(["arbitrate", str(tmp_path / "alone"), str(tmp_path / "packed"), "--request", "q"])
    out = capsys.readouterr().out
    assert rc == 1 and "inconclusive" in out and "reference" in out


def test_arbitrate_bad_input_exit_2(tmp_path, capsys):
    assert main(["arbitrate", str(tmp_path), str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "manifest.json" in err


def test_repeats(tmp_path, capsys):
    same, other = tmp_path / "s.npy", tmp_path / "o.npy"
    np.save(same, np.float32([1, 2]))
    np.save(other, np.float32([1, 3]))
    assert main(["repeats", f"x={same},{same},{same}"]) == 0
    assert "deterministic" in capsys.readouterr().out
    assert main(["repeats", f"x={same},{other},{same}", f"y={same},{same}", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "nondeterministic"
    assert [(r["arm"], r["n"], r["n_differ"]) for r in doc["rows"]] == [("x", 2, 1), ("y", 1, 0)]
    assert main(["repeats", f"x={same},{same}", "--observer", f"{other}"]) == 1
    assert "withheld" in capsys.readouterr().out
    assert main(["repeats", "x"]) == 2
    assert "NAME=PATH" in capsys.readouterr().err
