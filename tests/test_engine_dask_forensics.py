"""engine="dask" for the ladder, padding across runs and factorised layers, on a real
distributed.LocalCluster (2 worker processes): the local engine's frames, exactly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from _support.dask_cluster import local_client

import dmlib
from dmlib import hashing
from dmlib.engine import dask as dask_engine
from dmlib.errors import DmlibError
from dmlib.forensics import ladder as ladder_mod
from dmlib.forensics.factors import FactorGroup

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    with local_client(2) as c:
        yield c


torch = pytest.importorskip("torch")

STEPS = (3, 17, 40)
LOWRANK = FactorGroup.lowrank("{prefix}.lora_a", "{prefix}.lora_b")
SVD = FactorGroup.svd("{prefix}.u", "{prefix}.s", "{prefix}.v")


def _model(seed: int) -> dict[str, np.ndarray]:
    """A tiny real torch model (pooled head, ``model.`` prefix) and two factorised layers."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(
        torch.nn.Conv1d(3, 5, 3), torch.nn.AdaptiveAvgPool1d(1), torch.nn.Flatten(),
        torch.nn.Linear(5, 2),
    )  # fmt: skip
    out = {f"model.{k}": v.detach().numpy().copy() for k, v in net.state_dict().items()}
    rng = np.random.default_rng(seed)
    out["model.adapter.lora_a"] = rng.standard_normal((6, 2)).astype(np.float32)
    out["model.adapter.lora_b"] = rng.standard_normal((2, 4)).astype(np.float32)
    u, s, vt = np.linalg.svd(rng.standard_normal((5, 4)), full_matrices=False)
    out["model.proj.u"], out["model.proj.s"] = u.astype(np.float32), s.astype(np.float32)
    out["model.proj.v"] = vt.T.astype(np.float32).copy()
    out["model.step_count"] = np.arange(7, dtype=np.int64)
    out["model.table"] = rng.standard_normal(70_000).astype(np.float32)
    return out


def _write(path, tensors, step=None) -> str:
    meta = None if step is None else {"step": str(step)}
    dmlib.write_safetensors(path, tensors, metadata=meta)
    return str(path)


def _ladder(tmp_path) -> tuple[dict, int]:
    """Runs base and twin (bit-identical) and drift (planted differences from step 17)."""
    lad: dict[str, dict[int, str]] = {"base": {}, "twin": {}, "drift": {}}
    planted = 0
    for i, step in enumerate(STEPS):
        t = _model(i)
        for run in ("base", "twin"):
            (tmp_path / run).mkdir(exist_ok=True)
            lad[run][step] = _write(tmp_path / run / f"s{step}.safetensors", t, step)
        d = {k: v.copy() for k, v in t.items()}
        if step > 3:
            d["model.0.weight"].view(np.uint32)[0, 0, :2] += 3 * i
            d["model.table"].view(np.uint32)[100 * i : 100 * i + 9] ^= 1
            d["model.adapter.lora_a"][1, 1] *= -1.5  # the layer's effective weight moves
            planted += 2 + 9
        (tmp_path / "drift").mkdir(exist_ok=True)
        lad["drift"][step] = _write(tmp_path / "drift" / f"s{step}.safetensors", d, step)
    return lad, planted


def _task_names(ts) -> list[str]:
    return [str(t["key"]).strip("()',").split("-")[0] for t in ts.data]


@pytest.fixture
def items(monkeypatch):
    """(function, number of work items) of every batched graph the driver computes."""
    seen: list[tuple[str, int]] = []
    real = dask_engine.compute_batched

    def spy(fn, arglists, sizes):
        seen.append((fn.__name__, len(arglists)))
        return real(fn, arglists, sizes)

    monkeypatch.setattr(dask_engine, "compute_batched", spy)
    return seen


def test_ladder_rows_equal_the_local_engine(client, tmp_path, monkeypatch, items):
    monkeypatch.setattr(ladder_mod, "NORM_CHUNK", 1 << 12)  # norms of several chunks
    lad, planted = _ladder(tmp_path)
    local = dmlib.step_ladder(lad, groups=LOWRANK)
    batched = dmlib.step_ladder(lad, groups=LOWRANK, engine="dask")  # small items batched
    pd.testing.assert_frame_equal(batched, local, check_exact=True)
    items.clear()
    monkeypatch.setattr(dask_engine, "BATCH_BYTES", 1)  # one task per work item
    with distributed.get_task_stream(client) as ts:
        remote = dmlib.step_ladder(lad, groups=LOWRANK, engine="dask")
    pd.testing.assert_frame_equal(remote, local, check_exact=True)
    assert remote.attrs == local.attrs
    assert len({t["worker"] for t in ts.data}) == 2  # the work ran on both workers
    # planted differences, counted by hand: base/twin identical, drift differs from step 17
    tensors = local[local["kind"] == "tensor"]
    per_pair = tensors.groupby("pair")["n_diff"].sum().to_dict()
    assert per_pair == {"base/twin": 0, "base/drift": planted, "twin/drift": planted}
    eff = local[(local["kind"] == "effective") & (local["step"] > 3)]
    assert len(eff) == 3 * 2 and eff.loc[eff["pair"] != "base/twin", "n_diff"].gt(0).all()
    # the norm of a tensor, against numpy in float64
    row = local[(local["step"] == 17) & (local["name"] == "model.table")].iloc[0]
    x = _model(1)["model.table"].astype(np.float64)
    assert row["norm"] == pytest.approx(np.sqrt(np.dot(x, x)), rel=1e-12)
    # distinct contents: base/drift and twin/drift hold the same two contents at each
    # step, compared once; base/twin not at all (equal digests)
    n_differing = len(tensors[(tensors["n_diff"] > 0) & (tensors["pair"] == "base/drift")])
    assert sum(n for fn, n in items if fn == "compare_piece") == n_differing
    assert _task_names(ts).count("_effective_task") == 3 * len(STEPS)  # one per layer and pair


def test_norm_pieces_add_up_to_the_local_norm(client, tmp_path, monkeypatch):
    from dmlib.engine.dask_reads import norms

    monkeypatch.setattr(hashing, "PIECE", 1 << 16)  # 64 KiB pieces: 19 of them here
    rng = np.random.default_rng(5)
    arrays = {
        "x": rng.standard_normal(300_001).astype(np.float32) * 1e3,
        "h": rng.standard_normal(99_999).astype(np.float16),
        "i": rng.integers(-9, 9, 50_000).astype(np.int16),
    }
    arrays["x"][[3, 77_777]] = [np.inf, np.nan]  # left out, as the local norm leaves them
    with dmlib.open_tensors(_write(tmp_path / "n.safetensors", arrays)) as ts:
        got = norms([ts[n] for n in arrays], 1 << 10)
        want = [ladder_mod._norm(ts[n].load(), 1 << 10) for n in arrays]
    assert got == want  # bit for bit: the same per-chunk sums added in the same order
    fin = arrays["x"][np.isfinite(arrays["x"])].astype(np.float64)
    assert got[0] == pytest.approx(np.sqrt((fin * fin).sum()), rel=1e-12)


def _dirty_copies(tmp_path) -> tuple[dict[str, str], list[tuple[int, int]]]:
    """Three copies of a real Burn checkpoint with bytes planted in its padding."""
    from tests.conftest import BURNPACK_FIXTURES

    src = BURNPACK_FIXTURES / "case_a.bpk"
    if not src.exists():
        pytest.skip(f"no real Burn checkpoint at {src}")
    from dmlib.padding import _gaps

    with dmlib.open_tensors(src) as ts:
        g = _gaps(ts)
        g = g[g["kind"] == "between-tensors"]  # (the header's padding decides the layout)
        gaps = [(int(s), int(e)) for s, e in zip(g["start"], g["end"], strict=True) if e - s >= 8]
    assert gaps, "the fixture has padding"
    runs = {}
    for k in range(3):
        p = tmp_path / f"run{k}.bpk"
        shutil.copyfile(src, p)
        p.chmod(0o644)
        runs[f"run{k}"] = str(p)
    (s0, _), (_, e1) = gaps[0], gaps[-1]
    w0, w1 = -(-s0 // 4) * 4, e1 // 4 * 4 - 4  # the first and the last slot of the padding
    with open(runs["run1"], "r+b") as f:  # a NaN, then a huge value: run1 alone
        f.seek(w0)
        f.write(np.array([np.nan], "<f4").tobytes())
        f.seek(w1)
        f.write(np.array([3e31], "<f4").tobytes())
    with open(runs["run2"], "r+b") as f:  # a plain value in the same slot as run1's huge one
        f.seek(w1)
        f.write(np.array([0.25], "<f4").tobytes())
    return runs, [(w0, 1), (w1, 1), (w1, 2)]


def test_padding_across_runs_equals_the_local_engine(client, tmp_path, monkeypatch):
    runs, planted = _dirty_copies(tmp_path)
    monkeypatch.setattr(hashing, "PIECE", 64)  # long gaps cut into pieces, as 64 MiB would
    local = dmlib.padding_across_runs(runs)
    remote = dmlib.padding_across_runs(runs, engine="dask")
    pd.testing.assert_frame_equal(remote, local, check_exact=True)
    assert remote.attrs == local.attrs
    # what was planted, and nothing else (the fixture's padding is zero)
    dirty = local[local["dirty"]]
    assert sorted((int(o), int(r[-1])) for o, r in zip(dirty["offset"], dirty["run"])) == sorted(
        planted
    )
    assert int(local["nan"].sum()) == 1 and int(local["huge"].sum()) == 1
    assert set(local.loc[local["differs"], "offset"]) == {planted[0][0], planted[1][0]}


def test_compare_factors_equals_the_local_engine(client, tmp_path):
    a = _model(0)
    b = {k: v.copy() for k, v in a.items()}
    b["model.proj.u"][:, 1] *= -1  # a sign flip of one singular pair: the same weight
    b["model.proj.v"][:, 1] *= -1
    b["model.adapter.lora_b"].view(np.uint32)[0, 2] += 5  # a real change
    pa, pb = _write(tmp_path / "a.safetensors", a), _write(tmp_path / "b.safetensors", b)
    local = dmlib.compare_factors(pa, pb, [SVD, LOWRANK])
    with distributed.get_task_stream(client) as ts:
        remote = dmlib.compare_factors(pa, pb, [SVD, LOWRANK], engine="dask")
    pd.testing.assert_frame_equal(remote, local, check_exact=True)
    assert remote.attrs == local.attrs
    assert _task_names(ts).count("_layer_task") == 2
    rows = local.set_index("group")
    assert rows.loc["model.proj", "factor_n_diff"] == 5 + 4  # column 1 of U [5, 4] and V [4, 4]
    assert rows.loc["model.adapter", "factor_n_diff"] == 1
    assert rows.loc["model.adapter", "n_diff"] == 6  # one element of B: a column of A B
    # the effective weight against numpy in float64
    w = a["model.adapter.lora_a"].astype(np.float64) @ a["model.adapter.lora_b"].astype(np.float64)
    assert rows.loc["model.adapter", "norm"] == pytest.approx(np.linalg.norm(w), rel=1e-12)


def test_factor_errors_are_the_local_engine_errors(client, tmp_path):
    a = _model(0)
    b = {k: v for k, v in a.items() if k != "model.adapter.lora_b"}
    b["model.adapter.lora_b"] = np.zeros((3, 4), np.float32)  # does not fit A [6, 2]
    pa, pb = _write(tmp_path / "a.safetensors", a), _write(tmp_path / "b.safetensors", b)
    msgs = []
    for engine in ("local", "dask"):
        with pytest.raises(DmlibError) as err:
            dmlib.compare_factors(pa, pb, LOWRANK, engine=engine)
        msgs.append(str(err.value))
    assert msgs[0] == msgs[1] and "do not fit" in msgs[0]


def test_in_memory_sources_are_refused_naming_the_local_engine(client):
    arrays = {"w.u": np.eye(2, dtype=np.float32), "w.s": np.ones(2, np.float32),
              "w.v": np.eye(2, dtype=np.float32)}  # fmt: skip
    ts = dmlib.ArrayTensorSet(arrays)
    with pytest.raises(DmlibError, match="engine='local'"):
        dmlib.compare_factors(ts, ts, FactorGroup.svd("{prefix}.u", "{prefix}.s", "{prefix}.v"),
                              engine="dask")  # fmt: skip
    with pytest.raises(DmlibError, match="engine='local'"):
        dmlib.step_ladder({"a": {1: ts}, "b": {1: ts}}, engine="dask")
    with pytest.raises(DmlibError, match="file-backed"):  # as with the local engine
        dmlib.padding_across_runs({"a": ts}, engine="dask")
    with pytest.raises(DmlibError, match="unknown engine"):
        dmlib.padding_across_runs({"a": ts}, engine="ray")


def test_cli_ladder_gapcheck_factors_take_dask(client, tmp_path):
    lad, _ = _ladder(tmp_path)
    ckpts = [f"{run}:{s}={p}" for run, steps in lad.items() for s, p in steps.items()]
    runs, _ = _dirty_copies(tmp_path)
    a, b = lad["base"][17], lad["drift"][17]
    group = "lowrank:{prefix}.lora_a,{prefix}.lora_b"
    for cmd in (
        ["ladder", "--json", *ckpts],
        ["gapcheck", "--json", *runs.values()],
        ["factors", "--json", a, b, "--group", group],
    ):
        base = [sys.executable, "-m", "dmlib", *cmd]
        local = subprocess.run(base, capture_output=True, text=True, check=False)
        remote = subprocess.run(
            [*base, "--dask", client.scheduler.address], capture_output=True, text=True,
            check=False,
        )  # fmt: skip
        assert local.returncode == remote.returncode == 1, (cmd[0], remote.stderr[-2000:])
        assert json.loads(remote.stdout) == json.loads(local.stdout)


def test_effective_weights_do_not_depend_on_the_blas_threads(tmp_path):
    # a Dask worker runs one BLAS thread, this process as many as it likes: the products
    # and norms a row quotes run on one thread either way, so the bits are the same
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(11)
    a = {
        "l.u": rng.standard_normal((384, 96)),
        "l.s": rng.random(96),
        "l.v": rng.standard_normal((320, 96)),
    }
    b = {k: v.copy() for k, v in a.items()}
    b["l.s"] = np.nextafter(b["l.s"], 2.0)  # every singular value one ULP up
    pa, pb = _write(tmp_path / "a.safetensors", a), _write(tmp_path / "b.safetensors", b)
    got = []
    for n in (1, 4):
        with threadpool_limits(limits=n, user_api="blas"):
            got.append(dmlib.compare_factors(pa, pb, SVD))
            got.append(ladder_mod._norm(np.concatenate([a["l.u"].ravel()] * 30)))
    pd.testing.assert_frame_equal(got[0], got[2], check_exact=True)
    assert got[1] == got[3]
