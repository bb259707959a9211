"""The forensics subcommands, run in-process on small files with planted differences."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from dmlib.cli import main
from dmlib.io.burnpack import write_burnpack


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def svd_files(tmp_path):
    rng = np.random.default_rng(4)
    u, _ = np.linalg.qr(rng.standard_normal((8, 3)))
    v, _ = np.linalg.qr(rng.standard_normal((5, 3)))
    s = np.array([4.0, 2.0, 1.0])
    a = {"l0.u": u, "l0.s": s, "l0.vt": v.T.copy(), "l1.u": u, "l1.s": s, "l1.vt": v.T.copy()}
    flipped = dict(a, **{"l0.u": u * [1, -1, 1], "l0.vt": (v * [1, -1, 1]).T.copy()})
    shifted = dict(a, **{"l1.s": s + [0.0, 0.0, 0.5]})
    paths = {}
    for label, tensors in {"a": a, "flipped": flipped, "shifted": shifted}.items():
        paths[label] = str(tmp_path / f"{label}.bpk")
        write_burnpack(paths[label], tensors)
    return paths


GROUP = "svd:{prefix}.u,{prefix}.s,{prefix}.vt^T"


def test_factors_json_identical_effective_weights(capsys, svd_files):
    code, out, _ = _run(
        capsys, ["factors", svd_files["a"], svd_files["flipped"], "--group", GROUP, "--json"]
    )
    doc = json.loads(out)
    assert code == 0
    rows = {r["group"]: r for r in doc["rows"]}
    assert set(rows) == {"l0", "l1"}
    assert rows["l0"]["rel_fro"] == 0.0 and rows["l0"]["factor_n_diff"] == 8 + 5
    assert rows["l0"]["shape"] == [8, 5]


def test_factors_planted_delta(capsys, svd_files):
    code, out, _ = _run(
        capsys, ["factors", svd_files["a"], svd_files["shifted"], "--group", GROUP, "--json"]
    )
    doc = json.loads(out)
    assert code == 1
    assert doc["worst_group"] == "l1"
    # dW = 0.5 u_2 v_2^T with unit vectors; ||W|| = ||s|| = sqrt(21)
    assert doc["worst_rel_fro"] == pytest.approx(0.5 / np.sqrt(21.0), rel=1e-9)
    code, out, _ = _run(capsys, ["factors", svd_files["a"], svd_files["shifted"], "--group", GROUP])
    assert code == 1 and "DIFFERENT" in out and "l1" in out


def test_factors_bad_group_is_exit_2(capsys, svd_files):
    code, _, err = _run(capsys, ["factors", svd_files["a"], svd_files["a"], "--group", "svd:a,b"])
    assert code == 2 and "expected --group svd:U,S,V" in err


def test_firstcol_json(capsys, tmp_path):
    rng = np.random.default_rng(8)
    q, _ = np.linalg.qr(rng.standard_normal((12, 6)))
    q = q.astype(np.float32)
    nudged = q.copy()
    nudged[7, 4] = np.nextafter(nudged[7, 4], np.float32(np.inf))  # first divergent column: 4
    flipped = q.copy()
    flipped[:, 2] *= -1
    paths = {}
    for label, (f1, f2) in {"A": (q, q), "B": (q, nudged), "C": (flipped, q)}.items():
        paths[label] = tmp_path / f"{label}.bpk"
        write_burnpack(paths[label], {"f.q": f1, "g.q": f2, "bias": np.zeros(6, np.float32)})
    argv = ["firstcol", *(f"{k}={v}" for k, v in paths.items()), "--include", "*.q", "--json"]
    code, out, _ = _run(capsys, argv)
    assert code == 1
    doc = json.loads(out)
    got = {(r["pair"], r["name"]): (r["first_col"], r["n_flipped"]) for r in doc["rows"]}
    assert got == {
        ("A/B", "f.q"): (None, 0), ("A/B", "g.q"): (4, 0),
        ("A/C", "f.q"): (2, 1), ("A/C", "g.q"): (None, 0),
        ("B/C", "f.q"): (2, 1), ("B/C", "g.q"): (4, 0),
    }  # fmt: skip
    assert doc["summary"]["n_pairs"] == 6 and doc["summary"]["n_identical"] == 2
    assert doc["summary"]["first_col_min"] == 2 and doc["summary"]["first_col_max"] == 4
    assert doc["summary"]["n_flipped"] == 2
    code, out, _ = _run(capsys, argv[:-1])
    assert code == 1 and "6 tensor pairs, 2 identical" in out
    code, _, err = _run(capsys, ["firstcol", "A=" + str(paths["A"]), "B" + str(paths["B"])])
    assert code == 2 and "expected LABEL=PATH" in err


def test_ladder_json_flags_artifact_and_missing(capsys, tmp_path):
    rng = np.random.default_rng(6)
    w = rng.standard_normal((4, 4)).astype(np.float32)
    items = []
    for run in ("a", "b"):
        for step in (0, 5, 50):
            p = tmp_path / f"{run}{step}.bpk"
            data = w if run == "a" else w * np.float32(1 + step / 64)
            recorded = 0 if (run, step) == ("b", 50) else step  # b died before its final save
            write_burnpack(p, {"w": data}, scalars={"step": recorded})
            items.append(f"{run}:{step}={p}")
    items.append(f"b:100={tmp_path / 'absent.bpk'}")
    items.append(f"a:100={tmp_path / 'a50.bpk'}")
    # a missing checkpoint is bad input unless the user asks for it to be reported
    code, _, err = _run(capsys, ["ladder", *items, "--step-key", "scalars:step"])
    assert code == 2 and "absent.bpk" in err and len(err.strip().splitlines()) == 1
    code, out, _ = _run(
        capsys, ["ladder", *items, "--step-key", "scalars:step", "--allow-missing", "--json"]
    )
    assert code == 1
    doc = json.loads(out)
    status = {(c["run"], c["step"]): c["status"] for c in doc["checks"]}
    assert status[("b", 50)] == "artifact" and status[("b", 100)] == "missing"
    assert status[("a", 100)] == "artifact"  # a step-50 file claimed as 100
    assert sorted({r["step"] for r in doc["rows"]}) == [0, 5]
    rel = {r["step"]: r["rel_fro"] for r in doc["rows"]}
    assert rel[0] == 0.0
    assert rel[5] == pytest.approx(5 / 64, rel=1e-6)  # float32 rounding of w * (1 + 5/64)
    assert {(e["run"], e["step"]) for e in doc["excluded"]} == {("b", 50), ("b", 100), ("a", 100)}
    code, out, err = _run(capsys, ["ladder", *items, "--allow-missing"])
    assert code == 1 and "excluded: run b step 50: artifact: recorded step 0, claimed 50" in err
    code, _, err = _run(capsys, ["ladder", "a5=x.bpk"])
    assert code == 2 and "LABEL:STEP=PATH" in err


def test_gapcheck_json(capsys, tmp_path):
    tensors = {"x": np.ones(3, np.float32), "y": np.zeros(2, np.float32)}
    starts = []

    def dirty(offset: int, nbytes: int) -> bytes:
        starts.append(offset)
        return struct.pack("<f", float("nan")) + bytes(nbytes - 4)

    pa, pb = tmp_path / "a.bpk", tmp_path / "b.bpk"
    write_burnpack(pa, tensors, pad_fill=dirty)
    write_burnpack(pb, tensors)
    code, out, _ = _run(capsys, ["gapcheck", f"A={pa}", f"B={pb}", "--json"])
    assert code == 1
    doc = json.loads(out)
    assert doc["differs"] is True and doc["inside_tensor"] == 0
    dirty_rows = [s for s in doc["slots"] if s["dirty"]]
    assert [(s["run"], s["offset"], s["nan"]) for s in dirty_rows] == [("A", starts[0], True)]
    assert {r["run"]: r["nan"] for r in doc["runs"]} == {"A": 1, "B": 0}
    pc = tmp_path / "c.bpk"
    write_burnpack(pc, tensors)
    code, out, _ = _run(capsys, ["gapcheck", str(pb), str(pc)])
    assert code == 0 and "0 inside a named tensor" in out and str(pc) in out
