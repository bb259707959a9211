"""The lab's ``moe_packed`` dataset: its committed findings are what the captures show.

``index.json`` and the README are written by the generator from its own captures; here the
committed captures are compared again with :func:`dmlib.compare_captures` and the result
must be the committed findings, boundary counts, flips, expert rows and states alike. The
flips' experts are checked against the router values the captures hold, read with plain
JSON and numpy (top-k ids per token of the probe's rows), not through the routing report.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import numpy as np
import pytest

from dmlib.lab import moe_packed

DATA = Path(__file__).resolve().parent.parent / "data"
DS = DATA / moe_packed.DATASET


def _index():
    return json.loads((DS / "index.json").read_text())


def test_committed_findings_are_computed_from_the_committed_captures():
    index = _index()
    assert index["dtypes"] == ["bf16", "f32"]
    for dtype, per in index["findings"]["dtypes"].items():
        layouts = list(index["captures"][dtype])
        for name, committed in per.items():
            assert moe_packed.compared(DS / dtype, name, layouts) == committed, (dtype, name)


def test_the_dataset_is_small_and_every_file_is_in_the_manifest():
    doc = json.loads((DATA / "MANIFEST.json").read_text())["datasets"][moe_packed.DATASET]
    on_disk = {
        str(p.relative_to(DATA))
        for p in DS.rglob("*")
        if p.is_file() and p.name not in ("README.md", "study.toml")
    }
    assert on_disk == set(doc["files"])
    assert sum(p.stat().st_size for p in DS.rglob("*") if p.is_file()) < 2_000_000


def _router_ids(folder: Path, router: str) -> np.ndarray:
    """The probe's top-k expert ids at ``router`` (prefill), from the manifest by hand:
    the router values the capture kept, rows taken through the row map's probe entries."""
    doc = json.loads((folder / "manifest.json").read_text())
    vals = np.asarray(doc["coverage"]["routers"][f"{router}:router.indices"])
    rows = doc["row_map"]  # one entry per physical row: [request, position] or null
    probe = [i for i, e in enumerate(rows) if e is not None and e[0] == moe_packed.REQUEST]
    return np.sort(vals.reshape(len(rows), -1)[probe], axis=1)


def test_each_committed_flip_is_a_change_of_the_captured_top_k():
    index = _index()
    for dtype, per in index["findings"]["dtypes"].items():
        for name, f in per.items():
            routers = {x["router"] for x in f["flips"]}
            for router in routers:
                a = _router_ids(DS / dtype / "alone", router)
                b = _router_ids(DS / dtype / name, router)
                changed = [int(p) for p in np.flatnonzero((a != b).any(axis=1))]
                listed = [x for x in f["flips"] if x["router"] == router]
                assert changed == [x["position"] for x in listed]
                for x in listed:
                    assert a[x["position"]].tolist() == x["experts_a"]
                    assert b[x["position"]].tolist() == x["experts_b"]


def test_the_readme_quotes_the_findings():
    index = _index()
    text = (DS / "README.md").read_text()
    assert text == moe_packed.readme(index, small=False)
    assert index["findings"]["machine"] in text


@pytest.mark.slow
def test_small_generation_writes_findings_from_its_captures(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from dmlib.lab.__main__ import main
    from dmlib.report.study import load_study

    assert main([moe_packed.DATASET, "--out", str(tmp_path), "--small"]) == 0
    ds = tmp_path / moe_packed.DATASET
    index = json.loads((ds / "index.json").read_text())
    assert index["dtypes"] == ["bf16"]
    layouts = list(index["captures"]["bf16"])
    got = moe_packed.compared(ds / "bf16", "packed", layouts)
    assert index["findings"]["dtypes"]["bf16"]["packed"] == got
    assert got["repeat_held"] is True and got["negative_passed"] is True
    assert got["states"] == 8  # conv + recurrent of 2 linear layers, keys + values of 2
    study = load_study(ds / "study.toml")
    assert study.captures.reference == "alone"
    assert set(study.captures.folders) == {"alone", "packed"}


def test_the_committed_study_is_what_the_lab_writes_from_the_manifest():
    from dmlib.lab.studies import study_text

    env = json.loads((DATA / "MANIFEST.json").read_text())["datasets"][moe_packed.DATASET]
    text = study_text(moe_packed.DATASET, env["environment"], DS)
    assert (DS / "study.toml").read_text() == text
    assert 'negative = "bf16/different"' in text and 'alone = "bf16/alone_repeat"' in text


@pytest.mark.slow
def test_the_capture_notebook_reports_the_committed_findings(tmp_path, monkeypatch):
    """`dmlib report` on the study, with no torch importable (as `make report` runs): the
    notebook runs and records the flips, expert rows and first divergence index.json has,
    and its culprit table lists every state boundary."""
    import os

    from dmlib import open_capture
    from dmlib.report import load_numbers
    from dmlib.report.build import build_report
    from dmlib.report.study import load_study

    blocker = tmp_path / "no_torch"
    (blocker / "torch").mkdir(parents=True)
    (blocker / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    path = os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    out = tmp_path / "report"
    study = load_study(DS / "study.toml")
    (res,) = build_report(study, out, only=["capture_boundaries"], jobs=1, timeout=300)
    assert res.ok, f"failed in cell {res.failed_cell}: {res.error}"
    n = load_numbers(out / "numbers" / "capture_boundaries.json")
    found = _index()["findings"]["dtypes"]["bf16"]["packed"]
    assert n["first_divergent_boundary"] == found["first_divergent_boundary"]
    assert n["culprit"] == found["culprit"]
    assert n["routing_flips"]["alone vs packed"] == len(found["flips"])
    assert n["expert_rows_differ"]["alone vs packed"] == found["expert_rows_differ"]
    page = (out / "capture_boundaries.html").read_text()
    states = [b for b in json.loads((DS / "bf16" / "alone" / "manifest.json").read_text())
              ["boundaries"] if ":state." in b["name"] or b["name"].startswith("state.")]  # fmt: skip
    assert len(states) == found["states"]
    for s in found["states_differing"]:
        assert s.split(":", 1)[1] in page
    # each dumped state that differs: its largest |a-b| by numpy on the dumped rows, as the
    # generator recorded it and as the culprit table shows it (three digits, not 0.0)
    ca, cb = (open_capture(DS / "bf16" / k) for k in ("alone", "packed"))
    row = json.loads((DS / "bf16" / "packed" / "manifest.json").read_text())["metadata"][
        "probe_row"
    ]
    assert found["state_sizes"]
    for name, size in found["state_sizes"].items():
        # a state is one row per sequence, dumped whole: the probe's batch row of each
        xa = np.asarray(ca.tensor(name), dtype=np.float64)[0]
        xb = np.asarray(cb.tensor(name), dtype=np.float64)[row]
        d = np.abs(xa - xb)
        assert (size["max_abs"], size["n_diff"]) == (d.max(), int((xa != xb).sum()))
        assert f"{d.max():.3g}" in page
    if found["flips"]:  # the routing cell says the first flip in words (html-escaped arrow)
        f = found["flips"][0]
        words = f"position {f['position']}, experts {f['experts_a']} → {f['experts_b']}"
        assert words in html.unescape(page)
