"""engine="dask" on a real distributed.LocalCluster (2 worker processes): the local engine's rows."""

from __future__ import annotations

import os
import signal
import threading
import time

import ml_dtypes
import numpy as np
import pandas as pd
import pytest
from _support.dask_cluster import DASK_START_S, local_client

import dmlib
from dmlib import hashing
from dmlib.engine import dask as dask_engine
from dmlib.errors import DmlibError

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client():
    with local_client(2) as c:
        yield c


PIECE = 1 << 20  # 1 MiB pieces (the rule is the same at 64 MiB): several per tensor here
CHUNK = 1 << 18


@pytest.fixture
def small_pieces(monkeypatch):
    # pieces are cut (and their digests combined) by the driver: this process alone decides
    monkeypatch.setattr(hashing, "PIECE", PIECE)
    monkeypatch.setattr(dask_engine, "BATCH_BYTES", 2 * PIECE)  # a task per piece pair


def _pair(tmp_path, big: int = 300_000) -> tuple[str, str]:
    """Two checkpoints of a tiny real model plus planted differences, each edge case once."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    rng = np.random.default_rng(1)
    a = {f"model.{k}": v.detach().numpy().copy() for k, v in net.state_dict().items()}
    a["model.pool.table"] = rng.standard_normal(big).astype(np.float32)  # several pieces
    a["model.emb.bf16"] = rng.standard_normal(500).astype(ml_dtypes.bfloat16)
    a["model.steps"] = np.arange(40, dtype=np.int64)
    a["model.mask"] = rng.random(17) < 0.5
    a["model.far"] = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    a["model.to_zero"] = rng.standard_normal(32).astype(np.float32)
    b = {k: v.copy() for k, v in a.items()}
    b["model.pool.table"].view(np.uint32)[big - 20 : big - 5] += 2  # the last piece only
    b["model.2.weight"].view(np.uint32)[0, 1] += 1
    b["model.emb.bf16"].view(np.uint16)[7] += 3
    b["model.steps"][5] = -9
    b["model.mask"][4] = ~b["model.mask"][4]
    b["model.far"].view(np.uint32)[:3] += 100_000  # median above the exact range: a rescan
    b["model.to_zero"][:] = 0.0  # b.b from a cancellation: summed again
    b["model.to_zero"][3] = 1e-30
    pa, pb = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    dmlib.write_safetensors(pa, a)
    dmlib.write_safetensors(pb, b)
    return str(pa), str(pb)


@pytest.mark.parametrize("hash_name", ["blake3", "sha256"])
def test_compare_rows_equal_the_local_engine(client, small_pieces, tmp_path, hash_name):
    pa, pb = _pair(tmp_path)
    local = dmlib.compare(pa, pb, chunk_bytes=CHUNK, hash=hash_name)
    with distributed.get_task_stream(client) as ts:
        remote = dmlib.compare(pa, pb, chunk_bytes=CHUNK, hash=hash_name, engine="dask")
    pd.testing.assert_frame_equal(remote, local, check_exact=True)
    assert remote.attrs == local.attrs
    assert local["n_diff"].gt(0).sum() == 7  # every planted difference is there
    # the work ran on both worker processes
    assert len({t["worker"] for t in ts.data}) == 2


def test_matrix_rows_equal_the_local_engine(client, small_pieces, tmp_path):
    pa, pb = _pair(tmp_path, big=100_000)
    runs = {"r1": pa, "r2": pb, "r3": pa}
    local = dmlib.matrix(runs, control="r2", chunk_bytes=CHUNK)
    remote = dmlib.matrix(runs, control="r2", chunk_bytes=CHUNK, engine="dask")
    pd.testing.assert_frame_equal(remote, local, check_exact=True)
    assert remote.attrs["verdict"] == local.attrs["verdict"]
    assert remote.attrs["verdict"]["identical_pairs"] == ["r1/r3"]


def test_a_killed_worker_is_retried_and_the_answer_is_exact(client, small_pieces, tmp_path):
    pa, pb = _pair(tmp_path, big=12_000_000)  # 48 MiB per side: 46 pieces
    local = dmlib.compare(pa, pb, chunk_bytes=CHUNK)
    pids = client.run(os.getpid)
    out: dict = {}

    def run() -> None:
        out["df"] = dmlib.compare(pa, pb, chunk_bytes=CHUNK, engine="dask")

    th = threading.Thread(target=run)
    th.start()
    deadline = time.monotonic() + DASK_START_S
    while not client.processing() or not any(client.processing().values()):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    victim = sorted(pids.values())[0]
    assert th.is_alive()  # killed while the comparison runs
    os.kill(victim, signal.SIGKILL)
    th.join(timeout=300)
    assert not th.is_alive()
    pd.testing.assert_frame_equal(out["df"], local, check_exact=True)
    client.wait_for_workers(2, timeout=DASK_START_S)  # its replacement, on a busy machine


def test_a_path_the_workers_cannot_see_is_one_clear_error(client, tmp_path):
    pa, pb = _pair(tmp_path, big=1000)
    with dmlib.open_tensors(pa) as sa, dmlib.open_tensors(pb) as sb:
        os.unlink(pb)  # this process still has it open; a worker, opening the path, does not
        with pytest.raises(DmlibError, match="Dask worker could not read"):
            dmlib.compare(sa, sb, engine="dask")


def test_in_memory_tensors_are_refused_with_a_reason(client):
    a = dmlib.ArrayTensorSet({"w": np.zeros(3, np.float32)})
    with pytest.raises(DmlibError, match="engine='local'"):
        dmlib.compare(a, a, engine="dask")


def test_cli_dask_address_prints_the_local_rows(client, tmp_path):
    import json
    import subprocess
    import sys

    pa, pb = _pair(tmp_path, big=1000)
    cmd = [sys.executable, "-m", "dmlib", "compare", "--json", pa, pb]
    local = subprocess.run(cmd, capture_output=True, text=True, check=False)
    remote = subprocess.run(
        [*cmd, "--dask", client.scheduler.address], capture_output=True, text=True, check=False
    )
    assert (local.returncode, remote.returncode) == (1, 1), remote.stderr[-2000:]
    assert json.loads(remote.stdout)["rows"] == json.loads(local.stdout)["rows"]
    bad = subprocess.run(
        [*cmd, "--dask", "local:zero"], capture_output=True, text=True, check=False
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "local:N" in bad.stderr


def test_big_endian_and_complex_are_refused_with_a_reason(tmp_path):
    # the pieces compare native-order real elements; the local engine handles these
    for name, arr in (("be", np.arange(6, dtype=">f4")), ("cx", np.arange(6).astype(np.complex64))):
        np.save(tmp_path / f"{name}_a.npy", arr)
        np.save(tmp_path / f"{name}_b.npy", arr)
        with pytest.raises(DmlibError, match="engine='local'"):
            dmlib.compare(tmp_path / f"{name}_a.npy", tmp_path / f"{name}_b.npy", engine="dask")
