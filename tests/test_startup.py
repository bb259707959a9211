"""The command line pays for heavy imports only when it uses them (fresh interpreters)."""

from __future__ import annotations

import json
import subprocess
import sys

import ml_dtypes
import numpy as np

import dmlib

PROBE = """
import json, sys
from dmlib.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "ml_dtypes": "ml_dtypes" in sys.modules,
                  "pandas": "pandas" in sys.modules}))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("dmlib.io.") or m in
                        ("blake3", "zipfile", "cbor2"))))
"""


def _probe(*args: str) -> dict:
    return _probe_all(*args)[0]


def _probe_all(*args: str) -> tuple[dict, list[str]]:
    """(exit code and heavy imports, the reader modules and hashing modules loaded)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, check=False
    )
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-2]), json.loads(lines[-1])


def test_float32_compare_imports_neither_ml_dtypes_nor_pandas(tmp_path):
    a = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    b = a.copy()
    b.view(np.uint32)[1, 2] += 1
    pa, pb = tmp_path / "x.safetensors", tmp_path / "y.safetensors"
    dmlib.write_safetensors(pa, {"model.head.w": a})
    dmlib.write_safetensors(pb, {"model.head.w": b})
    got = _probe("compare", str(pa), str(pb))
    assert got == {"code": 1, "ml_dtypes": False, "pandas": False}


def test_bfloat16_still_read_when_ml_dtypes_comes_late(tmp_path):
    # a fresh process must import ml_dtypes on its own when a file holds bf16
    a = np.array([1.0, -2.5, 3.0, 0.125], dtype=ml_dtypes.bfloat16)
    b = a.copy()
    b.view(np.uint16)[3] += 3  # 3 ULP apart, planted on the bits
    pa, pb = tmp_path / "x.safetensors", tmp_path / "y.safetensors"
    dmlib.write_safetensors(pa, {"pool.proj": a})
    dmlib.write_safetensors(pb, {"pool.proj": b})
    got = _probe("compare", "--json", str(pa), str(pb))
    assert got["code"] == 1 and got["ml_dtypes"] is True
    out = subprocess.run(
        [sys.executable, "-m", "dmlib", "compare", "--json", str(pa), str(pb)],
        capture_output=True,
        text=True,
        check=False,
    )
    (row,) = json.loads(out.stdout)["rows"]
    assert (row["dtype"], row["n_diff"], row["max_ulp"], row["first_diff"]) == (
        "bfloat16",
        1,
        3,
        [3],
    )


def test_compare_loads_its_reader_alone_and_hashes_only_what_it_prints(tmp_path):
    a = np.arange(16, dtype=np.float32)
    b = a.copy()
    b[5] = 7.5
    pa, pb = tmp_path / "x.safetensors", tmp_path / "y.safetensors"
    dmlib.write_safetensors(pa, {"w": a})
    dmlib.write_safetensors(pb, {"w": b})
    head, mods = _probe_all("compare", str(pa), str(pb))
    # the text output shows no hash: none is computed, the bytes are compared
    assert head["code"] == 1 and mods == ["dmlib.io._checks", "dmlib.io.safetensors"]
    head, mods = _probe_all("compare", "--json", str(pa), str(pb))
    assert head["code"] == 1 and "blake3" in mods
    # a file whose name says nothing: detection still tries every reader's magic
    pc = tmp_path / "weights.data"
    pc.write_bytes(pa.read_bytes())
    head, mods = _probe_all("compare", str(pc), str(pb))
    assert head["code"] == 1 and "dmlib.io.burnpack" in mods and "dmlib.io.safetensors" in mods


def test_matrix_command_imports_no_pandas(tmp_path):
    a = np.arange(8, dtype=np.float32)
    paths = []
    for i, arr in enumerate([a, a, a + 1]):
        paths.append(tmp_path / f"r{i}.safetensors")
        dmlib.write_safetensors(paths[-1], {"w": arr})
    got = _probe("matrix", *(f"r{i}={p}" for i, p in enumerate(paths)), "--control", "r2")
    assert got == {"code": 1, "ml_dtypes": False, "pandas": False}
