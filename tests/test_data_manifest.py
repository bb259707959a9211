"""The committed lab data match data/MANIFEST.json, file for file."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "data"


def test_every_committed_file_matches_its_manifest_hash():
    doc = json.loads((DATA / "MANIFEST.json").read_text())
    assert set(doc["datasets"]) == {
        "qr_init",
        "step_ladder",
        "packed",
        "packed_ops",
        "logprob_drift",
        "lora_steps",
        "moe_packed",
    }
    listed = set()
    for ds in doc["datasets"].values():
        assert ds["command"].startswith("python -m dmlib.lab ")
        assert ds["environment"]["libraries"]["numpy"]
        for rel, info in ds["files"].items():
            data = (DATA / rel).read_bytes()
            assert hashlib.sha256(data).hexdigest() == info["sha256"], rel
            assert len(data) == info["bytes"], rel
            listed.add(rel)
    # nothing in a dataset folder escapes the manifest (READMEs are documentation, and
    # study.toml tells `dmlib report` what the dataset holds)
    on_disk = {
        str(p.relative_to(DATA))
        for d in doc["datasets"]
        if (DATA / d).is_dir()
        for p in (DATA / d).rglob("*")
        if p.is_file() and p.name not in ("README.md", "study.toml")
    }
    assert on_disk <= listed, sorted(on_disk - listed)[:5]


def test_each_study_is_what_the_lab_writes_from_the_manifest():
    """data/*/study.toml are generated (dmlib.lab.studies) from the environment each dataset's
    manifest section records: the committed files are exactly that text."""
    from dmlib.lab.studies import study_text

    doc = json.loads((DATA / "MANIFEST.json").read_text())["datasets"]
    for name in ("qr_init", "step_ladder", "packed", "logprob_drift"):
        text = study_text(name, doc[name]["environment"], DATA / name)
        assert (DATA / name / "study.toml").read_text() == text, name
        cpu = doc[name]["environment"]["cpu"]
        assert f'made_on = "{cpu}, {doc[name]["environment"]["cpu_count"]} logical CPUs' in text
