"""The lab's generated study files and the scope of the committed op-level captures."""

from __future__ import annotations

import pytest

from dmlib.lab.packed_ops import committed_scope
from dmlib.lab.studies import made_on, study_text
from dmlib.report.study import load_study

ENV = {
    "cpu": "Intel Xeon 8480+",
    "cpu_count": 8,
    "libraries": {"numpy": "2.0.1", "torch": "2.13.0"},
    "torch_dispatch": {"cpu_capability": "AVX512"},
}


@pytest.mark.parametrize(
    ("culprit", "modules", "dump"),
    [
        (None, ["encoder.layer.0", "encoder.layer.0.*"], []),
        ("encoder.layer.3.attention.self/aten.addmm#0", ["encoder.layer.3", "encoder.layer.3.*"],
         ["encoder.layer.3.attention.self/aten.addmm#0", "encoder.layer.3.attention.self/aten.addmm#0:*"]),
        ("model.layers.12/aten.mm#2", ["model.layers.12", "model.layers.12.*"],
         ["model.layers.12/aten.mm#2", "model.layers.12/aten.mm#2:*"]),
    ],
)  # fmt: skip
def test_committed_scope_is_the_culprit_layer_and_op(culprit, modules, dump):
    assert committed_scope(culprit) == (modules, dump)


def test_made_on_names_the_recorded_machine():
    assert made_on("packed", ENV) == (
        "Intel Xeon 8480+, 8 logical CPUs, torch 2.13.0, 1 thread (data/MANIFEST.json; "
        "torch dispatching to AVX512)"
    )
    assert made_on("qr_init", ENV).startswith("Intel Xeon 8480+, 8 logical CPUs, numpy 2.0.1 ")


def test_packed_study_lists_what_exists_and_loads(tmp_path):
    for name in ("alone", "packed", "different", "alone_repeat"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text("{}")  # a study reads only captures
    text = study_text("packed", ENV, tmp_path)
    assert (
        'padded = "padded"' not in text
        and "[captures.ops]" not in text
        and 'alone = "alone_repeat"' in text
    )
    (tmp_path / "study.toml").write_text(text)
    study = load_study(tmp_path / "study.toml")
    assert set(study.captures.folders) == {"alone", "packed"} and not study.captures.ops
    for name in ("alone", "packed"):
        (tmp_path / "ops" / name).mkdir(parents=True)
        (tmp_path / "ops" / name / "manifest.json").write_text("{}")
    (tmp_path / "ops" / "op_findings.json").write_text("{}")
    (tmp_path / "study.toml").write_text(study_text("packed", ENV, tmp_path))
    study = load_study(tmp_path / "study.toml")
    assert list(study.captures.ops) == ["alone", "packed"]
    assert study.captures.op_findings == tmp_path / "ops" / "op_findings.json"
    assert study.made_on == made_on("packed", ENV)
