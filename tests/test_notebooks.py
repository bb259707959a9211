"""The lab's studies (data/*/study.toml) reported headless; numbers match independent computations.

Each lab study is reported once (SMALL), by the same code as ``make report``; each test
then checks one notebook's figures (PNG and PDF, non-empty) and compares the numbers it
recorded with numpy computations over the raw files, or with what the dataset's
generator knows to be true (its ``index.json``; the notebooks themselves read only the
study). A study whose dataset is absent is skipped, naming the file.
"""

from __future__ import annotations

import hashlib
import html
import itertools
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

import dmlib
from dmlib.report import load_numbers
from dmlib.report.build import build_report
from dmlib.report.runner import PACKAGE_NOTEBOOKS
from dmlib.report.study import load_study

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = PACKAGE_NOTEBOOKS
# the datasets the notebooks read; another folder can stand in for data/ while developing
DATA = Path(os.environ.get("DMLIB_TEST_DATA") or REPO / "data").resolve()

DATASET = {
    "checkpoint_anatomy": "qr_init",
    "ulp_distributions": "qr_init",
    "qr_first_divergent_column": "qr_init",
    "run_matrix": "qr_init",
    "step_growth": "step_ladder",
    "capture_boundaries": "packed",
    "logprob_drift": "logprob_drift",
    "adapters": "lora_steps",
}
# which notebooks each lab study runs here (the others it would run are covered elsewhere)
ONLY = {
    "qr_init": None,
    "step_ladder": ["step_growth"],
    "packed": ["capture_boundaries"],
    "logprob_drift": ["logprob_drift"],
    "lora_steps": ["adapters"],
}
FIGURES = {
    "checkpoint_anatomy": [
        "anatomy_layout_0",
        "anatomy_slots_0",
        "anatomy_layout_1",
        "anatomy_slots_1",
    ],
    "ulp_distributions": ["ulp_histogram"],
    "qr_first_divergent_column": ["first_divergent_column"],
    "run_matrix": ["run_matrix_worst_rel_fro", "run_matrix_effective_rel_fro"],
    "step_growth": ["step_growth_rel_fro", "step_growth_rates"],
    "capture_boundaries": ["captures_boundary_profile", "captures_block_heatmap"],
    "logprob_drift": ["logprob_drift_k3"],
    "adapters": ["adapters_delta_growth", "adapters_gradient_l2"],
}


def _index(dataset: str) -> dict:
    return json.loads((DATA / dataset / "index.json").read_text())


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Report every lab study whose data exists once; -> {notebook: (report folder, result)}.

    The kernels run with a ``torch`` package on their path that refuses to import:
    ``make report`` installs no torch, so no notebook may need it.
    """
    out = tmp_path_factory.mktemp("reports")
    blocker = tmp_path_factory.mktemp("no_torch")
    (blocker / "torch").mkdir()
    (blocker / "torch" / "__init__.py").write_text(
        "raise ImportError('make report runs without torch')\n"
    )
    done = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(
            "PYTHONPATH",
            os.pathsep.join(filter(None, [str(blocker), os.environ.get("PYTHONPATH")])),
        )
        for ds, only in ONLY.items():
            if not (DATA / ds / "study.toml").is_file() or not (DATA / ds / "index.json").is_file():
                continue
            study = load_study(DATA / ds / "study.toml")
            results = build_report(study, out / ds, only=only, small=True, jobs=2, timeout=300)
            done.update({r.name: (out / ds, r) for r in results if not r.skipped})
    return done


def _numbers(executed, name: str) -> dict:
    ds = DATASET[name]
    if not (DATA / ds / "study.toml").is_file():
        pytest.skip(f"dataset {ds} absent: {DATA / ds / 'study.toml'} not found (make data)")
    out, res = executed[name]
    assert res.ok, f"notebook {name} failed in cell {res.failed_cell}: {res.error}"
    for fig in FIGURES[name]:
        for ext in ("png", "pdf"):
            path = out / "figures" / f"{fig}.{ext}"
            assert path.is_file() and path.stat().st_size > 1000, (
                f"{name}: figure {path.name} missing or empty"
            )
    assert (out / f"{name}.html").stat().st_size > 0
    numbers = load_numbers(out / "numbers" / f"{name}.json")
    assert numbers["figures"] == FIGURES[name]
    return numbers


def test_every_notebook_is_covered():
    found = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    assert found == sorted(DATASET)


@pytest.mark.parametrize("name", sorted(DATASET))
def test_notebook_stored_without_outputs(name):
    import nbformat

    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert "parameters" in code[0].metadata.get("tags", []), (
        "the first code cell must be tagged 'parameters'"
    )
    assert all(not c.outputs and c.execution_count is None for c in code), (
        "notebooks are stored without outputs"
    )
    # figures are saved by the notebook or by the report sections it calls
    assert any("report.save_figure" in c.source or "sections." in c.source for c in code)
    # no notebook knows the lab's folders: only the parameters cell's default names a study
    for c in code[1:]:
        for folder in ("qr_init", "step_ladder", "packed"):
            for quoted in (f'"{folder}', f"'{folder}", f"{folder}/", f"/{folder}"):
                assert quoted not in c.source, (name, quoted)
        assert "index.json" not in c.source and "DATA_DIR" not in c.source, name


# ---------------------------------------------------------------------------
# independent computations over the raw files


def _arrays(path: Path) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in dmlib.load(path).items()}


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(f"u{x.dtype.itemsize}")


def _rel_fro(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a64 - b64) / np.linalg.norm(a64))


def _qr_runs(numbers: dict) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    index = _index("qr_init")
    return index, {k: _arrays(DATA / "qr_init" / index["runs"][k]) for k in numbers["runs"]}


def test_checkpoint_anatomy(executed):
    n = _numbers(executed, "checkpoint_anatomy")
    index = _index("qr_init")
    path = DATA / "qr_init" / index["records_file"]
    assert n["files"] == [index["records_file"], index["records_model_file"]]
    raw = np.fromfile(path, dtype=np.uint8)
    ts = dmlib.open_tensors(path)
    got = {r["record"]: r for r in n["slots"][index["records_file"]]}
    assert sorted(got) == list(range(len(ts.records)))
    for rec in ts.records:
        # a flat read: every 4-byte word from the record's data base to its end
        flat = (rec.end - rec.data_base) // 4
        named = sum(t.nbytes for t in rec.values()) // 4
        inside = np.zeros(rec.end - rec.data_base, dtype=bool)
        for t in rec.values():
            lo = t.offset - rec.data_base
            inside[lo : lo + t.nbytes] = True
        words = raw[rec.data_base : rec.data_base + flat * 4].view("<f4")
        pad_words = ~inside[: flat * 4].reshape(-1, 4).any(axis=1)
        r = got[rec.index]
        assert r["flat_slots"] == flat
        assert r["named_slots"] == named
        assert r["padding_slots"] == flat - named == int(pad_words.sum())
        assert r["nan"] == int(np.isnan(words[pad_words]).sum())
        with np.errstate(invalid="ignore"):
            assert r["huge"] == int((np.abs(words[pad_words]) >= 1e30).sum())
    # the same parameters written by a zero-padding writer: equal tensors, different files
    clean_path = DATA / "qr_init" / index["records_model_file"]
    model, clean = _arrays(path), _arrays(clean_path)
    same = all(np.array_equal(_bits(model[k]), _bits(clean[k])) for k in clean)
    digest = [hashlib.sha256(p.read_bytes()).hexdigest() for p in (path, clean_path)]
    pair = (f"{index['records_file']}#0", index["records_model_file"])
    (fact,) = [f for f in n["same_names"] if (f["a"], f["b"]) == pair]
    assert fact["identical_tensors"] is same is True
    assert fact["file_sha256_equal"] is (digest[0] == digest[1]) is False


def _pair_facts(runs: dict[str, dict[str, np.ndarray]], control: str):
    same, ctrl, n_diff, identical = [], [], {}, []
    for a, b in itertools.combinations(runs, 2):
        rels = [_rel_fro(runs[a][k], runs[b][k]) for k in runs[a]]
        diff = sum(int((_bits(runs[a][k]) != _bits(runs[b][k])).sum()) for k in runs[a])
        (ctrl if control in (a, b) else same).append(max(rels))
        n_diff[(a, b)] = diff
        if diff == 0:
            identical.append(f"{a}/{b}")
    return same, ctrl, n_diff, identical


def test_ulp_distributions(executed):
    n = _numbers(executed, "ulp_distributions")
    index, runs = _qr_runs(n)
    control = index["control"]
    same, ctrl, n_diff, identical = _pair_facts(runs, control)
    assert n["same_worst_rel_fro"] == pytest.approx(max(same), rel=1e-9)
    assert n["control_rel_fro"] == pytest.approx(min(ctrl), rel=1e-9)
    assert n["separation_orders"] == pytest.approx(math.log10(min(ctrl) / max(same)), rel=1e-9)
    assert n["separation_orders"] > 3  # seed noise against a different seed: orders apart
    # the histogram counts every differing element exactly once
    assert n["hist_same_total"] == sum(v for (a, b), v in n_diff.items() if control not in (a, b))
    assert n["hist_control_total"] == sum(v for (a, b), v in n_diff.items() if control in (a, b))
    assert sorted(n["identical_pairs"]) == sorted(identical)
    # the generator knows which pairs drew the same reduction block size
    for pair, facts in index["pairs"].items():
        if all(label in runs for label in pair.split("/")):
            assert facts["bit_identical"] is (pair in n["identical_pairs"]), pair


def test_qr_first_divergent_column(executed):
    n = _numbers(executed, "qr_first_divergent_column")
    index, runs = _qr_runs(n)
    same = [k for k in runs if k != index["control"]]
    factor = [k for k in runs[same[0]] if k.endswith((".proj.u", ".proj.v"))]
    firsts, n_identical = [], 0
    for a, b in itertools.combinations(same, 2):
        for k in factor:
            cols = np.flatnonzero((_bits(runs[a][k]) != _bits(runs[b][k])).any(axis=0))
            if cols.size:
                firsts.append(int(cols[0]))
            else:
                n_identical += 1
    assert n["n_pairs"] == len(firsts) + n_identical
    assert n["n_identical"] == n_identical
    if firsts:
        assert (n["first_col_min"], n["first_col_max"]) == (min(firsts), max(firsts))
        assert n["first_col_median"] == pytest.approx(float(np.median(firsts)))
    # the generator recorded, per pair it summarised, the first divergent column of each factor
    for pair, facts in index["pairs"].items():
        a, b = pair.split("/")
        if a in same and b in same and "first_divergent_column" in facts:
            for k in factor:
                cols = np.flatnonzero((_bits(runs[a][k]) != _bits(runs[b][k])).any(axis=0))
                assert facts["first_divergent_column"].get(k) == (
                    int(cols[0]) if cols.size else None
                ), (pair, k)


def test_run_matrix(executed):
    n = _numbers(executed, "run_matrix")
    index, runs = _qr_runs(n)
    blocks = sorted({k.rsplit(".", 1)[0] for k in runs[n["runs"][0]] if k.endswith(".proj.u")})

    def effective(r, p):
        return (r[f"{p}.u"].astype(np.float64) * r[f"{p}.s"]) @ r[f"{p}.v"].T.astype(np.float64)

    for a, b in itertools.combinations(runs, 2):
        worst = max(_rel_fro(effective(runs[a], p), effective(runs[b], p)) for p in blocks)
        assert n["effective_rel_fro"][f"{a}/{b}"] == pytest.approx(worst, rel=1e-9, abs=1e-300)
        if f"{a}/{b}" in index["pairs"]:  # the generator's own record of the same quantity
            assert worst == pytest.approx(
                index["pairs"][f"{a}/{b}"]["worst_rel_fro_W"], rel=1e-9, abs=1e-300
            )
    control = index["control"]
    eff = n["effective_rel_fro"]
    assert max(v for k, v in eff.items() if control not in k.split("/")) < 1e-4
    assert min(v for k, v in eff.items() if control in k.split("/")) > 0.1
    # the stored tensors: worst rel_fro per pair, numpy on the raw arrays
    for a, b in itertools.combinations(runs, 2):
        worst = max(_rel_fro(runs[a][k], runs[b][k]) for k in runs[a])
        assert n["worst_rel_fro"][f"{a}/{b}"] == pytest.approx(worst, rel=1e-9, abs=1e-300)


def test_capture_boundaries(executed):
    n = _numbers(executed, "capture_boundaries")
    index = _index("packed")
    request = index["request"]
    cap = {k: DATA / "packed" / v for k, v in index["captures"].items()}
    ma, mb = (json.loads((cap[k] / "manifest.json").read_text()) for k in ("alone", "packed"))
    hb = {x["name"]: x for x in mb["boundaries"]}
    first = None
    for x in ma["boundaries"]:
        y = hb.get(x["name"])
        if y and request in x.get("requests", {}) and request in y.get("requests", {}):
            ra, rb = x["requests"][request], y["requests"][request]
            # the request's digest: "digest" in the manifest's hash scheme ("sha256" in older ones)
            key = "digest" if "digest" in ra else "sha256"
            if ra[key] != rb[key]:
                first = x["name"]
                break
    assert n["first_divergent_boundary"] == first
    assert n["repeat_control_held"] is True and n["negative_control_passed"] is True
    assert n["first_divergent"]["alone vs its repeat"] is None

    # the dumped rows: identical at the embedding output, different at the culprit
    def rows(capname, boundary):
        entry = next(
            x for x in (ma if capname == "alone" else mb)["boundaries"] if x["name"] == boundary
        )
        return np.asarray(dmlib.load(cap[capname] / entry["dump"]["file"])[f"request:{request}"])

    if "embeddings" in index.get("dumped", []):
        assert np.array_equal(rows("alone", "embeddings"), rows("packed", "embeddings"))
    culprit = n["culprit"]
    if culprit in index.get("dumped", []):
        a, b = rows("alone", culprit), rows("packed", culprit)
        assert not np.array_equal(a, b)
        assert n["culprit_rel_fro"] == pytest.approx(_rel_fro(a, b), rel=1e-9)


def test_capture_boundaries_op_level(executed):
    """The op level of the committed captures: what compare_captures and arbitrate (numpy
    replay, as in the torch-less kernel) return here, and the recorded patch test quoted."""
    n = _numbers(executed, "capture_boundaries")
    study = load_study(DATA / "packed" / "study.toml")
    if not study.captures.ops:
        pytest.skip("the packed study declares no op-level captures")
    request = study.captures.request
    (_, a), (_, b) = study.captures.ops.items()
    at = dmlib.compare_captures(a, b, request=request).attrs
    assert n["op_first_divergent"] == at["first_divergent_op"]
    assert n["op_culprit"] == at["culprit_op"]
    recorded = json.loads(study.captures.op_findings.read_text())
    assert n["op_machine"] == recorded["machine"] and recorded["machine"]
    patch = recorded["findings"]["patch"]
    assert n["op_patch_confirmed"] == (None if patch is None else patch["confirmed"])
    page = (executed["capture_boundaries"][0] / "capture_boundaries.html").read_text()
    assert html.escape(recorded["machine"]) in page
    if at["culprit_op"] is None:
        return
    arb = dmlib.arbitrate(a, b, at["culprit_op"], request=request, backend="numpy")
    assert n["op_arbitration_verdict"] == arb.verdict
    for row in arb.table.to_dict(orient="records"):
        assert n[f"op_arbitration_{row['run']}_max_ulp"] == row["max_ulp"]
        assert n[f"op_arbitration_{row['run']}_rel_err"] == row["rel_err"]
    pytest.importorskip("torch")
    by_torch = dmlib.arbitrate(a, b, at["culprit_op"], request=request, backend="torch").table
    assert list(by_torch["max_ulp"]) == list(arb.table["max_ulp"])
    assert np.allclose(by_torch["rel_err"], arb.table["rel_err"], rtol=1e-6)


def test_step_growth(executed):
    n = _numbers(executed, "step_growth")
    index = _index("step_ladder")
    ds = DATA / "step_ladder"
    runs = n["runs"]
    base = index["base"]
    files = {lab: {int(s): ds / f for s, f in index["runs"][lab].items()} for lab in runs}
    # every checkpoint records the step it reached; none may be counted under another step
    claimed = [(lab, s, p) for lab in runs for s, p in files[lab].items()]
    recorded = {(lab, s): dmlib.open_tensors(p).scalars.get("step") for lab, s, p in claimed}
    assert n["n_checkpoints"] == len(claimed)
    assert n["n_flagged"] == sum(int(v) != s for (_, s), v in recorded.items() if v is not None)
    steps = sorted(s for s in files[base] if int(recorded[(base, s)]) == s)
    assert n["last_step"] == n["max_verified_step"] == max(steps)

    ref = _arrays(files[base][steps[0]])
    norms = {k: float(np.linalg.norm(v.astype(np.float64))) for k, v in ref.items()}
    assert n["small_norm"] == sorted(k for k, v in norms.items() if v < 0.1)

    expected = {}
    for lab in runs[1:]:
        for s in steps:
            a, b = _arrays(files[base][s]), _arrays(files[lab][s])
            expected[f"{base}/{lab}@{s}"] = max(_rel_fro(a[k], b[k]) for k in a)
            if s == steps[-1] and expected[f"{base}/{lab}@{s}"] > 0:
                top = max(a, key=lambda k: _rel_fro(a[k], b[k]))
                assert n["top_mover_at_last_step"][f"{base}/{lab}"] == top
    assert n["max_rel_fro_by_pair_and_step"] == pytest.approx(expected, rel=1e-9, abs=1e-300)
    # the repeat is the same configuration: the generator records whether it was bit-identical
    if index["repeat"] in runs:
        pair = f"{base}/{index['repeat']}"
        assert (n["repeat_n_diff"][pair] == 0) is index["repeat_bit_identical"]


# ---------------------------------------------------------------------------
# a notebook run as a plain notebook (JupyterLab's "run all") on a study without its data


def _one_run_study(root: Path) -> Path:
    import struct

    raw = np.array([1.0, 2.0], dtype="<f4").tobytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (root / "a.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + raw)
    (root / "study.toml").write_text('title = "one run"\n\n[runs]\na = "a.safetensors"\n')
    return root / "study.toml"


def _markdown_outputs(nb) -> list[str]:
    return [
        o["data"]["text/markdown"]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if "text/markdown" in o.get("data", {})
    ]


def test_logprob_drift(executed):
    """The ladder the notebook recorded against numpy over the raw files: the sampler's
    JSONL parsed with json, the trainer's safetensors read by safetensors itself."""
    from safetensors.numpy import load_file

    n = _numbers(executed, "logprob_drift")
    index = _index("logprob_drift")
    ds = DATA / "logprob_drift"
    assert n["control"] == index["control"] == "lr0"
    rows = {(r["run"], r["step"]): r for r in n["ladder"]}
    k3 = {}
    for run in n["runs"]:
        for step, (fa, fb) in index["runs"][run].items():
            lines = [json.loads(x) for x in (ds / fa).read_text().splitlines()]
            seqs = [x for x in lines if "logprobs" in x]
            x = np.array([v for s in seqs for v in s["logprobs"]], dtype=np.float64)
            b = load_file(ds / fb)
            y = b["logprobs"].astype(np.float64).ravel()
            assert [v for s in seqs for v in s["tokens"]] == b["tokens"].ravel().tolist()
            d = y - x
            r = rows[(run, int(step))]
            assert r["status"] == ("differs" if (d != 0).any() else "identical")
            assert r["n_tokens"] == len(x) and r["n_diff"] == int((d != 0).sum())
            assert r["mean_abs_dlogprob"] == pytest.approx(np.abs(d).mean(), rel=1e-12)
            assert r["max_abs_dlogprob"] == np.abs(d).max()
            assert r["k3"] == pytest.approx(np.mean(np.expm1(d) - d), rel=1e-9, abs=1e-300)
            ids_a = [set(row) for s in seqs for row in s["top_ids"]]
            ids_b = [set(row) for row in b["top_ids"].reshape(-1, b["top_ids"].shape[-1])]
            overlap = np.mean([len(p & q) / len(p) for p, q in zip(ids_a, ids_b, strict=True)])
            assert r["topk_overlap"] == pytest.approx(overlap)
            k3[(run, int(step))] = np.mean(np.expm1(d) - d)
    band = max(v for (run, _), v in k3.items() if run == "lr0")
    assert n["band"] == pytest.approx(band, rel=1e-9)


def test_adapters(executed):
    """The adapters notebook's numbers against numpy over the raw files (the factors and
    gradients read by safetensors itself); the generator's truth: at step 0 every run but
    the control has the same weights, so the micro-batches with the correct normalisation
    differ from one backward by rounding only, and the per-micro-batch mean by far more."""
    from safetensors.numpy import load_file

    n = _numbers(executed, "adapters")
    index = _index("lora_steps")
    ds = DATA / "lora_steps"
    assert n["adapter_runs"][0] == index["reference"] == "base"
    scaling = index["lora"]["lora_alpha"] / index["lora"]["r"]
    for r in n["delta_growth"]:
        t = load_file(ds / r["run"] / "adapter" / f"step_{r['step']}" / "adapter_model.safetensors")
        a = t[f"base_model.model.{r['target']}.lora_A.weight"].astype(np.float64)
        b = t[f"base_model.model.{r['target']}.lora_B.weight"].astype(np.float64)
        assert r["delta_norm"] == pytest.approx(np.linalg.norm(scaling * (b @ a)), rel=1e-12)
    rel = {}
    for r in n["gradient_l2"]:
        x, y = (load_file(ds / run / "grads" / f"step_{r['step']}.safetensors")
                for run in (r["a"], r["b"]))  # fmt: skip
        names = [k for k in x if "lora_" in k]
        xa = np.concatenate([x[k].astype(np.float64).ravel() for k in names])
        ya = np.concatenate([y[k].astype(np.float64).ravel() for k in names])
        expected = np.linalg.norm(xa - ya) / np.linalg.norm(xa)
        assert r["rel_l2"] == pytest.approx(expected, rel=1e-12, abs=0)
        assert r["control"] is (r["b"] == index["control"])
        rel[(r["b"], r["step"])] = r["rel_l2"]
    assert rel[("split", 0)] < 1e-5 and rel[("bug", 0)] > 1e3 * max(rel[("split", 0)], 1e-12)


@pytest.mark.slow
def test_notebooks_on_a_study_without_their_data(tmp_path):
    """capture_boundaries, step_growth and qr_first_divergent_column on one checkpoint
    alone: each says in one Markdown line what is missing, no cell fails, no finding."""
    from dmlib.report import prose
    from dmlib.report.htmlsafe import md_text
    from dmlib.report.runner import run_notebooks
    from dmlib.report.sections_logprobs import NO_LOGPROBS

    study = _one_run_study(tmp_path)
    names = {
        "capture_boundaries": prose.NO_CAPTURES_HERE,
        "step_growth": prose.NO_LADDER_HERE,
        "qr_first_divergent_column": prose.NO_FACTOR_GROUPS_HERE,
        "logprob_drift": NO_LOGPROBS,
        "adapters": prose.NO_ADAPTERS_HERE,
    }
    paths = [NOTEBOOKS / f"{n}.ipynb" for n in names]
    results = run_notebooks(paths, tmp_path, {"STUDY": str(study), "FIGURE_DIR": "figures"}, jobs=2)
    for res in results:
        assert res.ok, (res.name, res.failed_cell, res.error)
        said = _markdown_outputs(res.nb)
        assert said == [f"> *Skipped: {md_text(names[res.name])}*"], (res.name, said)
        errors = [
            o for c in res.nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"
        ]
        assert not errors
    numbers = {p.stem: load_numbers(p) for p in (tmp_path / "numbers").glob("*.json")}
    assert all("finding" not in n for n in numbers.values())


@pytest.mark.slow
def test_notebook_on_a_study_that_cannot_be_opened(tmp_path):
    """STUDY naming no file: one Markdown line saying what to set, then the run stops on a
    one-line error (no traceback, no NameError in the cells after)."""
    from dmlib.report.runner import run_notebooks

    (res,) = run_notebooks(
        [NOTEBOOKS / "step_growth.ipynb"], tmp_path, {"STUDY": "nowhere/study.toml"}, jobs=1
    )
    assert not res.ok and res.error.startswith("StudyNotOpened")
    (said,) = _markdown_outputs(res.nb)
    assert said.startswith("**The study cannot be opened:**") and "`STUDY`" in said
    (err,) = [
        o for c in res.nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"
    ]
    assert len(err["traceback"]) == 1 and err["traceback"][0].startswith("Stopped: the study")
