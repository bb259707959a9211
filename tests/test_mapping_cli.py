"""``dmlib map suggest`` and ``dmlib compare --map``: exit codes, messages, safe output."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dmlib.cli import main
from dmlib.mapping.spec import load_mapping

pytest.importorskip("torch")
pytest.importorskip("transformers")
import _support.mapmodels as tm  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = int(e.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("map")
    sd = tm.gpt2_state()
    conv = tm.gpt2_converted(sd)
    save_file(sd, str(d / "gpt2.safetensors"))
    save_file(conv, str(d / "converted.safetensors"))
    bad = dict(conv)
    v = bad["blocks.0.attn.v.weight"].copy()
    v[7, 4] = np.nextafter(v[7, 4], np.float32(np.inf))
    bad["blocks.0.attn.v.weight"] = v
    save_file(bad, str(d / "planted.safetensors"))
    (d / "hand.toml").write_text(tm.GPT2_MAP)
    return {"a": d / "gpt2.safetensors", "b": d / "converted.safetensors",
            "planted": d / "planted.safetensors", "map": d / "hand.toml", "dir": d}  # fmt: skip


def test_compare_with_a_map_exit_codes(files, capsys) -> None:
    a, b, m = str(files["a"]), str(files["b"]), str(files["map"])
    rc, out, err = _run(["compare", a, b, "--map", m], capsys)
    assert rc == 0, err
    from safetensors.numpy import load_file

    n = len(load_file(b))
    assert out.strip().splitlines()[-1].startswith(f"IDENTICAL: 0 of {n} compared tensors differ")
    rc, out, err = _run(["compare", a, str(files["planted"]), "--map", m], capsys)
    assert rc == 1, err
    # v = c_attn.weight[:, 2D:3D].T: v[7, 4] is c_attn.weight[4, 2D + 7]
    assert "blocks.0.attn.v.weight[7, 4]" in out
    assert f"transformer.h.0.attn.c_attn.weight[4, {2 * tm.D + 7}]" in out
    rc, out, err = _run(["compare", a, b, "--map", str(files["dir"] / "missing.toml")], capsys)
    assert rc == 2 and "missing.toml" in err and len(err.strip().splitlines()) == 1
    (files["dir"] / "short.toml").write_text(
        tm.GPT2_MAP.split('[[rule]]\nsource = "transformer.ln_f')[0]
    )
    rc, out, err = _run(["compare", a, b, "--map", str(files["dir"] / "short.toml")], capsys)
    assert rc == 2 and "transformer.ln_f.weight" in err and "final_norm.weight" not in out
    rc, out, err = _run(["compare", a, b, "--map", m, "--rename", "a:x.="], capsys)
    assert rc == 2 and "--rename" in err


def test_map_suggest_writes_safely(files, capsys) -> None:
    out_path = files["dir"] / "suggested.toml"
    argv = ["map", "suggest", str(files["a"]), str(files["b"]), "--out", str(out_path)]
    rc, out, err = _run(argv, capsys)
    # GPT-2's safetensors file holds the tied lm_head once: every tensor is placed
    assert rc == 0, err
    text = out_path.read_text()
    assert "# confidence: exact" in text and load_mapping(out_path).rules
    out_path.write_text("mine")
    rc, out, err = _run(argv, capsys)
    assert rc == 2 and "exists already" in err and str(out_path) in err
    assert out_path.read_text() == "mine"  # never overwritten without --force
    rc, out, err = _run([*argv, "--force"], capsys)
    assert rc == 0 and out_path.read_text() == text
    rc, _, err = _run(["compare", str(files["a"]), str(files["b"]), "--map", str(out_path)], capsys)
    assert rc == 0, err
    rc, _, err = _run(
        ["map", "suggest", str(files["a"]), str(files["b"]), "--out", str(files["a"]), "--force"],
        capsys,
    )
    assert rc == 2 and "input" in err and files["a"].stat().st_size > 1000


def test_map_suggest_exits_2_naming_what_it_could_not_place(files, capsys) -> None:
    extra = files["dir"] / "extra.safetensors"
    from safetensors.numpy import load_file

    conv = load_file(str(files["b"]))
    conv["stray.weight"] = np.arange(7, dtype=np.float32) + 1000.5  # no source holds it
    save_file(conv, str(extra))
    out_path = files["dir"] / "partial.toml"
    rc, out, err = _run(
        ["map", "suggest", str(files["a"]), str(extra), "--out", str(out_path)], capsys
    )
    assert rc == 2 and "B:stray.weight" in err and len(err.strip().splitlines()) == 1
    assert "#   B: stray.weight" in out_path.read_text()  # written, with what is missing


def test_readme_example_runs(tmp_path: Path, monkeypatch, capsys) -> None:
    import re

    readme = Path(__file__).resolve().parent.parent / "README.md"
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), flags=re.S)
    (code,) = [b for b in blocks if "mapping=proposed.mapping" in b]
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "[] []"
    # k = c_attn.weight[:, 16:32].T, so k[3, 5] is c_attn.weight[5, 16 + 3]
    assert lines[-1].split() == ["h.1.attn.k.weight", "1", "h.1.attn.k.weight[3,", "5]",
                                 "h.1.attn.c_attn.weight[5,", "19]"]  # fmt: skip
