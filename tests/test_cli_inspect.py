"""dmlib inspect --json: the hashes it prints are SHA-256 of exactly the right bytes."""

from __future__ import annotations

import hashlib
import json

import numpy as np

from dmlib.cli import main
from dmlib.io.burnpack import encode_burnpack, write_records


def test_inspect_json_hashes_per_tensor_record_and_data(tmp_path, capsys):
    model = {"w": np.arange(6, dtype=np.float32), "b": np.ones(3, np.float32)}
    optim = {"m": np.full(4, 2.0, np.float32)}
    p = tmp_path / "two.bpk"
    write_records(p, [encode_burnpack(model), encode_burnpack(optim)])
    assert main(["inspect", str(p), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)

    def sha(*arrays: np.ndarray) -> str:
        return hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()

    by_name = {(t["record"], t["name"]): t["data_hash"] for t in doc["tensors"]}
    assert by_name == {
        (0, "w"): sha(model["w"]),
        (0, "b"): sha(model["b"]),
        (1, "m"): sha(optim["m"]),
    }
    assert [r["data_hash"] for r in doc["records"]] == [
        sha(model["w"], model["b"]),
        sha(optim["m"]),
    ]
    assert doc["data_hash"] == sha(model["w"], model["b"], optim["m"])
    assert doc["file_hash"] == hashlib.sha256(p.read_bytes()).hexdigest()
