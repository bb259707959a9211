"""A user's own runs: a tiny transformer classifier trained a few AdamW steps, saved as
``.safetensors`` (``metadata={"step": ...}``) and as ``torch.save({"step", "model",
"optimizer"})``. Names under ``model.``, steps 3/5/7, a pooled head, no factorised layers.

Oracles: numpy on the saved arrays' bytes; safetensors files are written here from the
format's specification, not by dmlib.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import _support.tinynet as tn  # noqa: E402

import dmlib  # noqa: E402
from dmlib.cli import main  # noqa: E402

STEPS = [3, 5, 7]
ST_DTYPES = {np.dtype("float32"): "F32", np.dtype(ml_dtypes.bfloat16): "BF16"}


def write_safetensors(path, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """8-byte little-endian header length, JSON header, then the tensors' bytes."""
    header: dict = {"__metadata__": metadata}
    off, blobs = 0, []
    for name, a in arrays.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {
            "dtype": ST_DTYPES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [off, off + len(b)],
        }
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def np_of(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    trained = {"base": tn.train(0, 7, STEPS), "nudged": tn.train(0, 7, STEPS, nudge_at=5)}
    arrays = {}
    for run, ckpts in trained.items():
        (root / run).mkdir()
        for step, (sd, opt) in ckpts.items():
            arrays[(run, step)] = {k: np_of(v) for k, v in sd.items()}
            write_safetensors(
                root / run / f"s{step}.safetensors", arrays[(run, step)], {"step": str(step)}
            )
            torch.save({"step": step, "model": sd, "optimizer": opt}, root / run / f"s{step}.pt")
    shutil.copytree(root / "base", root / "copy")  # bit-identical to base by construction
    for step in STEPS:
        arrays[("copy", step)] = arrays[("base", step)]
    return root, arrays, trained


def _hashes(*paths):
    return [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]


def _one_error_line(capsys) -> str:
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in cap.err, cap.err
    return lines[0]


# -- part 2: no verdict over nothing ---------------------------------------------------


def test_pt_vs_safetensors_share_no_name_then_rename_makes_them_identical(runs, capsys):
    root, arrays, _ = runs
    pt, st = root / "base" / "s7.pt", root / "base" / "s7.safetensors"
    before = _hashes(pt, st)
    assert main(["compare", str(pt), str(st)]) == 2
    line = _one_error_line(capsys)
    assert "share no tensor name" in line and "--rename a:model.=" in line
    rc = main(
        ["compare", str(pt), str(st), "--rename", "a:model.=", "--exclude", "optimizer.", "--json"]
    )
    doc = json.loads(capsys.readouterr().out)
    # oracle: the model tensors torch saved and the arrays written to the safetensors file
    _, _, trained = runs
    sd = trained["base"][7][0]
    same = all(
        np.array_equal(np_of(sd[k]).view(np.uint8), arrays[("base", 7)][k].view(np.uint8))
        for k in sd
    )
    assert same and rc == 0 and doc["summary"]["identical"] is True
    assert sorted(r["name"] for r in doc["rows"]) == sorted(sd)
    assert _hashes(pt, st) == before


def test_rename_in_the_api_and_bad_specs(runs, capsys):
    root, _, _ = runs
    pt, st = root / "base" / "s3.pt", root / "base" / "s3.safetensors"
    df = dmlib.compare(pt, st, rename="a:model.=", exclude="optimizer.")
    assert dmlib.summarize(df)["identical"] and df.attrs["rename"] == ["a:model.="]
    df = dmlib.compare(st, pt, rename=[("b", "model.", "")], include="blocks.1")
    assert set(df["name"]) == {n for n in arrays_names(root) if "blocks.1" in n}
    with pytest.raises(dmlib.DmlibError, match="invalid name mapping"):
        dmlib.compare(pt, st, rename="c:model.=")
    assert main(["compare", str(pt), str(st), "--rename", "model."]) == 2
    assert "invalid name mapping 'model.'" in _one_error_line(capsys)


def arrays_names(root) -> list[str]:
    return list(dmlib.open_tensors(root / "base" / "s3.safetensors"))


def test_include_typo_is_bad_input_naming_close_names(runs, capsys):
    root, _, _ = runs
    a, b = root / "base" / "s7.safetensors", root / "copy" / "s7.safetensors"
    before = _hashes(a, b)
    assert main(["compare", str(a), str(b), "--include", "blocks.*.atn.*"]) == 2
    line = _one_error_line(capsys)
    assert "'blocks.*.atn.*' matches no tensor name" in line and "closest names: blocks." in line
    assert _hashes(a, b) == before
    # a pattern without glob characters is a substring of the name
    assert main(["compare", str(a), str(b), "--include", "qkv", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    names = arrays_names(root)
    assert sorted(r["name"] for r in doc["rows"]) == sorted(n for n in names if "qkv" in n)


def test_different_width_models_say_what_was_not_compared(tmp_path, capsys):
    narrow = {k: np_of(v) for k, v in tn.model(0, d=12).state_dict().items()}
    wide = {k: np_of(v) for k, v in tn.model(0, d=16).state_dict().items()}
    write_safetensors(tmp_path / "n.safetensors", narrow, {})
    write_safetensors(tmp_path / "w.safetensors", wide, {})
    same_shape = [k for k in narrow if narrow[k].shape == wide[k].shape]
    other = len(narrow) - len(same_shape)
    differ = [
        k
        for k in same_shape
        if not np.array_equal(narrow[k].view(np.uint8), wide[k].view(np.uint8))
    ]
    assert main(["compare", str(tmp_path / "n.safetensors"), str(tmp_path / "w.safetensors")]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert other > 0 and last.startswith(
        f"{'DIFFERENT' if differ else 'NOT ALL COMPARED'}: {len(differ)} of {len(same_shape)} "
        f"compared tensors differ; not compared: {other} with different dtype or shape;"
    )


def test_cross_dtype_rounds_the_wider_side(tmp_path, capsys):
    f32 = {k: np_of(v) for k, v in tn.model(3).state_dict().items()}
    bf16 = {k: np_of(torch.from_numpy(v).to(torch.bfloat16)) for k, v in f32.items()}
    name = "blocks.0.qkv_w"
    nudged = dict(bf16)
    w = bf16[name].copy()
    bits = w.view(np.uint16)
    bits[1, 2] += 1  # one bf16 ULP (the value is finite and not the largest)
    nudged[name] = w
    for n, arrs in (("f32", f32), ("bf16", bf16), ("nudged", nudged)):
        write_safetensors(tmp_path / f"{n}.safetensors", arrs, {})
    a, b, c = (str(tmp_path / f"{n}.safetensors") for n in ("f32", "bf16", "nudged"))
    assert main(["compare", a, b]) == 1
    out = capsys.readouterr().out
    assert (
        "NOT ALL COMPARED" in out and f"mismatched: {name} float32[" in out and "bfloat16[" in out
    )
    assert main(["compare", a, b, "--cross-dtype"]) == 0
    out = capsys.readouterr().out.splitlines()[-1]
    assert (
        out.startswith("IDENTICAL AFTER ROUNDING")
        and "float32 -> bfloat16, round to nearest, ties to even" in out
    )
    assert main(["compare", a, c, "--cross-dtype", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    row = next(r for r in doc["rows"] if r["name"] == name)
    # oracle: ml_dtypes rounding of the f32 bytes, then bit patterns compared in bf16
    ra = f32[name].astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.int64)
    rb = nudged[name].view(np.uint16).astype(np.int64)
    assert row["dtype"] == "bfloat16" and row["n_diff"] == int((ra != rb).sum()) == 1
    assert row["max_ulp"] == int(np.abs(ra - rb).max()) == 1
    assert doc["attrs"]["rounded"][0] == {
        "name": "tok.weight", "rounded": "a", "from": "float32", "to": "bfloat16",
        "rounding": "round to nearest, ties to even",
    }  # fmt: skip


# -- part 3: plain values and optimizer names -------------------------------------------


def test_torch_reader_keeps_scalars_and_names_optimizer_state(runs):
    root, _, trained = runs
    sd, opt = trained["base"][5]
    ts = dmlib.open_tensors(root / "base" / "s5.pt")
    assert ts.scalars["step"] == 5
    group = opt["param_groups"][0]
    assert ts.scalars["optimizer.param_groups.0.lr"] == group["lr"]
    assert ts.scalars["optimizer.param_groups.0.betas.1"] == group["betas"][1]
    assert ts.scalars["optimizer.param_groups.0.amsgrad"] is group["amsgrad"]
    names = [k for k in sd]  # the model's parameters, in model.parameters() order (no buffers)
    for i, n in zip(group["params"], names, strict=True):
        got = ts[f"optimizer.state.{n}.exp_avg"].load()
        assert np.array_equal(got.view(np.uint8), np_of(opt["state"][i]["exp_avg"]).view(np.uint8))
    assert "named after parameters" in ts.metadata["optimizer_state_names"]


def test_optimizer_alone_keeps_ids_and_says_so(tmp_path):
    m = tn.model(0, planted=False)
    for params, named in ((m.parameters(), False), (m.named_parameters(), True)):
        opt = torch.optim.AdamW(params)
        ids, seg, _ = tn.batch([[("a", [1, 2, 3])]], 4)
        m(ids, seg).sum().backward()
        opt.step()
        torch.save(opt.state_dict(), tmp_path / "o.pt")
        ts = dmlib.open_tensors(tmp_path / "o.pt")
        if named:
            assert "state.tok.weight.exp_avg" in ts
            assert "(param_names)" in ts.metadata["optimizer_state_names"]
        else:
            assert "state.0.exp_avg" in ts
            assert "keeps numeric parameter ids" in ts.metadata["optimizer_state_names"]


@pytest.mark.parametrize(
    "obj",
    [{"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, {0: torch.ones(1), "0": torch.zeros(1)}],
    ids=["dotted-key", "int-and-str-key"],
)
def test_colliding_flattened_names_are_refused(tmp_path, capsys, obj):
    p = tmp_path / "c.pt"
    torch.save(obj, p)
    before = _hashes(p)
    with pytest.raises(dmlib.DmlibError, match="both flatten to the name"):
        dmlib.open_tensors(p)
    assert main(["inspect", str(p)]) == 2
    assert "both flatten to the name" in _one_error_line(capsys)
    assert _hashes(p) == before


# -- parts 3 and 4: the ladder reads the step, and prints one line per pair ------------


def _oracle_pair(arrays, a: str, b: str):
    """First differing step, top mover at the last step and the overall growth, with numpy."""
    first, rel_all = None, {}
    for step in STEPS:
        xa, xb = arrays[(a, step)], arrays[(b, step)]
        if first is None and any(
            not np.array_equal(xa[k].view(np.uint8), xb[k].view(np.uint8)) for k in xa
        ):
            first = step
        d2 = sum(
            float(np.sum((xa[k].astype(np.float64) - xb[k].astype(np.float64)) ** 2)) for k in xa
        )
        n2 = sum(float(np.sum(xa[k].astype(np.float64) ** 2)) for k in xa)
        rel_all[step] = np.sqrt(d2) / np.sqrt(n2)
    last = {k: np.linalg.norm((arrays[(a, 7)][k].astype(np.float64) - arrays[(b, 7)][k]).ravel())
            / np.linalg.norm(arrays[(a, 7)][k].astype(np.float64).ravel()) for k in arrays[(a, 7)]}  # fmt: skip
    pts = [(s, np.log10(r)) for s, r in rel_all.items() if r > 0]
    slope = (
        float(np.polyfit([s for s, _ in pts], [y for _, y in pts], 1)[0]) if len(pts) >= 2 else None
    )
    return first, max(last, key=last.get), slope


def test_ladder_one_line_per_pair(runs, capsys):
    root, arrays, _ = runs
    items = [
        f"{r}:{s}={root / r / f's{s}.safetensors'}"
        for r in ("base", "copy", "nudged")
        for s in STEPS
    ]
    assert main(["ladder", *items, "--reference", "base", "--top", "1"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "checkpoints: 9; 9 ok (recorded step against claimed)"
    assert lines[1] == "base/copy: bit-identical at every step (3, 5, 7)"
    first, mover, slope = _oracle_pair(arrays, "base", "nudged")
    assert first is not None and first <= 5  # the planted nudge is at step 5
    assert lines[2].startswith(f"base/nudged: first diverges at step {first}")
    assert f"fastest movers at step 7 (rel_fro): {mover} " in lines[2]
    assert len(lines) == 3
    assert main(["ladder", *items, "--reference", "base", "--json"]) == 1
    pair = next(
        p for p in json.loads(capsys.readouterr().out)["pairs"] if p["pair"] == "base/nudged"
    )
    if slope is None:
        assert pair["slope"] is None
    else:
        assert pair["slope"] == pytest.approx(slope, rel=1e-9, abs=1e-12)
    assert main(["ladder", *items, "--reference", "base", "--details"]) == 1
    assert "growth" not in capsys.readouterr().out.splitlines()[0]


def test_ladder_reads_the_step_of_torch_checkpoints(runs, capsys):
    root, _, _ = runs
    items = [f"{r}:{s}={root / r / f's{s}.pt'}" for r in ("base", "copy") for s in STEPS]
    assert main(["ladder", *items]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "checkpoints: 6; 6 ok (recorded step against claimed)"
    assert out[1] == "base/copy: bit-identical at every step (3, 5, 7)"
    # a step-3 file claimed as step 5 is an artifact, read from the torch file's own 'step'
    wrong = [i.replace("copy/s5.pt", "copy/s3.pt") for i in items]
    assert main(["ladder", *wrong]) == 1
    out = capsys.readouterr().out
    assert "  artifact: run copy step 5: recorded step 3, claimed 5" in out


def test_one_dtype_spelling(runs, capsys):
    root, _, _ = runs
    assert main(["inspect", str(root / "base" / "s3.safetensors")]) == 0
    out = capsys.readouterr().out
    row = next(x for x in out.splitlines() if x.startswith("tok.weight "))
    assert row.split()[1] == "float32" and " F32 " not in out
    assert main(["inspect", str(root / "base" / "s3.safetensors"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    t = next(t for t in doc["tensors"] if t["name"] == "tok.weight")
    assert (t["dtype"], t["format_dtype"]) == ("float32", "F32")


def test_values_neither_tensor_nor_plain_are_named_not_dropped(tmp_path):
    p = tmp_path / "odd.pt"
    torch.save(
        {"w": torch.ones(2), "dtype": torch.bfloat16, "z": 1 + 2j, "step": 4, "tag": "run-a"}, p
    )
    ts = dmlib.open_tensors(p)
    assert list(ts) == ["w"] and ts.scalars == {"step": 4, "tag": "run-a"}
    assert ts.metadata["entries_not_read"] == "dtype (dtype), z (complex)"
