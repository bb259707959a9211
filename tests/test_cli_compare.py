"""``dmlib compare`` and ``dmlib matrix`` in-process: output, JSON keys, exit codes."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dmlib
from dmlib.cli import main


@pytest.fixture
def files(tmp_path):
    w = np.linspace(1, 2, 40, dtype=np.float32)
    base = {"w": w, "i": np.arange(3, dtype=np.int32)}
    moved = {"w": w.copy(), "i": base["i"].copy()}
    moved["w"].view(np.uint32)[7] += 3
    paths = {}
    for label, tensors, meta in [("a", base, "1"), ("b", moved, "2"), ("c", base, "3")]:
        paths[label] = tmp_path / f"{label}.safetensors"
        dmlib.write_safetensors(paths[label], tensors, metadata={"run": meta})
    paths["extra"] = tmp_path / "extra.safetensors"
    dmlib.write_safetensors(paths["extra"], {**base, "z": np.zeros(2, np.float32)})
    return {k: str(v) for k, v in paths.items()}


def test_compare_differs(files, capsys):
    assert main(["compare", files["a"], files["b"]]) == 1
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["name", "dtype", "numel", "n_diff"]
    assert lines[1].split()[:4] == ["w", "float32", "40", "1"]
    assert not any(line.startswith("i ") for line in lines)  # identical rows only with --all
    assert (
        "DIFFERENT: 1 of 2 compared tensors differ; not compared: none;" in out
        and "max_ulp 3" in out
    )


def test_compare_identical_data_different_files(files, capsys):
    assert main(["compare", files["a"], files["c"], "--all"]) == 0
    out = capsys.readouterr().out
    assert "IDENTICAL" in out and "metadata_diff: run" in out
    assert any(line.startswith("i ") for line in out.splitlines())


def test_compare_json(files, capsys):
    assert main(["compare", files["a"], files["b"], "--json", "--include", "w"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["identical"] is False
    (row,) = doc["rows"]
    assert (row["name"], row["n_diff"], row["max_ulp"], row["ulp_3_4"], row["first_diff"]) == (
        "w",
        1,
        3,
        1,
        [7],
    )
    assert doc["attrs"]["metadata_diff"] == {"run": ["1", "2"]}
    assert doc["attrs"]["include"] == ["w"]


def test_compare_names_mismatch_is_a_difference(files, capsys):
    assert main(["compare", files["a"], files["extra"]]) == 1
    assert "only_in_b: z" in capsys.readouterr().out


def test_compare_bad_input(files, tmp_path, capsys):
    assert main(["compare", files["a"], str(tmp_path / "nope.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "nope.safetensors" in err and "Traceback" not in err


def test_matrix_cli(files, capsys):
    assert (
        main(["matrix", f"a={files['a']}", f"b={files['b']}", f"c={files['c']}", "--control", "b"])
        == 1
    )
    out = capsys.readouterr().out
    assert "bit-identical pairs: a/c" in out
    assert "separation inf orders of magnitude" in out  # same-seed pair a/c is exact
    assert main(["matrix", f"a={files['a']}", f"c={files['c']}", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"]["identical_pairs"] == ["a/c"]
    assert {r["a"] for r in doc["rows"]} == {"a"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["matrix", "nolabel", "b=y"], "LABEL=PATH"), (["matrix", "a=x", "a=y"], "twice")],
)
def test_matrix_bad_labels(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_hash_choice_is_named_in_every_hash(files, capsys):
    import hashlib

    import blake3

    raw = {
        "w": np.linspace(1, 2, 40, dtype=np.float32).tobytes(),
        "i": np.arange(3, dtype=np.int32).tobytes(),
    }
    assert main(["compare", "--json", "--hash", "sha256", files["a"], files["c"]]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["attrs"]["hash"] == "sha256"
    for r in doc["rows"]:
        assert (
            r["data_hash_a"]
            == r["data_hash_b"]
            == "sha256:" + hashlib.sha256(raw[r["name"]]).hexdigest()
        )
    assert main(["compare", "--json", files["a"], files["c"]]) == 0
    doc = json.loads(capsys.readouterr().out)
    for r in doc["rows"]:
        assert r["data_hash_a"] == "blake3-64MiB:" + blake3.blake3(raw[r["name"]]).hexdigest()
    assert main(["matrix", "--json", "--hash", "sha256", f"a={files['a']}", f"c={files['c']}"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(r["data_hash_a"].startswith("sha256:") for r in doc["rows"])


def test_hashes_only_where_the_output_shows_them(files, capsys):
    import hashlib

    moved = np.linspace(1, 2, 40, dtype=np.float32)
    moved.view(np.uint32)[7] += 3
    # text output: no hash column, none computed (the JSON of the same call has none either)
    assert main(["compare", files["a"], files["b"]]) == 1
    assert "blake3" not in capsys.readouterr().out
    assert main(["compare", "--json", "--hash", "none", files["a"], files["b"]]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["attrs"]["hash"] is None
    assert all(r["data_hash_a"] is None and r["data_hash_b"] is None for r in doc["rows"])
    # asked for in text mode: the table shows both sides' hashes (hashlib as the oracle)
    assert main(["compare", "--hash", "sha256", files["a"], files["b"]]) == 1
    out = capsys.readouterr().out
    w_line = next(line for line in out.splitlines() if line.startswith("w "))
    assert w_line.split()[-2:] == [
        "sha256:" + hashlib.sha256(np.linspace(1, 2, 40, dtype=np.float32).tobytes()).hexdigest(),
        "sha256:" + hashlib.sha256(moved.tobytes()).hexdigest(),
    ]
    # the matrix's text output hashes nothing either, and still finds the identical pair
    assert main(["matrix", f"a={files['a']}", f"b={files['b']}", f"c={files['c']}"]) == 1
    out = capsys.readouterr().out
    assert "bit-identical pairs: a/c" in out and "blake3" not in out
    assert main(["matrix", "--json", f"a={files['a']}", f"c={files['c']}"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(r["data_hash_a"].startswith("blake3-64MiB:") for r in doc["rows"])
    # whole-file hashes without a scheme: bad input, one line, exit 2
    assert main(["compare", "--file-hashes", "--hash", "none", files["a"], files["b"]]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "need a hash scheme" in err
