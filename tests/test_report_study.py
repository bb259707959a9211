"""``dmlib report`` end to end on a study made here from a tiny real torch training.

The study is unlike the lab: other tensor names, no factorised layers, checkpoints at
steps 3, 7 and 11 written as safetensors by hand (header JSON + raw bytes, not by
dmlib), a repeat, a planted one-ULP difference from step 5 on, and a different-seed
control saved under a wrapper's ``net.`` prefix (the study maps it away with ``[names]``).
Expected numbers come from numpy on the raw file bytes (parsed here, not by
dmlib's readers) and from what the generator planted.
"""

from __future__ import annotations

import base64
import hashlib
import html
import itertools
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from _support.st_writer import write_f32  # noqa: E402
from torch import nn  # noqa: E402

from dmlib.cli import main as cli  # noqa: E402
from dmlib.errors import DmlibError  # noqa: E402
from dmlib.report.study import load_study  # noqa: E402

STEPS = (3, 7, 11)
# Burn's MNIST example checkpoint, mapped by the anatomy notebook when it is beside the checkout
MNIST = (
    Path(__file__).resolve().parent.parent.parent
    / "shared"
    / "fixtures"
    / "burnpack"
    / "mnist-model.bpk"
)
PLANT_AT = 5  # the planted run gets one ULP added to one weight after this step


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(6, 12)
        self.mixer = nn.Sequential(nn.Tanh(), nn.Linear(12, 12))
        self.readout = nn.Linear(12, 3)

    def forward(self, x):
        return self.readout(torch.tanh(self.mixer(self.stem(x))))


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray], step: int) -> None:
    write_f32(path, tensors, {"step": str(step)})


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The oracle's reader: header length, JSON, little-endian float32 bytes; the control's
    ``net.`` prefix is dropped, as its ``[names]`` mapping says."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + n])
    body = data[8 + n :]
    return {
        k.removeprefix("net."): np.frombuffer(
            body[v["data_offsets"][0] : v["data_offsets"][1]], dtype="<f4"
        ).reshape(v["shape"])
        for k, v in header.items()
        if k != "__metadata__"
    }


def _train(folder: Path, seed: int, *, plant: bool = False, prefix: str = "") -> None:
    torch.manual_seed(seed)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(99)  # the same data for every run
    folder.mkdir(parents=True)
    for step in range(1, max(STEPS) + 1):
        x = torch.randn(16, 6, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if plant and step == PLANT_AT:
            with torch.no_grad():
                w = net.readout.weight
                w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(np.inf))
        if step in STEPS:
            sd = {prefix + k: v.detach().numpy().copy() for k, v in net.state_dict().items()}
            _write_safetensors(folder / f"ckpt-{step:04d}.safetensors", sd, step)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    root = tmp_path_factory.mktemp("user_runs")
    torch.set_num_threads(1)
    _train(root / "runs" / "alpha", 0)
    _train(root / "runs" / "alpha_again", 0)
    _train(root / "runs" / "nudged", 0, plant=True)
    _train(root / "runs" / "seed1", 1, prefix="net.")
    (root / "study.toml").write_text(
        'title = "Tiny net: a repeat, a planted ULP and another seed"\n'
        'control = "seed1"\nreference = "alpha"\n\n[runs]\n'
        'alpha = "runs/alpha/"\nalpha_again = "runs/alpha_again/*.safetensors"\n'
        'nudged = "runs/nudged/"\nseed1 = "runs/seed1/"\n\n[repeats]\nalpha_again = "alpha"\n'
        '\n[names]\nseed1 = "net.="\n'
        + (f"\n[anatomy]\nfiles = [{json.dumps(MNIST.as_posix())}]\n" if MNIST.is_file() else "")
    )
    return root


@pytest.fixture(scope="module")
def report(lab, tmp_path_factory):
    out = tmp_path_factory.mktemp("shared") / "report"
    rc = cli(["report", str(lab / "study.toml"), "--out", str(out), "--jobs", "2"])
    return rc, out


def _rel_fro(a, b) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(np.linalg.norm(a64 - b64) / np.linalg.norm(a64))


def test_study_resolves_steps_from_the_files(lab):
    study = load_study(lab / "study.toml")
    assert list(study.runs) == ["alpha", "alpha_again", "nudged", "seed1"]
    for run in study.runs.values():
        assert run.steps == list(STEPS)
        assert set(run.step_source.values()) == {"recorded"}
    assert study.at_last_step()[1] == f"at step {STEPS[-1]}"


def test_report_writes_every_part(report):
    rc, out = report
    assert rc == 0
    for name in ("index.html", "report.html", "study.toml", "provenance.json", "summary.json"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    status = {r["name"]: r["status"] for r in summary["results"]}
    # no factor groups and no captures: those notebooks are skipped, and say why
    assert status == {
        "adapters": "skipped",
        "capture_boundaries": "skipped",
        "checkpoint_anatomy": "ok",
        "logprob_drift": "skipped",
        "qr_first_divergent_column": "skipped",
        "run_matrix": "ok",
        "step_growth": "ok",
        "ulp_distributions": "ok",
    }
    skipped = {r["name"]: r["skipped"] for r in summary["results"] if r["skipped"]}
    assert "factor groups" in skipped["qr_first_divergent_column"]
    assert "no LoRA adapter runs" in skipped["adapters"]
    assert "no log-prob runs ([logprobs]" in skipped["logprob_drift"]
    index = (out / "index.html").read_text()
    assert "Tiny net: a repeat, a planted ULP and another seed" in index
    assert "Not run: the study declares no captures" in index
    for r in summary["results"]:
        if r["status"] == "ok":
            assert r["finding"], r["name"]
            assert r["finding"].replace("`", "") in re.sub(r"<[^>]+>", "", html.unescape(index))
            for fig in r["figures"]:
                assert f'src="figures/{fig}.png"' in index  # thumbnails
                for ext in ("png", "pdf"):
                    assert (out / "figures" / f"{fig}.{ext}").stat().st_size > 1000


def _images(html: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', html)]


def test_each_html_shows_exactly_the_figures_saved(report):
    rc, out = report
    summary = json.loads((out / "summary.json").read_text())
    single = (out / "report.html").read_text()
    for r in summary["results"]:
        if r["status"] != "ok":
            continue
        page = (out / f"{r['name']}.html").read_text()
        shown = [hashlib.sha256(b).hexdigest() for b in _images(page)]
        saved = [
            hashlib.sha256((out / "figures" / f"{f}.png").read_bytes()).hexdigest()
            for f in r["figures"]
        ]
        assert shown == saved, r["name"]  # every saved figure inline, in order
        section = single.split(f'id="nb-{r["name"]}"', 1)[1].split('<section class="nb"', 1)[0]
        assert [hashlib.sha256(b).hexdigest() for b in _images(section)] == saved
    # report.html carries each figure's bytes once; the index part links to the inline figure
    every = [hashlib.sha256(b).hexdigest() for b in _images(single)]
    saved_all = [f for r in summary["results"] if r["status"] == "ok" for f in r["figures"]]
    assert len(every) == len(saved_all) == len(set(every))
    for f in saved_all:
        assert f'href="#fig-{f}"' in single
        anchored = re.search(
            rf'<img id="fig-{re.escape(f)}"[^>]*src="data:image/png;base64,([^"]+)"', single
        )
        png = (out / "figures" / f"{f}.png").read_bytes()
        assert anchored and base64.b64decode(anchored[1]) == png, f


def test_nothing_names_this_machine(report, lab):
    rc, out = report
    for p in out.rglob("*"):
        if p.suffix in (".html", ".ipynb", ".json", ".toml"):
            text = p.read_text()
            for machine in (str(out), str(lab), str(Path.home()), sys.prefix):
                assert machine not in text, (p.name, machine)
            # no absolute path at all in what a reader sees (PDF/PNG are binary)
            assert not re.search(r"(?<![\w.~<])/(tmp|home|work|root|usr|opt)/", text), p.name
    assert not re.search(r'(src|href)="(https?:)?//', (out / "report.html").read_text())


def test_numbers_in_the_html_equal_numpy_on_the_raw_files(report, lab):
    rc, out = report
    study = load_study(lab / "study.toml")
    last = {k: _read_safetensors(r.checkpoints[STEPS[-1]]) for k, r in study.runs.items()}
    numbers = json.loads((out / "numbers" / "run_matrix.json").read_text())
    page = (out / "run_matrix.html").read_text()
    for a, b in itertools.combinations(last, 2):
        worst = max(_rel_fro(last[a][k], last[b][k]) for k in last[a])
        assert numbers["worst_rel_fro"][f"{a}/{b}"] == pytest.approx(worst, rel=1e-9, abs=1e-300)
        assert f"{a}/{b}: worst rel_fro {worst:.6g}" in page
    same = {
        f"{a}/{b}"
        for a, b in itertools.combinations(last, 2)
        if all(np.array_equal(last[a][k].view("u4"), last[b][k].view("u4")) for k in last[a])
    }
    assert set(numbers["identical_pairs"]) == same == {"alpha/alpha_again"}


def test_step_growth_quotes_the_planted_step(report, lab):
    rc, out = report
    study = load_study(lab / "study.toml")

    def first_diff(a, b):
        for s in STEPS:
            x, y = (_read_safetensors(study.runs[r].checkpoints[s]) for r in (a, b))
            if any(not np.array_equal(x[k].view("u4"), y[k].view("u4")) for k in x):
                return s
        return None

    # the generator planted one ULP after step 5: identical at 3, different from 7 on
    assert first_diff("alpha", "nudged") == 7
    assert first_diff("alpha", "alpha_again") is None
    page = (out / "step_growth.html").read_text()
    assert "alpha/nudged: bit-identical through step 3, differs from step 7 on" in page
    assert "Repeat alpha/alpha_again: bit-identical at every step compared (3, 7, 11)" in page
    numbers = json.loads((out / "numbers" / "step_growth.json").read_text())
    for s in STEPS:
        x, y = (_read_safetensors(study.runs[r].checkpoints[s]) for r in ("alpha", "seed1"))
        assert numbers["max_rel_fro_by_pair_and_step"][f"alpha/seed1@{s}"] == pytest.approx(
            max(_rel_fro(x[k], y[k]) for k in x), rel=1e-9
        )


def test_provenance_hashes_every_input(report, lab):
    rc, out = report
    prov = json.loads((out / "provenance.json").read_text())
    files = {f["path"]: f["sha256"] for f in prov["inputs"]}
    on_disk = sorted(p for p in (lab / "runs").rglob("*.safetensors"))
    assert len(on_disk) == 12 and len(files) == 12 + MNIST.is_file()
    for p in on_disk:
        assert files[p.relative_to(lab).as_posix()] == hashlib.sha256(p.read_bytes()).hexdigest()
    assert prov["versions"]["dmlib"] and prov["versions"]["numpy"] and prov["cpu"]
    assert prov["torch"]["cpu_capability"]  # torch is installed here: its ISA is stated


def test_anatomy_maps_a_real_burn_file(report):
    if not MNIST.is_file():
        pytest.skip(f"real Burn fixture not found at {MNIST}")
    rc, out = report
    numbers = json.loads((out / "numbers" / "checkpoint_anatomy.json").read_text())
    ((name, (r,)),) = numbers["slots"].items()
    assert name.endswith("mnist-model.bpk") and not name.startswith("/")
    # Burn's MNIST example (fixtures README): 18 F32 tensors, zero padding from Burn's writer;
    # the tensors' element count from the CBOR header parsed here
    import cbor2

    raw = MNIST.read_bytes()
    meta = cbor2.loads(raw[10 : 10 + struct.unpack("<I", raw[6:10])[0]])
    assert len(meta["tensors"]) == 18
    assert r["named_slots"] == sum(int(np.prod(t["shape"])) for t in meta["tensors"].values())
    assert r["padding_nonzero_slots"] == r["nan"] == r["huge"] == 0
    assert numbers["figures"] == ["anatomy_layout_0", "anatomy_slots_0"]


def test_resolved_study_rebuilds_the_same_runs(report, lab):
    rc, out = report
    again = load_study(out / "study.toml")
    orig = load_study(lab / "study.toml")
    assert {k: list(r.checkpoints.items()) for k, r in again.runs.items()} == {
        k: list(r.checkpoints.items()) for k, r in orig.runs.items()
    }
    assert (again.control, again.reference, again.repeats) == (
        "seed1",
        "alpha",
        {"alpha_again": "alpha"},
    )
    assert again.names == {"seed1": ["net.="]}


def test_missing_file_is_bad_input_and_leaves_nothing(lab, tmp_path, capsys):
    study = tmp_path / "study.toml"
    text = (
        (lab / "study.toml").read_text().replace('"runs/seed1/"', '"runs/seed2/step9.safetensors"')
    )
    study.write_text(text.replace("runs/", f"{lab.as_posix()}/runs/"))
    out = tmp_path / "out"
    assert cli(["report", str(study), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "seed1" in err[0] and "not found" in err[0]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["study.toml"]


def test_flag_form_writes_the_resolved_study(lab, tmp_path, monkeypatch):
    monkeypatch.chdir(lab)
    out = tmp_path / "flags"
    rc = cli(
        [
            "report",
            "--run",
            "A=runs/alpha/",
            "--run",
            "S=runs/nudged",
            "--control",
            "S",
            "--out",
            str(out),
            "--only",
            "run_matrix",
        ]
    )
    assert rc == 0
    resolved = load_study(out / "study.toml")
    assert resolved.control == "S" and resolved.root == lab.resolve()
    assert [p.name for p in resolved.runs["A"].checkpoints.values()] == [
        f"ckpt-{s:04d}.safetensors" for s in STEPS
    ]


def test_unknown_param_is_refused(lab, tmp_path, capsys):
    assert (
        cli(
            [
                "report",
                str(lab / "study.toml"),
                "--out",
                str(tmp_path / "o"),
                "--param",
                "NOT_A_PARAM=1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "NOT_A_PARAM: not a parameter of any notebook" in err and "SMALL" in err
    assert not (tmp_path / "o").exists()


def test_study_init_scans_a_folder(lab, tmp_path):
    scan = tmp_path / "scan"
    shutil.copytree(lab / "runs", scan)
    assert cli(["study", "init", str(scan)]) == 0
    text = (scan / "study.toml").read_text()
    assert 'alpha = "alpha/"  # 3 checkpoints: a step ladder' in text
    assert "# control" in text  # no run is named like a control: left for the user, commented
    study = load_study(scan / "study.toml")
    assert set(study.runs) == {"alpha", "alpha_again", "nudged", "seed1"}
    assert cli(["study", "init", str(scan)]) == 2  # never overwrites without --force


def test_browser_renders_every_figure_offline(report, tmp_path):
    """Headless Chromium opens report.html: every image decodes, nothing is fetched."""
    browser = (
        shutil.which("chromium")
        or shutil.which("chromium-browser")
        or shutil.which("google-chrome")
    )
    if browser is None:
        pytest.skip("no Chromium installed (Debian: apt-get install chromium)")
    rc, out = report
    page = tmp_path / "page.html"
    probe = (
        "<script>window.addEventListener('load',()=>{const im=[...document.images];"
        "const bad=im.filter(i=>!(i.complete&&i.naturalWidth>0)).length;"
        "const ext=performance.getEntriesByType('resource').filter(r=>!r.name.startsWith('data:')).length;"
        "document.body.insertAdjacentHTML('beforeend',`<pre id=probe>IMAGES ${im.length} BAD ${bad} FETCHED ${ext}</pre>`);});</script>"
    )
    page.write_text((out / "report.html").read_text().replace("</body>", probe + "</body>"))
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=10000",
        "--dump-dom",
        page.as_uri(),
    ]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    m = re.search(r"IMAGES (\d+) BAD (\d+) FETCHED (\d+)", dom)
    assert m, dom[-500:]
    summary = json.loads((out / "summary.json").read_text())
    n_figures = sum(len(r["figures"]) for r in summary["results"])
    # each figure appears once, inline in its notebook (the index part links to it)
    assert (int(m[1]), int(m[2]), int(m[3])) == (n_figures, 0, 0)


# ---------------------------------------------------------------------------
# a study of captures: one request, a planted weight change in one module


class Tagger(nn.Module):
    """Row-wise: every token row is mapped on its own, so only the planted change can differ."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.proj = nn.Linear(4, 8)
        self.act = nn.Tanh()
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.act(self.mix(self.act(self.proj(x)))))


def _capture(model, path, x):
    rows = [("req", j) for j in range(x.shape[1])]
    with torch.no_grad(), dmlib_capture(model, path, row_map=rows, block_rows=4, dump="*"):
        model(x)


def dmlib_capture(*args, **kwargs):
    import dmlib

    return dmlib.capture(*args, **kwargs)


@pytest.fixture(scope="module")
def capture_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("captures")
    torch.set_num_threads(1)
    x = torch.randn(1, 12, 4, generator=torch.Generator().manual_seed(5))
    other = torch.randn(1, 12, 4, generator=torch.Generator().manual_seed(6))
    base = Tagger()
    nudged = Tagger()
    with torch.no_grad():
        nudged.mix.weight[0, 0] += 1e-3
    # the oracle: plain forward hooks on the planted module, no dmlib involved
    seen = {}
    for name, m in (("base", base), ("nudged", nudged)):
        h = m.mix.register_forward_hook(
            lambda mod, i, o, name=name: seen.__setitem__(name, o.detach().numpy().copy())
        )
        with torch.no_grad():
            m(x)
        h.remove()
    _capture(base, root / "cap" / "base", x)
    _capture(base, root / "cap" / "base_again", x)
    _capture(nudged, root / "cap" / "nudged", x)
    _capture(base, root / "cap" / "other_input", other)
    (root / "study.toml").write_text(
        'title = "A planted change in one module"\n\n[captures]\nrequest = "req"\nreference = "base"\n'
        'negative = "cap/other_input"\n\n[captures.folders]\nbase = "cap/base"\nnudged = "cap/nudged"\n\n'
        '[captures.repeats]\nbase = "cap/base_again"\n'
    )
    for name, m in (("base", base), ("nudged", nudged)):  # op level: every op, mix's dumped
        rows = [("req", j) for j in range(x.shape[1])]
        with torch.no_grad(), dmlib_capture(m, root / "ops" / name, row_map=rows, block_rows=4,
                                            ops=True, dump="mix/*"):  # fmt: skip
            m(x)
    out = tmp_path_factory.mktemp("shared_captures") / "report"
    rc = cli(["report", str(root / "study.toml"), "--out", str(out)])
    return rc, out, seen, root


@pytest.fixture(scope="module")
def op_capture_report(capture_report):
    root = capture_report[3]
    text = (root / "study.toml").read_text()
    (root / "study_ops.toml").write_text(
        text + '\n[captures.ops]\nbase = "ops/base"\nnudged = "ops/nudged"\n'
    )
    out = root / "report_ops"
    rc = cli(["report", str(root / "study_ops.toml"), "--out", str(out)])
    return rc, out, root


def test_captures_study_names_the_planted_module(capture_report):
    rc, out, seen, _ = capture_report
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["name"] for r in summary["results"] if r["status"] == "ok"] == ["capture_boundaries"]
    n = json.loads((out / "numbers" / "capture_boundaries.json").read_text())
    # the generator planted the change in `mix`: its input is identical, its output differs
    assert n["culprit"] == n["first_divergent_boundary"] == "mix"
    assert n["repeat_control_held"] is True and n["negative_control_passed"] is True
    a, b = seen["base"][0], seen["nudged"][0]
    rel_fro = float(
        np.linalg.norm((a - b).astype(np.float64)) / np.linalg.norm(a.astype(np.float64))
    )
    assert rel_fro > 0 and n["culprit_rel_fro"] == pytest.approx(rel_fro, rel=1e-9)
    page = (out / "capture_boundaries.html").read_text()
    assert "base vs nudged: first divergent boundary <code>mix</code>" in page
    assert len(_images(page)) == len(n["figures"]) == 2
    # no [captures.ops]: the op-level section says so in one line
    (result,) = [r for r in summary["results"] if r["name"] == "capture_boundaries"]
    assert any("no op-level captures" in s for s in result["skipped_sections"])
    assert "op_first_divergent" not in n


def test_op_level_of_a_planted_change(op_capture_report):
    """[captures.ops]: the notebook's op-level numbers are compare_captures' (called here);
    the plant (one weight of `mix`) makes the first divergent op one of mix's, and no op
    qualifies as culprit (the differing weight is an input of mix's ops)."""
    import dmlib

    rc, out, root = op_capture_report
    assert rc == 0
    n = json.loads((out / "numbers" / "capture_boundaries.json").read_text())
    at = dmlib.compare_captures(root / "ops" / "base", root / "ops" / "nudged", request="req").attrs
    assert n["op_first_divergent"] == at["first_divergent_op"]
    assert n["op_first_divergent"].startswith("mix/")
    assert n["op_culprit"] == at["culprit_op"]
    assert n["op_machine"] is None and n["op_patch_confirmed"] is None
    text = re.sub(r"<[^>]+>", "", html.unescape((out / "capture_boundaries.html").read_text()))
    assert f"the first divergent op is {at['first_divergent_op']}" in text
    assert "captured on a machine the study does not record" in text
    assert "No patch test is recorded" in text
    resolved = load_study(out / "study.toml")  # the report's own study keeps the op level
    assert [p.name for p in resolved.captures.ops.values()] == ["base", "nudged"]


def test_study_captures_section_type(tmp_path):
    """[captures] reads into a StudyCaptures (the old name Capture still imports as the same
    class); it is not the capture-folder reader's Capture."""
    from dmlib.localize.capture.reader import Capture as FolderCapture
    from dmlib.report.study import Capture, StudyCaptures

    for k in ("a", "b"):
        (tmp_path / "cap" / k).mkdir(parents=True)
        (tmp_path / "cap" / k / "manifest.json").write_text("{}")  # a study checks only it exists
    (tmp_path / "study.toml").write_text('[captures.folders]\na = "cap/a"\nb = "cap/b"\n')
    got = load_study(tmp_path / "study.toml").captures
    assert type(got) is StudyCaptures and Capture is StudyCaptures
    assert StudyCaptures is not FolderCapture
    assert got.folders == {"a": tmp_path / "cap" / "a", "b": tmp_path / "cap" / "b"}
    assert got.reference == "a" and got.request is None and got.ops == {}


def test_op_captures_need_two_folders(capture_report, tmp_path):
    root = capture_report[3]
    text = (root / "study.toml").read_text()
    bad = root / "study_one_op.toml"
    bad.write_text(text + '\n[captures.ops]\nbase = "ops/base"\n')
    with pytest.raises(DmlibError, match=r"\[captures.ops\] needs two"):
        load_study(bad)
    bad.write_text(
        text
        + '\n[captures.ops]\nbase = "ops/base"\nnudged = "ops/nudged"\nfindings = "nope.json"\n'
    )
    with pytest.raises(DmlibError, match="op findings file 'nope.json' not found"):
        load_study(bad)


def test_study_init_from_paths(lab, tmp_path, monkeypatch):
    monkeypatch.chdir(lab)
    target = tmp_path / "mine" / "study.toml"
    target.parent.mkdir()
    rc = cli(
        [
            "study",
            "init",
            "--run",
            "a=runs/alpha/",
            "--run",
            "ctrl=runs/seed1/",
            "--control",
            "ctrl",
            "--out",
            str(target),
        ]
    )
    assert rc == 0
    study = load_study(target)
    assert study.control == "ctrl" and study.runs["a"].steps == list(STEPS)
    assert (
        study.runs["a"].checkpoints[STEPS[0]]
        == lab / "runs" / "alpha" / f"ckpt-{STEPS[0]:04d}.safetensors"
    )


def test_report_says_when_the_study_does_not_name_its_machine(report):
    rc, out = report
    text = re.sub(r"<[^>]+>", "", html.unescape((out / "index.html").read_text()))
    assert "The study does not record the machine that made the runs (made_on)" in text


def test_made_on_is_read_kept_and_shown(lab, tmp_path):
    from dmlib.report import pages
    from dmlib.report.studyfile import resolved_toml

    machine = "Intel Xeon 8480+ (avx512f, amx_tile), torch 2.13.0, 1 thread"
    text = (lab / "study.toml").read_text()
    first, rest = text.split("\n", 1)
    (lab / "study_made_on.toml").write_text(f"{first}\nmade_on = {json.dumps(machine)}\n{rest}")
    study = load_study(lab / "study_made_on.toml")
    assert study.made_on == machine
    again = tmp_path / "resolved.toml"
    again.write_text(resolved_toml(study, tmp_path))
    assert load_study(again).made_on == machine
    summary = {"title": study.title, "made_on": study.made_on, "runs": [1], "control": None,
               "results": [], "dmlib": "0"}  # fmt: skip
    shown = re.sub(r"<[^>]+>", "", pages._header(summary))
    assert f"Runs made on: {machine}." in shown


def test_study_init_offers_this_machine_as_a_commented_guess(lab, tmp_path):
    scan = tmp_path / "scan"
    shutil.copytree(lab / "runs", scan)
    assert cli(["study", "init", str(scan)]) == 0
    text = (scan / "study.toml").read_text()
    model = (
        next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.lower().startswith("model name")
        )
        if Path("/proc/cpuinfo").is_file()
        else None
    )
    guess = [line for line in text.splitlines() if line.startswith("# made_on = ")]
    assert len(guess) == 1 and "keep it only if the runs were made here" in guess[0]
    if model:
        assert model in guess[0]
    assert load_study(scan / "study.toml").made_on is None  # a comment, not a claim


def test_recorded_patch_test_is_quoted_with_its_machine(op_capture_report, tmp_path):
    from dmlib.report.oplevel import op_level

    root = op_capture_report[2]
    recorded = {
        "machine": "Planted CPU (avx2), torch dispatching to AVX2",
        "findings": {
            "culprit_op": "elsewhere/aten.addmm#0", "torch": "2.13.0", "threads": 2,
            "patch": {"boundary": "elsewhere/aten.addmm#0", "confirmed": True, "reason": None,
                      "first_still_differing": None},
            "patch_every_layer": {"boundary": "a/aten.mm#0, b/aten.mm#0, c/aten.mm#0",
                                  "confirmed": False, "reason": "2 later boundaries still differ",
                                  "first_still_differing": "d"},
        },
    }  # fmt: skip
    (tmp_path / "f.json").write_text(json.dumps(recorded))
    study = load_study(root / "study_ops.toml")
    study.captures.op_findings = tmp_path / "f.json"
    res = op_level(study.captures)
    assert (
        res.numbers["op_machine"] == recorded["machine"]
        and res.numbers["op_patch_confirmed"] is True
    )
    text = "\n".join(res.lines)
    assert (
        "Patch test, recorded on Planted CPU (avx2), torch dispatching to AVX2 (torch 2.13.0, 2 threads): "
        "patching the reference's rows at `elsewhere/aten.addmm#0`: confirmed; the same op in every "
        "layer at `a/aten.mm#0` and 2 more: not confirmed (first boundary still differing: `d`); "
        "2 later boundaries still differ."
    ) in text
    assert (
        "The recorded patch test concerns `elsewhere/aten.addmm#0`, while these captures name"
        in text
    )
    (tmp_path / "f.json").write_text("{not json")
    with pytest.raises(DmlibError, match="op findings unreadable"):
        op_level(study.captures)


def test_a_study_file_that_is_a_fifo_or_oversized_is_refused_not_waited_on(tmp_path):
    """study.toml as a FIFO: one error naming it, at once (run in a subprocess with a
    timeout: before, load_study blocked in read_text until a writer came); a file one byte
    over the text limit refused before it is read, naming it."""
    import os

    fifo = tmp_path / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "study.toml")
    code = (
        "import sys\nfrom dmlib.report.study import load_study\nfrom dmlib.errors import DmlibError\n"
        f"try:\n    load_study({str(fifo)!r})\nexcept DmlibError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert "study.toml" in out.stdout and "not a regular file" in out.stdout, out
    from dmlib import _limits

    big = tmp_path / "big"
    big.mkdir()
    (big / "study.toml").write_bytes(b"#" * (_limits.MAX_TEXT_BYTES + 1))
    with pytest.raises(DmlibError, match="study.toml.*more than"):
        load_study(big)
    with pytest.raises(DmlibError, match="study file not found"):
        load_study(tmp_path / "none.toml")
