"""Nothing lost: inputs are never written, outputs appear whole or not at all.

Every CLI subcommand (discovered from the parser) runs on a folder of inputs whose
bytes, mtimes and listing are compared before and after. Writers are interrupted
mid-write (a fill callback, a tensor or ``os.replace`` that raises) and must leave
neither a file at the target nor a temporary file beside it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

import dmlib
from dmlib import _atomic
from dmlib.cli import build_parser, main
from dmlib.io.burnpack import encode_burnpack, write_burnpack, write_records


def _snapshot(folder: Path) -> dict[str, tuple[str, int, int, int]]:
    """path -> (sha256, size, mtime_ns, mode) of every file under ``folder``."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            st = p.stat()
            out[str(p.relative_to(folder))] = (
                hashlib.sha256(p.read_bytes()).hexdigest(),
                st.st_size,
                st.st_mtime_ns,
                st.st_mode,
            )
    return out


def _tensors(scale: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "layer.u": (rng.standard_normal((4, 2)) * scale).astype(np.float32),
        "layer.s": np.array([2.0, 1.0], np.float32) * scale,
        "layer.v": rng.standard_normal((3, 2)).astype(np.float32),
        "layer.bias": np.zeros(3, np.float32),
    }


@pytest.fixture
def inputs(tmp_path: Path) -> Path:
    d = tmp_path / "inputs"
    d.mkdir()
    (d / "a1.bpk").write_bytes(encode_burnpack(_tensors(1.0), scalars={"step": 1}))
    (d / "a2.bpk").write_bytes(encode_burnpack(_tensors(1.5), scalars={"step": 2}))
    (d / "b1.bpk").write_bytes(
        encode_burnpack(_tensors(1.0), scalars={"step": 1}, pad_fill=lambda o, n: b"\xff" * n)
    )
    (d / "b2.bpk").write_bytes(encode_burnpack(_tensors(1.5 + 1e-7), scalars={"step": 2}))
    dmlib.write_safetensors(d / "c.safetensors", _tensors(1.0))
    write_records(d / "multi.bpk", [encode_burnpack(_tensors(1.0)), encode_burnpack(_tensors(2.0))])
    logprobs = np.log(np.array([[0.5, 0.25, 0.125], [0.75, 0.5, 1.0]], np.float32))
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.int8)
    dmlib.write_safetensors(d / "lp_a.safetensors", {"logprobs": logprobs, "mask": mask})
    dmlib.write_safetensors(d / "lp_b.safetensors", {"logprobs": logprobs * 1.01, "mask": mask})
    for p in d.iterdir():
        os.utime(p, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))  # a fixed, old mtime
    return d


def _study(d: Path, *runs: str) -> str:
    """A study file beside the inputs (not among them) naming some of them as runs."""
    study = d.parent / "nb_study.toml"
    study.write_text(
        "[runs]\n" + "".join(f"r{i} = {json.dumps(r)}\n" for i, r in enumerate(runs)),
        encoding="utf-8",
    )
    return str(study)


def _argvs(command: str, d: Path) -> list[list[str]]:
    a1, a2, b1, b2, c, m = (
        str(d / n) for n in ("a1.bpk", "a2.bpk", "b1.bpk", "b2.bpk", "c.safetensors", "multi.bpk")
    )
    la, lb = str(d / "lp_a.safetensors"), str(d / "lp_b.safetensors")
    table = {
        "inspect": [[a1], [c], [m], ["--json", b1]],
        "compare": [[a1, b1], [a1, c], ["--json", a2, b2]],
        "matrix": [[f"a={a1}", f"b={b1}", f"c={c}"]],
        "factors": [[a1, b1, "--group", "svd:{prefix}.u,{prefix}.s,{prefix}.v"]],
        "firstcol": [[f"a={a1}", f"b={b1}"]],
        "ladder": [[f"a:1={a1}", f"a:2={a2}", f"b:1={b1}", f"b:2={b2}"]],
        "gapcheck": [[f"a={a1}", f"b={b1}"], [m]],
        "repeats": [
            [f"a={a1},{a2},{a1}", f"b={b1},{b1}"],
            ["--json", f"c={c},{c}", "--observer", a1],
        ],
        "report": [
            [
                "--run",
                f"a={a1}",
                "--run",
                f"b={b1}",
                "--out",
                str(d.parent / "report"),
                "--only",
                "run_matrix",
            ]
        ],
        "map": [["suggest", c, c, "--out", str(d.parent / "map.toml")]],
        "logprobs": [[la, lb], ["--json", la, lb, "--control", la]],
        "logprob-ladder": [
            [f"r:1={la},{lb}", f"r:2={la},{la}", f"z:1={la},{la}", "--control", "z"]
        ],
        "notebooks": [[str(d.parent / "nbs"), "--study", _study(d, a1, c)]],
        "study": [
            ["init", "--run", f"a={a1}", "--run", f"b={c}", "--out", str(d.parent / "study.toml")]
        ],
    }
    if command not in table:
        pytest.fail(f"new subcommand {command!r}: add how to call it to _argvs in {__file__}")
    return table[command]


def _subcommands() -> list[str]:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return sorted(action.choices)
    return []


@pytest.mark.parametrize(
    "command", [c for c in _subcommands() if c not in ("localize", "arbitrate")]
)
def test_cli_never_touches_its_inputs(
    command: str, inputs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(inputs)
    for argv in _argvs(command, inputs):
        rc = main([command, *argv])
        _, err = capsys.readouterr()
        assert rc in (0, 1), f"{command} {argv}: exit {rc}: {err}"
    assert _snapshot(inputs) == before


@pytest.mark.skipif("localize" not in _subcommands(), reason="no localize subcommand")
def test_localize_never_touches_its_captures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    caps = tmp_path / "caps"
    for name, x in (("a", torch.ones(2, 3)), ("b", torch.ones(2, 3) * 1.001)):
        with torch.no_grad(), dmlib.capture(model, caps / name, dump="*"):
            model(x)
    before = _snapshot(caps)
    for argv in ([str(caps / "a"), str(caps / "b")], ["--json", str(caps / "a"), str(caps / "a")]):
        rc = main(["localize", *argv])
        _, err = capsys.readouterr()
        assert rc in (0, 1), err
    assert _snapshot(caps) == before
    assert not list(caps.rglob("*.part"))


@pytest.mark.skipif("arbitrate" not in _subcommands(), reason="no arbitrate subcommand")
def test_arbitrate_never_touches_its_captures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh())
    caps = tmp_path / "caps"
    for name, x in (("a", torch.ones(2, 3)), ("b", torch.ones(2, 3) * 1.001)):
        with torch.no_grad(), dmlib.capture(model, caps / name, ops=True, dump="*"):
            model(x)
    before = _snapshot(caps)
    op = "0/aten.addmm#0"
    for argv in (
        [str(caps / "a"), str(caps / "b"), "--op", op],
        ["--json", str(caps / "a"), str(caps / "a"), "--op", op],
    ):
        rc = main(["arbitrate", *argv])
        _, err = capsys.readouterr()
        assert rc in (0, 1), err
    assert _snapshot(caps) == before


def test_readers_open_inputs_read_only(inputs: Path) -> None:
    before = _snapshot(inputs)
    for p in sorted(inputs.iterdir()):
        with dmlib.open_tensors(p) as ts:
            for t in ts.values():
                arr = t.load()
                assert not arr.flags.writeable
                with pytest.raises(ValueError):
                    arr.reshape(-1)[:1] = 0
    dmlib.padding_census(inputs / "multi.bpk")
    assert _snapshot(inputs) == before


# ----------------------------------------------------------------------------- interrupted writers


class Boom(Exception):
    pass


def _only(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_write_burnpack_interrupted_by_pad_fill(tmp_path: Path) -> None:
    calls = []

    def pad_fill(offset: int, n: int) -> bytes:
        calls.append(offset)
        if len(calls) == 2:
            raise Boom("interrupted mid-write")
        return bytes(n)

    tensors = {f"t{i}": np.full(3, i, np.float32) for i in range(4)}  # 3 gaps between 4 tensors
    with pytest.raises(Boom):
        write_burnpack(tmp_path / "out.bpk", tensors, pad_fill=pad_fill)
    assert len(calls) == 2
    assert _only(tmp_path) == []


def test_interrupted_write_keeps_the_previous_file(tmp_path: Path) -> None:
    target = tmp_path / "out.bpk"
    write_burnpack(target, {"w": np.ones(3, np.float32)})
    old = target.read_bytes()

    class Exploding(dict):
        def items(self):  # the tensor source fails after the first tensor
            yield "a", np.zeros(2, np.float32)
            raise Boom("tensor source failed")

    with pytest.raises(Boom):
        write_burnpack(target, Exploding())
    with pytest.raises(Boom):
        dmlib.write_safetensors(target.with_suffix(".safetensors"), Exploding())
    assert target.read_bytes() == old
    assert _only(tmp_path) == ["out.bpk"]


def test_failed_rename_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_atomic.os, "replace", failing_replace)
    with pytest.raises(OSError, match="No space"):
        write_burnpack(tmp_path / "a.bpk", {"w": np.ones(2, np.float32)})
    with pytest.raises(OSError, match="No space"):
        dmlib.write_safetensors(tmp_path / "a.safetensors", {"w": np.ones(2, np.float32)})
    with pytest.raises(OSError, match="No space"):
        write_records(tmp_path / "m.bpk", [encode_burnpack({"w": np.ones(2, np.float32)})] * 2)
    assert _only(tmp_path) == []


def test_atomic_write_interrupted_halfway(tmp_path: Path) -> None:
    target = tmp_path / "x.bin"
    for exc in (Boom("stop"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with _atomic.atomic_write(target) as f:
                f.write(b"half of the bytes")
                # the temporary file exists beside the target while writing, under another name
                assert [p for p in _only(tmp_path) if p != "x.bin"] and not target.exists()
                raise exc
        assert _only(tmp_path) == []


def test_rewriting_an_open_file_leaves_loaded_arrays_intact(tmp_path: Path) -> None:
    """The rename replaces the directory entry; an open memory map keeps the old bytes."""
    p = tmp_path / "m.bpk"
    write_burnpack(p, {"w": np.arange(4, dtype=np.float32)})
    with dmlib.open_tensors(p) as ts:
        arr = ts["w"].load()
        write_burnpack(p, {"w": np.full(4, 9.0, np.float32)})
        assert arr.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert dmlib.load(p)["w"].tolist() == [9.0] * 4


def test_interrupted_capture_is_marked_and_leaves_no_temporary_files(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))

    def boom(mod, args, output):
        raise Boom("forward pass interrupted")

    model[1].register_forward_hook(boom)
    path = tmp_path / "cap"
    with pytest.raises(Boom), torch.no_grad(), dmlib.capture(model, path, dump="*"):
        model(torch.ones(1, 3))
    assert not list(path.rglob("*.part"))
    with pytest.raises(dmlib.CaptureError):
        dmlib.open_capture(path)
