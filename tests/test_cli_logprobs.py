"""``dmlib logprobs`` and ``dmlib logprob-ladder``: exit codes (0 same, 1 differs, 2 bad
input, 3 nothing counted, 5 not comparable), the printed verdict and the JSON, against
numbers worked out here with numpy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from dmlib.cli import main
from dmlib.cli._common import EXIT_NOT_COMPARABLE


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture()
def files(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(0)
    s, t = 3, 8
    lp = (-np.abs(rng.normal(2, 1, (s, t))) - 1e-3).astype(np.float32)
    tok = rng.integers(0, 500, (s, t))
    mask = np.arange(t)[None, :] < np.array([8, 5, 4])[:, None]  # 17 of 24 counted
    out = {}
    out["a"] = tmp_path / "a.safetensors"
    save_file({"logprobs": lp, "mask": mask, "tokens": tok}, out["a"])
    lp_b = lp.copy()
    lp_b[1, 2] = np.nextafter(lp_b[1, 2], np.float32(0))  # one token 1 ULP apart
    lp_b[~mask] = 0.0  # padding differs: must not count
    out["b"] = tmp_path / "b.safetensors"
    save_file({"logprobs": lp_b, "mask": mask, "tokens": tok}, out["b"])
    out["shifted"] = tmp_path / "shifted.safetensors"
    save_file({"logprobs": lp_b, "mask": mask, "tokens": np.roll(tok, 1, axis=1)}, out["shifted"])
    out["none"] = tmp_path / "none.safetensors"
    save_file({"logprobs": lp, "mask": np.zeros_like(mask)}, out["none"])
    out["weights"] = tmp_path / "weights.safetensors"
    save_file({"w": np.zeros((2, 2), np.float32), "b": np.zeros(2, np.float32)}, out["weights"])
    return out


def test_identical_differs_and_the_mask(files: dict[str, Path], capsys) -> None:
    rc, out, _ = run(["logprobs", str(files["a"]), str(files["a"])], capsys)
    assert rc == 0 and out.startswith("IDENTICAL: 0 of 17 tokens differ in 3 sequences")
    rc, out, _ = run(["logprobs", str(files["a"]), str(files["b"])], capsys)
    assert rc == 1 and out.startswith("DIFFERS: 1 of 17 tokens differ")
    assert "max_ulp 1" in out and "worst: sequence 1, position 2" in out


def test_json_figures_against_numpy(files: dict[str, Path], capsys) -> None:
    from safetensors.numpy import load_file

    rc, out, _ = run(["logprobs", str(files["a"]), str(files["b"]), "--json"], capsys)
    assert rc == 1
    doc = json.loads(out)
    a, b = load_file(files["a"]), load_file(files["b"])
    m = a["mask"]
    x, y = a["logprobs"][m].astype(np.float64), b["logprobs"][m].astype(np.float64)
    d = y - x
    v = doc["verdict"]
    assert v["status"] == "differs" and v["n_tokens"] == 17 and v["n_diff"] == 1
    assert v["figures"]["max_abs_dlogprob"] == np.abs(d).max()
    assert v["figures"]["mean_abs_dlogprob"] == pytest.approx(np.abs(d).mean(), rel=1e-12)
    assert v["figures"]["k3"] == pytest.approx(np.mean(np.exp(d) - 1 - d), rel=1e-6, abs=1e-25)
    assert [r["n_tokens"] for r in doc["sequences"]] == [8, 5, 4]


def test_not_comparable_has_its_own_exit_code(files: dict[str, Path], capsys) -> None:
    rc, out, _ = run(["logprobs", str(files["a"]), str(files["shifted"])], capsys)
    assert rc == EXIT_NOT_COMPARABLE == 5
    assert out.startswith("NOT COMPARABLE: tokens differ at sequence 0, position 0")
    assert "mean |dlogprob|" not in out  # no figure computed
    rc, out, _ = run(["logprobs", str(files["a"]), str(files["shifted"]), "--json"], capsys)
    doc = json.loads(out)
    assert rc == 5 and doc["verdict"]["status"] == "not comparable" and doc["sequences"] == []


def test_nothing_counted_is_inconclusive(files: dict[str, Path], capsys) -> None:
    rc, out, _ = run(["logprobs", str(files["none"]), str(files["none"])], capsys)
    assert rc == 3 and out.startswith("INCONCLUSIVE")


def test_control_beside(files: dict[str, Path], capsys) -> None:
    rc, out, _ = run(
        ["logprobs", str(files["a"]), str(files["b"]), "--control", str(files["a"])], capsys
    )
    assert rc == 1
    assert "the control pair shows no mismatch" in out
    assert out.splitlines()[
        [i for i, ln in enumerate(out.splitlines()) if ln.startswith("figure")][0]
    ].split() == ["figure", "pair", "control"]


def test_mask_option(files: dict[str, Path], tmp_path: Path, capsys) -> None:
    m = np.zeros((3, 8), bool)
    m[0, :3] = True
    save_file({"mask": m}, tmp_path / "m.safetensors")
    rc, out, _ = run(
        ["logprobs", str(files["a"]), str(files["b"]), "--mask", str(tmp_path / "m.safetensors")],
        capsys,
    )
    assert rc == 0 and "0 of 3 tokens" in out  # the differing token is masked out


def test_bad_input_is_exit_2_naming_the_file(files: dict[str, Path], capsys) -> None:
    rc, _, err = run(["logprobs", str(files["weights"]), str(files["a"])], capsys)
    assert rc == 2 and "no log-probs found" in err and "weights.safetensors" in err
    assert len(err.strip().splitlines()) == 1
    rc, _, err = run(["logprobs", str(files["a"]), str(files["a"]), "--top-k", "0"], capsys)
    assert rc == 2 and "--top-k" in err


def test_ladder(files: dict[str, Path], capsys) -> None:
    a, b, sh = (str(files[k]) for k in ("a", "b", "shifted"))
    rc, out, _ = run(
        [
            "logprob-ladder",
            f"policy:0={a},{a}",
            f"policy:5={a},{b}",
            f"lr0:0={a},{a}",
            f"lr0:5={a},{a}",
            "--control",
            "lr0",
        ],
        capsys,
    )
    assert rc == 1
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["run", "step", "status"]
    assert [ln.split()[:3] for ln in lines[1:]] == [
        ["policy", "0", "identical"],
        ["policy", "5", "differs"],
        ["lr0", "0", "identical"],
        ["lr0", "5", "identical"],
    ]
    rc, out, _ = run(["logprob-ladder", f"policy:0={a},{sh}", "--json"], capsys)
    assert rc == 5 and json.loads(out)["rows"][0]["status"] == "not comparable"
    rc, _, err = run(["logprob-ladder", f"policy:0={a}"], capsys)
    assert rc == 2 and "expected LABEL:STEP=A,B" in err


def test_per_sequence_table(files: dict[str, Path], capsys) -> None:
    rc, out, _ = run(["logprobs", str(files["a"]), str(files["b"]), "--per-sequence"], capsys)
    assert rc == 1
    (header,) = [ln for ln in out.splitlines() if ln.startswith("role")]
    rows = out.split(header)[1].strip().splitlines()
    assert [r.split()[:4] for r in rows] == [
        ["pair", "0", "8", "0"],
        ["pair", "1", "5", "1"],
        ["pair", "2", "4", "0"],
    ]


def test_metadata_from_the_files_reaches_the_terminal_escaped(tmp_path: Path, capsys) -> None:
    for name, value in (("a", "\x1b[2J\x1b[32mIDENTICAL"), ("b", "other")):
        (tmp_path / f"{name}.jsonl").write_text(
            json.dumps({"metadata": {"weights_hash": value}})
            + "\n"
            + json.dumps({"tokens": [1, 2], "logprobs": [-1.0, -2.0]})
            + "\n"
        )
    rc, out, _ = run(["logprobs", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], capsys)
    assert rc == 5 and "\x1b" not in out and "\\x1b[2J" in out
    assert out.startswith("NOT COMPARABLE: metadata 'weights_hash' differs")


@pytest.mark.parametrize("given", [None, "2"])
def test_numpy_is_imported_with_one_blas_thread_unless_the_user_set_one(
    given: str | None,
) -> None:
    """Counted by threadpoolctl in a fresh process (numpy not yet imported there); the
    variable is gone again afterwards, and a count the user set is left alone."""
    import os
    import subprocess
    import sys

    code = (
        "import os\n"
        "from dmlib.cli.logprobs import _numpy_without_blas_threads\n"
        "_numpy_without_blas_threads()\n"
        "import numpy, threadpoolctl\n"
        "blas = [i['num_threads'] for i in threadpoolctl.threadpool_info()\n"
        "        if i['user_api'] == 'blas']\n"
        "print(blas[0], os.environ.get('OPENBLAS_NUM_THREADS'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == (["1", "None"] if given is None else [given, given])


@pytest.mark.parametrize("enabled", [True, False])
def test_the_garbage_collector_is_left_as_it_was(
    enabled: bool, files: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    import gc

    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        rc, out, _ = run(["logprobs", str(files["a"]), str(files["b"])], capsys)
        assert gc.isenabled() is enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert rc == 1 and out.startswith("DIFFERS")
