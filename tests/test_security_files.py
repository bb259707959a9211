"""Promise: dmlib deletes nothing it did not write and reads only files a capture names."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from dmlib.errors import CaptureError, DmlibError
from dmlib.localize.captures import open_capture

torch = pytest.importorskip("torch")


def _run(path: Path, **kw: object) -> None:
    import dmlib

    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    with torch.no_grad(), dmlib.capture(model, path, dump="*", **kw):
        model(torch.ones(1, 3))


def test_overwrite_refuses_a_folder_that_is_not_a_capture(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    (mine / "tensors").mkdir(parents=True)
    keep = mine / "tensors" / "weights.safetensors"
    keep.write_bytes(b"user data")
    with pytest.raises(CaptureError, match="not a capture|replaces only a capture"):
        _run(mine, overwrite=True)
    assert keep.read_bytes() == b"user data"
    assert not (mine / "manifest.json").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    with pytest.raises(CaptureError, match="replaces only a capture"):
        _run(other, overwrite=True)
    (other / "manifest.json").write_text('{"not": "a capture"}')
    with pytest.raises(CaptureError, match="not a dmlib-capture manifest"):
        _run(other, overwrite=True)


def test_overwrite_replaces_a_capture(tmp_path: Path) -> None:
    _run(tmp_path / "c")
    _run(tmp_path / "c", overwrite=True)
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["complete"] is True


def _with_dump(tmp_path: Path, rel: str) -> Path:
    cap = tmp_path / "cap"
    _run(cap)
    m = json.loads((cap / "manifest.json").read_text())
    b = next(b for b in m["boundaries"] if b.get("dump"))
    b["dump"]["file"] = rel
    (cap / "manifest.json").write_text(json.dumps(m))
    return cap


@pytest.mark.parametrize("rel", ["/etc/passwd", "../outside.safetensors", "tensors/../../x"])
def test_manifest_dump_path_must_stay_inside(tmp_path: Path, rel: str) -> None:
    cap = _with_dump(tmp_path, rel)
    with pytest.raises(CaptureError, match="manifest.json: boundary .*dump file") as e:
        open_capture(cap)
    assert "absolute" in str(e.value) or "outside" in str(e.value)


def test_manifest_dump_symlink_out_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"x")
    cap = _with_dump(tmp_path, "tensors/link.safetensors")
    os.symlink(secret, cap / "tensors" / "link.safetensors")
    with pytest.raises(CaptureError, match="outside the folder"):
        open_capture(cap)


def test_manifest_nesting_is_bounded(tmp_path: Path) -> None:
    cap = tmp_path / "deep"
    cap.mkdir()
    (cap / "manifest.json").write_text(
        '{"format": "dmlib-capture", "m": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    with pytest.raises(CaptureError, match="nested too deeply"):
        open_capture(cap)


def _study(tmp_path: Path, folder: str) -> Path:
    cap = tmp_path / "s" / "a"
    _run(cap)
    (tmp_path / "s" / "study.toml").write_text(
        f'[captures]\nrequest = "0"\n[captures.folders]\na = "a"\nb = "{folder}"\n'
    )
    return tmp_path / "s"


@pytest.mark.parametrize("folder", ["..", "/proc", "/usr/share"])
def test_study_refuses_a_capture_folder_without_manifest(tmp_path: Path, folder: str) -> None:
    from dmlib.report.study import load_study

    if not Path(folder if folder != ".." else tmp_path).is_dir():
        pytest.skip(f"{folder} is not a folder here")
    with pytest.raises(DmlibError, match="holds no manifest.json"):
        load_study(_study(tmp_path, folder))


def test_study_lists_only_the_manifest_and_its_dumps(tmp_path: Path) -> None:
    from dmlib.report.study import load_study

    s = _study(tmp_path, "a2")
    _run(s / "a2")
    (s / "a2" / "id_rsa").write_text("secret")
    files = load_study(s).input_files()
    names = {p.relative_to(s).as_posix() for p in files}
    m = json.loads((s / "a2" / "manifest.json").read_text())
    expected = {"a2/manifest.json"} | {
        "a2/" + b["dump"]["file"] for b in m["boundaries"] if b.get("dump")
    }
    assert {n for n in names if n.startswith("a2/")} == expected
    assert "a2/id_rsa" not in names
    assert np.all([p.is_file() for p in files])


def test_overwrite_refuses_a_manifest_that_is_a_link_or_a_fifo(tmp_path: Path) -> None:
    """A ``manifest.json`` that is a symbolic link (even to a real capture's manifest) or a
    FIFO is not a capture: refused without following the link or waiting on the FIFO, and
    left as it was."""
    import signal

    _run(tmp_path / "real")
    target = tmp_path / "real" / "manifest.json"
    before = target.read_bytes()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "manifest.json").symlink_to(target)
    with pytest.raises(CaptureError, match="not a dmlib-capture manifest"):
        _run(linked, overwrite=True)
    assert (linked / "manifest.json").is_symlink() and target.read_bytes() == before
    if not hasattr(os, "mkfifo"):
        return
    piped = tmp_path / "piped"
    piped.mkdir()
    os.mkfifo(piped / "manifest.json")

    def stuck(*_: object) -> None:
        raise AssertionError("waited on the FIFO")

    old = signal.signal(signal.SIGALRM, stuck)
    signal.alarm(20)
    try:
        with pytest.raises(CaptureError, match="not a dmlib-capture manifest"):
            _run(piped, overwrite=True)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert sorted(os.listdir(piped)) == ["manifest.json"]
