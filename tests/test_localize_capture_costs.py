"""What a capture syncs to disk: dumps and the manifest that vouches for them, not less."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import dmlib  # noqa: E402


def _run(path, monkeypatch, **kw) -> list[str]:
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}") if os.path.exists("/proc") else "?")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh()).eval()
    rows = [("r", j) for j in range(4)]
    with torch.no_grad(), dmlib.capture(model, path, row_map=rows, **kw):
        model(torch.ones(4, 3))
    monkeypatch.setattr(os, "fsync", real)
    return synced


def test_without_dumps_nothing_is_synced_and_the_capture_reads(tmp_path, monkeypatch):
    assert _run(tmp_path / "c", monkeypatch) == []
    c = dmlib.open_capture(tmp_path / "c")
    assert c.manifest["complete"] is True and len(c) == 4
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["manifest.json"]


def test_with_dumps_the_dumps_and_then_the_manifest_are_synced(tmp_path, monkeypatch):
    synced = _run(tmp_path / "c", monkeypatch, dump=["0"])
    assert len(synced) == 2
    if synced[0] != "?":  # the dump first, the manifest (under a temporary name) last
        assert ".safetensors" in synced[0] and "manifest.json" in synced[1]
    c = dmlib.open_capture(tmp_path / "c")
    assert c.dumped(c.boundary("0")) and c.manifest["complete"] is True
