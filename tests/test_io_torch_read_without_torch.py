"""torch.save files read without importing torch give what torch.load gives.

Oracles: ``torch.load(weights_only=True)`` (tensor values, bytes) and dmlib's torch.load
path, the reader of every file before this one (names, scalars, metadata: the same for
every file it reads), forced by making the new reader hand the file over to torch. A
fresh interpreter proves that reading a zip or legacy file imports no torch.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import dmlib
from dmlib.cli import main
from dmlib.errors import NotTensorsError
from dmlib.io import _unpickle, torch_zip

torch = pytest.importorskip("torch")

WITHOUT_TORCH = "dmlib (torch not imported)"


def _bits(t) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _via_torch_load(monkeypatch: pytest.MonkeyPatch, path: Path) -> dmlib.TensorSet:
    """The file read the way dmlib read every torch file before: through torch.load."""

    def hand_over(*args, **kwargs):
        raise _unpickle.NeedsTorch("the test's request")

    with monkeypatch.context() as m:
        m.setattr(torch_zip, "read_zip", hand_over)
        m.setattr(torch_zip, "read_legacy", hand_over)
        return dmlib.open_tensors(path)


def _same_as_torch_load_path(monkeypatch: pytest.MonkeyPatch, path: Path) -> dmlib.TensorSet:
    ours = dmlib.open_tensors(path)
    assert ours.layout["reader"] == WITHOUT_TORCH
    ref = _via_torch_load(monkeypatch, path)
    assert ref.layout["reader"].startswith("torch.load")
    assert list(ours) == list(ref)  # names, in order
    assert ours.scalars == ref.scalars and list(ours.scalars) == list(ref.scalars)
    assert ours.metadata == ref.metadata
    for name in ref:
        a, b = ours[name], ref[name]
        got = (a.dtype, a.shape, a.dtype_name, a.packing, a.opaque, a.nbytes)
        assert got == (b.dtype, b.shape, b.dtype_name, b.packing, b.opaque, b.nbytes), name
        assert a.raw().tobytes() == b.raw().tobytes(), name
    return ours


def _every_dtype() -> dict:
    x = torch.linspace(-3, 3, 12).reshape(3, 4)
    out = {str(d).removeprefix("torch."): x.to(d) for d in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
        torch.int16, torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32,
        torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    )}  # fmt: skip
    out["uint16"] = torch.arange(12, dtype=torch.int32).to(torch.uint16).reshape(3, 4)
    out["float8_e8m0fnu"] = x.abs().clamp_min(1e-3).to(torch.float8_e8m0fnu)
    out["complex64"] = torch.complex(x, -x)
    out["complex128"] = torch.complex(x, x).to(torch.complex128)
    # complex32: tests/test_io_torch_more.py (torch warns once a process on creating one)
    raw = torch.tensor([[0x21, 0xF7], [0x09, 0x3C]], dtype=torch.uint8)
    out["float4_e2m1fn_x2"] = raw.view(torch.float4_e2m1fn_x2)
    out["bits8"] = raw.view(torch.bits8)
    out["bits16"] = torch.arange(6, dtype=torch.int16).view(torch.bits16)
    out["empty"] = torch.zeros(0, 3)
    out["scalar"] = torch.tensor(2.5)
    return out


def test_every_dtype_as_torch_load_reads_it(tmp_path, monkeypatch):
    sd = _every_dtype()
    torch.save(sd, tmp_path / "d.pt")
    ours = _same_as_torch_load_path(monkeypatch, tmp_path / "d.pt")
    oracle = torch.load(tmp_path / "d.pt", weights_only=True)
    for k, v in oracle.items():
        assert ours[k].raw().tobytes() == _bits(v), k
    assert ours["bfloat16"].dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(
        ours["bfloat16"].load().astype(np.float32), oracle["bfloat16"].float().numpy()
    )
    np.testing.assert_array_equal(ours["complex64"].load(), oracle["complex64"].numpy())


def test_legacy_format_as_torch_load_reads_it(tmp_path, monkeypatch):
    sd = {k: v for k, v in _every_dtype().items() if k in torch_zip.STORAGE_CLASSES.values()}
    base = torch.arange(20.0).reshape(4, 5)
    sd.update(view=base[1:, ::2], t=base.t(), base=base)
    torch.save(sd, tmp_path / "old.pt", _use_new_zipfile_serialization=False)
    ours = _same_as_torch_load_path(monkeypatch, tmp_path / "old.pt")
    for k, v in torch.load(tmp_path / "old.pt", weights_only=True).items():
        assert ours[k].raw().tobytes() == _bits(v), k


def test_views_strides_offsets_and_shared_storages(tmp_path, monkeypatch):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sd = {
        "base": base, "again": base, "t": base.t(), "block": base[1:, 2:5], "every_other": base[:, ::2],
        "row": base[2], "element": base[1, 1], "none": base[:0], "broadcast": torch.ones(3, 1).expand(3, 4),
        "tail": base.view(-1)[7:],
    }  # fmt: skip
    torch.save(sd, tmp_path / "v.pt")
    ours = _same_as_torch_load_path(monkeypatch, tmp_path / "v.pt")
    for k, v in torch.load(tmp_path / "v.pt", weights_only=True).items():
        np.testing.assert_array_equal(ours[k].load(), v.numpy(), err_msg=k)


def test_nested_containers_and_plain_values(tmp_path, monkeypatch):
    t = torch.arange(3.0)
    obj = {
        "a": [t, {"b": (t * 2, 3, "x", None, 2.5, True)}],
        "c": OrderedDict([("w", t + 1), ("n", 7)]),
        "size": torch.Size([2, 3]),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "z": 1 + 2j,
        "raw": b"by",
        "ids": {0: t[:1], 5: t[1:]},
        "empty": {},
        "param": torch.nn.Parameter(torch.ones(2)),
    }
    torch.save(obj, tmp_path / "n.pt")
    ours = _same_as_torch_load_path(monkeypatch, tmp_path / "n.pt")
    assert ours.scalars == {"a.1.b.1": 3, "a.1.b.2": "x", "a.1.b.3": None, "a.1.b.4": 2.5,
                            "a.1.b.5": True, "c.n": 7, "size.0": 2, "size.1": 3}  # fmt: skip
    assert set(ours) == {"a.0", "a.1.b.0", "c.w", "ids.0", "ids.5", "param"}


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(2):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def test_real_optimizer_and_scheduler_state(tmp_path, monkeypatch):
    model, opt, sched = _trained()
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    torch.save(sched.state_dict(), tmp_path / "scheduler.pt")
    torch.save(
        {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 2}, tmp_path / "c.pt"
    )
    ours = _same_as_torch_load_path(monkeypatch, tmp_path / "optimizer.pt")
    oracle = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    for i, st in oracle["state"].items():
        for k, v in st.items():
            assert ours[f"state.{i}.{k}"].raw().tobytes() == _bits(v)
    assert ours.scalars["param_groups.0.lr"] == oracle["param_groups"][0]["lr"]
    sch = _same_as_torch_load_path(monkeypatch, tmp_path / "scheduler.pt")
    assert sch.scalars["last_epoch"] == sched.state_dict()["last_epoch"] == 2
    both = _same_as_torch_load_path(monkeypatch, tmp_path / "c.pt")
    # named after the parameters, in model.parameters() order (the oracle: the model itself)
    names = [n for n, _ in model.named_parameters()]
    for i, n in enumerate(names):
        want = _bits(opt.state_dict()["state"][i]["exp_avg"])
        assert both[f"optimizer.state.{n}.exp_avg"].raw().tobytes() == want
    assert "state named after parameters" in both.metadata["optimizer_state_names"]


def test_rng_state_as_the_trainer_writes_it(tmp_path):
    """transformers' Trainer._save_rng_state: python, numpy and cpu generator states."""
    random.seed(3)
    np.random.seed(3)  # noqa: NPY002  (the global generator the Trainer saves)
    torch.manual_seed(3)
    random.random(), np.random.rand(7)  # noqa: NPY002  positions that are not the start
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),  # noqa: NPY002
        "cpu": torch.random.get_rng_state(),
    }
    torch.save(state, tmp_path / "rng_state.pth")
    safe = [np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    safe.append(getattr(np, "_core", np).multiarray._reconstruct)
    with torch.serialization.safe_globals(safe):
        oracle = torch.load(tmp_path / "rng_state.pth", weights_only=True)
    ts = dmlib.open_tensors(tmp_path / "rng_state.pth")
    assert ts.layout["reader"] == WITHOUT_TORCH
    assert sorted(ts) == ["cpu", "numpy.1"]
    assert ts["cpu"].raw().tobytes() == _bits(oracle["cpu"])
    keys = ts["numpy.1"].load()
    assert keys.dtype == np.uint32 and keys.shape == (624,)
    np.testing.assert_array_equal(keys, oracle["numpy"][1])
    kind, _, pos, has_gauss, cached = oracle["numpy"]
    assert (ts.scalars["numpy.0"], ts.scalars["numpy.2"]) == (kind, pos) == ("MT19937", pos)
    assert (ts.scalars["numpy.3"], ts.scalars["numpy.4"]) == (has_gauss, cached)
    version, internal, gauss = oracle["python"]
    assert ts.scalars["python.0"] == version and ts.scalars["python.2"] == gauss
    assert [ts.scalars[f"python.1.{i}"] for i in range(len(internal))] == list(internal)


@pytest.mark.slow
def test_training_args_named_for_what_they_are(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[])
    torch.save(args, tmp_path / "training_args.bin")
    with pytest.raises(NotTensorsError) as info:
        dmlib.open_tensors(tmp_path / "training_args.bin")
    msg = str(info.value)
    assert (
        "a pickled object of class transformers.training_args.TrainingArguments, no tensors" in msg
    )
    assert "add_safe_globals" not in msg and "\n" not in msg
    # inspect says what the file is (exit 0) without unpickling it; comparing it is refused
    assert main(["inspect", str(tmp_path / "training_args.bin")]) == 0
    out = capsys.readouterr().out
    assert "training arguments" in out and "not unpickled" in out
    b = tmp_path / "training_args_2.bin"
    b.write_bytes((tmp_path / "training_args.bin").read_bytes())
    assert main(["compare", str(tmp_path / "training_args.bin"), str(b)]) == 2


def test_zip_and_legacy_files_read_in_a_fresh_interpreter_without_torch(tmp_path):
    model, opt, _ = _trained(1)
    torch.save(opt.state_dict(), tmp_path / "optimizer.pt")
    torch.save(model.state_dict(), tmp_path / "legacy.bin", _use_new_zipfile_serialization=False)
    rng = {"numpy": np.random.get_state(), "python": random.getstate()}  # noqa: NPY002
    torch.save(rng, tmp_path / "rng.pth")
    want = {
        "optimizer.pt": {f"state.{i}.{k}": _bits(v) for i, s in opt.state_dict()["state"].items()
                         for k, v in s.items()},
        "legacy.bin": {k: _bits(v) for k, v in model.state_dict().items()},
    }  # fmt: skip
    code = (
        "import sys, json, dmlib\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    with dmlib.open_tensors(name) as ts:\n"
        "        out[name] = {k: t.raw().tobytes().hex() for k, t in ts.items()}\n"
        "print(json.dumps({'files': out, 'torch': 'torch' in sys.modules}))\n"
    )
    names = [str(tmp_path / n) for n in ("optimizer.pt", "legacy.bin", "rng.pth")]
    proc = subprocess.run(
        [sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["torch"] is False
    for short, tensors in want.items():
        got = doc["files"][str(tmp_path / short)]
        assert got == {k: v.hex() for k, v in tensors.items()}, short
    assert "numpy.1" in doc["files"][names[2]]


def test_inspect_says_which_path_read_the_file(tmp_path, capsys):
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    torch.save({"q": q}, tmp_path / "quant.pt")
    assert main(["inspect", str(tmp_path / "plain.pt")]) == 0
    assert f"reader={WITHOUT_TORCH}" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "quant.pt")]) == 0
    out = capsys.readouterr().out
    assert (
        "reader=torch.load(weights_only=True) (the file holds torch._utils._rebuild_qtensor)" in out
    )
