"""The report promises, each test named by the promise it checks.

1. A shared report runs no script from its data: a study whose title, ``made_on``, run
   labels, capture labels, request, run and capture folder names, checkpoint tensor
   names and capture boundary (module) names carry HTML, event attributes, backticks,
   Markdown links to ``javascript:`` and ANSI escapes is reported; every HTML file is
   parsed (stdlib ``html.parser``): no ``<script>``, no ``on*`` attribute, no
   ``javascript:`` URL, and each hostile string shows as visible text. Headless Chromium
   (where installed) loads the pages: payloads that would write into the DOM or the
   title did not run, while a probe script of the test's own did.
2. ``--out`` never deletes what dmlib did not write: the study's own folder, a folder
   holding only a ``summary.json``, a folder holding the runs, an existing folder for the
   multi-study index, and an earlier report with a file added by the user are refused,
   exit 2, and every file is intact (sha256 of the tree before and after).
3. Temporary folders go on every exit path: Ctrl-C exits 130 with one line and leaves
   nothing; after ``kill -9`` the next run removes what the dead run left (and only
   that: a live process's folder and a folder without an owner file are kept).
4. A title with U+007F (or any control character) gives a valid study.toml.

Expected values come from the payloads themselves (their visible form computed here)
and from the real libraries (``safetensors`` writes the checkpoints, ``tomllib`` reads
the rewritten study).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import tomllib

torch = pytest.importorskip("torch")
pytest.importorskip("nbclient")
pytest.importorskip("nh3")
safetensors_numpy = pytest.importorskip("safetensors.numpy")
from torch import nn  # noqa: E402

from dmlib.cli import main as cli  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# the injection strings: each data field of the study carries them
PAYLOADS = {
    "script": "<script>alert(1)</script>",
    "img": "<img src=x onerror=alert(1)>",
    "backticks": "a`b``c`",
    "link": "[x](javascript:alert(1))",
    "ansi": "\x1b[31mred",
}
# payloads whose effect, had they run, is visible in the DOM Chromium dumps
WRITES_DOM = "<img src=x onerror=document.body.append('PWN'+'ED1')>"
WRITES_TITLE = "<script>document.title='PWN'+'ED2'</script>"
TENSORS = [*PAYLOADS.values(), WRITES_DOM, WRITES_TITLE]
TITLE = " ".join(TENSORS) + " DEL\x7f"
MADE_ON = PAYLOADS["img"] + PAYLOADS["link"]
# a run label may not hold / \ = or a space (the study refuses it): the hostile ones it allows
LABELS = [
    "<script>alert(1)<script>A",
    PAYLOADS["backticks"] + PAYLOADS["ansi"],
    PAYLOADS["link"] + "<img>",
]
CAPTURE_LABELS = ["<script>alert(1)<script>ref", PAYLOADS["link"] + PAYLOADS["ansi"]]
REQUEST = PAYLOADS["script"]
# a file name cannot hold "/", and a run's folder no "[" (the study reads it as a glob)
RUN_FOLDERS = [
    PAYLOADS["img"],
    PAYLOADS["backticks"] + "\x1bred",
    "javascript:alert(1)" + WRITES_DOM,
]
CAPTURE_FOLDERS = [PAYLOADS["img"] + "ref", PAYLOADS["backticks"] + "nudged"]
# a module name may not hold ':', '#' or '/' (dmlib.capture refuses them: boundary names use
# them as separators): the link payload with its colon as the entity &colon;, which a Markdown
# renderer decodes in a link destination into a working javascript: URL
MODULES = [
    PAYLOADS["img"],
    PAYLOADS["backticks"] + PAYLOADS["ansi"],
    "[x](javascript&colon;alert(1))",
]


def visible(text: str) -> str:
    """How a string must read on the page: control characters as \\xNN (this test's own rule)."""
    return re.sub(r"[\x00-\x1f\x7f-\x9f]", lambda m: f"\\x{ord(m.group(0)):02x}", text)


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (and the folders, as entries)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# ---------------------------------------------------------------------------
# the hostile study


class Hostile(nn.Module):
    """Three modules whose names are payloads (the capture's boundary names)."""

    def __init__(self, plant: bool = False) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.add_module(MODULES[0], nn.Linear(4, 8))
        self.add_module(MODULES[1], nn.Tanh())
        self.add_module(MODULES[2], nn.Linear(8, 2))
        if plant:
            with torch.no_grad():
                # in the first module: every payload-named module then differs, and the
                # capture page lists the boundaries that differ
                getattr(self, MODULES[0]).weight[0, 0] += 1e-3

    def forward(self, x):
        for m in self.children():
            x = m(x)
        return x


def make_study(parent: Path) -> Path:
    import dmlib

    root = parent / ("study " + PAYLOADS["img"] + PAYLOADS["backticks"])
    rng = np.random.default_rng(0)
    base = {n: rng.standard_normal((4, 4)).astype(np.float32) for n in TENSORS}
    steps = {
        RUN_FOLDERS[0]: {1: base, 2: {k: v * 1.5 for k, v in base.items()}},
        RUN_FOLDERS[1]: {
            1: base,
            2: {k: np.nextafter(v * 1.5, np.float32(np.inf)) for k, v in base.items()},
        },
        RUN_FOLDERS[2]: {s: {k: v + s for k, v in base.items()} for s in (1, 2)},
    }
    for folder, by_step in steps.items():
        (root / "runs" / folder).mkdir(parents=True)
        for step, tensors in by_step.items():
            path = root / "runs" / folder / f"ckpt-{step:04d}.safetensors"
            safetensors_numpy.save_file(tensors, str(path))
    x = torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(5))
    rows = [(REQUEST, j) for j in range(8)]
    for folder, plant in zip(CAPTURE_FOLDERS, (False, True), strict=True):
        model = Hostile(plant)
        with (
            torch.no_grad(),
            dmlib.capture(model, root / "cap" / folder, row_map=rows, block_rows=4, dump="*"),
        ):
            model(x)
    q = json.dumps
    runs = "".join(
        f"{q(k)} = {q('runs/' + f + '/')}\n" for k, f in zip(LABELS, RUN_FOLDERS, strict=True)
    )
    caps = "".join(
        f"{q(k)} = {q('cap/' + f)}\n" for k, f in zip(CAPTURE_LABELS, CAPTURE_FOLDERS, strict=True)
    )
    (root / "study.toml").write_text(
        f"title = {q(TITLE)}\nmade_on = {q(MADE_ON)}\ncontrol = {q(LABELS[2])}\n"
        f"reference = {q(LABELS[0])}\n\n[runs]\n{runs}\n[captures]\nrequest = {q(REQUEST)}\n"
        f"reference = {q(CAPTURE_LABELS[0])}\n\n[captures.folders]\n{caps}",
        encoding="utf-8",
    )
    return root


def _plant_stale(folder: Path, pid: int | None) -> None:
    folder.mkdir()
    (folder / "left.txt").write_text("left by a run")
    if pid is not None:
        owner = {"pid": pid, "host": socket.gethostname()}
        (folder / ".dmlib-owner.json").write_text(json.dumps(owner))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """The hostile study, reported once (every notebook), kernels' temporary folder private."""
    base = tmp_path_factory.mktemp("hostile")
    torch.set_num_threads(1)
    root = make_study(base)
    tmp = base / "tmp"
    tmp.mkdir()
    out = base / "shared" / "report"
    out.parent.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    stale = {
        "dead": out.parent / ".report.partial-dead",
        "live": out.parent / ".report.partial-live",
        "unowned": out.parent / ".report.partial-unowned",
        "kernel_dead": tmp / "dmlib-kernel-dead",
    }
    _plant_stale(stale["dead"], _dead_pid())
    _plant_stale(stale["live"], live.pid)
    _plant_stale(stale["unowned"], None)
    _plant_stale(stale["kernel_dead"], _dead_pid())
    before = tree_digest(root)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tempfile, "tempdir", str(tmp))
            rc = cli(["report", str(root / "study.toml"), "--out", str(out), "--jobs", "2"])
    finally:
        live.kill()
        live.wait()
    left = {k: v.exists() for k, v in stale.items()}
    return {"rc": rc, "root": root, "out": out, "before": before, "left": left, "tmp": tmp}


class Scan(HTMLParser):
    """Everything a browser could run, and the visible text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.bad: list[str] = []
        self.styles = 0
        self.text: list[str] = []
        self.h1: list[str] = []
        self._skip = 0
        self._in_h1 = False

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "iframe", "object", "embed", "base", "form", "meta") and not (
            tag == "meta" and all(k in ("charset", "name", "content") for k, _ in attrs)
        ):
            self.bad.append(f"<{tag}>")
        if tag == "style":
            self.styles += 1
            self._skip += 1
        if tag == "h1":
            self._in_h1 = True
        for k, v in attrs:
            value = re.sub(r"[\x00-\x20]", "", v or "").lower()
            if k.lower().startswith("on"):
                self.bad.append(f"<{tag} {k}=>")
            if "javascript:" in value or "vbscript:" in value:
                self.bad.append(f"<{tag} {k}={v!r}>")
            if (
                k in ("href", "src")
                and value.startswith("data:")
                and not (tag == "img" and value.startswith("data:image/"))
            ):
                self.bad.append(f"<{tag} {k}={v[:40]!r}>")

    def handle_endtag(self, tag):
        if tag == "style":
            self._skip -= 1
        if tag == "h1":
            self._in_h1 = False

    def handle_data(self, data):
        if not self._skip:
            self.text.append(data)
        if self._in_h1:
            self.h1.append(data)


def scan(path: Path) -> Scan:
    s = Scan()
    s.feed(path.read_text(encoding="utf-8"))
    s.close()
    return s


# ---------------------------------------------------------------------------
# 1. a shared report runs no script from its data


@pytest.mark.slow
def test_hostile_study_reports_and_its_inputs_are_untouched(hostile):
    assert hostile["rc"] == 0
    assert tree_digest(hostile["root"]) == hostile["before"]
    summary = json.loads((hostile["out"] / "summary.json").read_text())
    assert [r["status"] for r in summary["results"] if r["status"] != "skipped"] == ["ok"] * 5


@pytest.mark.slow
def test_no_page_holds_a_script_an_event_attribute_or_a_javascript_url(hostile):
    pages = sorted(hostile["out"].glob("*.html"))
    assert len(pages) == 7  # index, report and five notebooks
    for page in pages:
        s = scan(page)
        assert s.bad == [], (page.name, s.bad[:5])
        assert s.styles == 1, page.name  # the report's own stylesheet, nothing from the data


@pytest.mark.slow
def test_every_hostile_string_shows_as_text(hostile):
    out = hostile["out"]
    text = {p.stem: "".join(scan(p).text) for p in out.glob("*.html")}
    index = scan(out / "index.html")
    assert "".join(index.h1) == visible(TITLE)
    expected = {
        "index": [MADE_ON, *LABELS, *CAPTURE_LABELS, REQUEST]
        + [f"runs/{f}/ckpt-0002.safetensors" for f in RUN_FOLDERS]
        + [f"cap/{f}" for f in CAPTURE_FOLDERS],
        # the tensor table: pandas cuts a cell at 50 characters (display.max_colwidth)
        "checkpoint_anatomy": [t[:40] for t in TENSORS]
        + [f"runs/{RUN_FOLDERS[0]}/ckpt-0002.safetensors"],
        "run_matrix": LABELS,
        "step_growth": [*LABELS[:2]],
        "capture_boundaries": [*MODULES, *CAPTURE_LABELS],
    }
    for page, strings in expected.items():
        for s in strings:
            assert visible(s) in text[page], (page, s)
    # the code spans held: the finding quotes the capture's culprit (the planted module)
    numbers = json.loads((out / "numbers" / "capture_boundaries.json").read_text())
    assert numbers["culprit"] == MODULES[0]
    assert f"culprit (inputs identical, output differs): {MODULES[0]}." in text["index"]
    for page in ("report", "index", "run_matrix"):  # run_matrix prints it (a stream output)
        assert visible(TITLE) in text[page], page
    for page in out.glob("*.html"):  # no control character left raw (an ANSI code as colour)
        assert not re.search(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]", page.read_text()), page


@pytest.mark.slow
def test_markdown_outputs_of_the_executed_notebooks_carry_no_raw_html(hostile):
    """The Markdown dmlib displays (findings, prose) holds the payloads only escaped."""
    import nbformat
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    n_markdown = 0
    for path in hostile["out"].glob("*.ipynb"):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
                md = o.get("data", {}).get("text/markdown")
                if md is None:
                    continue
                n_markdown += 1
                s = Scan()
                s.feed(markdown2html_mistune(md))  # the renderer nbconvert uses, unsanitised
                assert s.bad == [], (path.name, md[:200])
                assert not re.search(
                    r"<(?!/?(p|code|ul|li|strong|em|blockquote)>)", markdown2html_mistune(md)
                ), md[:200]
    assert n_markdown >= 10


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.slow
def test_chromium_runs_no_payload(hostile, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip(
            "no Chromium installed (Debian: apt-get install chromium; make test installs it)"
        )
    probe = (
        "<script>document.body.insertAdjacentHTML('beforeend','<pre>PROBE'+'RAN</pre>')</script>"
    )
    for name in ("report.html", "index.html", "capture_boundaries.html"):
        page = tmp_path / name  # a copy with the test's own probe: it shows scripts do run
        page.write_text((hostile["out"] / name).read_text().replace("</body>", probe + "</body>"))
        cmd = [
            browser, "--headless", "--no-sandbox", "--disable-gpu",
            "--disable-background-networking", "--no-first-run",
            f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000",
            "--dump-dom", page.as_uri(),
        ]  # fmt: skip
        dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
        assert "PROBERAN" in dom, (name, dom[-300:])
        assert "PWNED1" not in dom and "PWNED2" not in dom, name
        title = re.search(r"<title>(.*?)</title>", dom, re.S)
        assert title and "PWNED" not in title.group(1)
        assert "onerror=alert(1)" in dom  # a payload is there, as text


def test_escaping_survives_the_markdown_renderer():
    """Each payload through md_text / md_code and nbconvert's renderer: text, never markup."""
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    from dmlib.report.htmlsafe import md_code, md_inline_html, md_text

    tried = [*PAYLOADS.values(), WRITES_DOM, "`lead", "trail`", "# heading", "1. item", "$x$"]
    for p in tried:
        for md in (md_text(p), md_code(p)):
            rendered = markdown2html_mistune(f"* {md}")
            s = Scan()
            s.feed(rendered)
            assert s.bad == [] and "<img" not in rendered and "<a " not in rendered, (p, rendered)
            assert visible(p) in "".join(s.text).replace("\n", ""), (p, rendered)
        s = Scan()
        s.feed(md_inline_html(f"x {md_code(p)} and {md_text(p)}"))
        assert "".join(s.text) == f"x {visible(p)} and {visible(p)}"


def test_sanitiser_keeps_figures_and_drops_what_runs():
    from dmlib.report.htmlsafe import sanitize

    png = "data:image/png;base64,iVBORw0KGgo="
    dirty = (
        f'<p id="fig-a"><img src="{png}" alt="figure"></p><script>alert(1)</script>'
        '<img src=x onerror=alert(1)><a href="javascript:alert(1)">j</a>'
        '<a href="JaVaScRiPt&#58;alert(1)">k</a><a href="data:text/html,<script>alert(1)</script>">d</a>'
        "<svg onload=alert(1)><script>alert(1)</script></svg><style>*{}</style>"
        '<iframe src="https://example.org"></iframe><div onclick="alert(1)">t</div>'
        '<a href="#fig-a">ok</a>\x1b'
    )
    clean = sanitize(dirty)
    s = Scan()
    s.feed(clean)
    assert s.bad == [] and s.styles == 0
    assert f'<img src="{png}" alt="figure">' in clean and 'href="#fig-a"' in clean
    assert "<iframe" not in clean and "\\x1b" in clean and "\x1b" not in clean


def test_collection_index_escapes_folder_names_and_percent_encodes_links(tmp_path):
    from dmlib.cli.report import _write_collection
    from dmlib.report.runner import NotebookResult
    from dmlib.report.study import from_dict

    name = PAYLOADS["img"] + PAYLOADS["backticks"] + "#?%"
    np.save(tmp_path / "a.npy", np.zeros(3, np.float32))
    study = from_dict(
        {"title": TITLE, "runs": {"a": "a.npy"}}, root=tmp_path, path=tmp_path / "study.toml"
    )
    res = NotebookResult(name="nb", ok=True, seconds=0.0)
    res.numbers = {"finding": "`" + PAYLOADS["script"] + "` " + PAYLOADS["link"]}
    out = tmp_path / "reports"
    _write_collection(out, [(study, out / name, [res])], fresh=True)
    page = out / "index.html"
    s = scan(page)
    assert s.bad == []
    hrefs = re.findall(r'href="([^"]+)"', page.read_text())
    quoted = "%3Cimg%20src%3Dx%20onerror%3Dalert%281%29%3Ea%60b%60%60c%60%23%3F%25"
    assert hrefs == [f"{quoted}/index.html", f"{quoted}/report.html"]
    assert visible(TITLE) in "".join(s.text) and f"{name}/report.html" in "".join(s.text)
    assert (out / ".dmlib-reports.json").is_file()


# ---------------------------------------------------------------------------
# 2. --out never deletes what dmlib did not write


def _refused(args: list[str], watched: Path, capsys) -> str:
    before = tree_digest(watched)
    assert cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing was" in err[0], err
    assert tree_digest(watched) == before
    return err[0]


@pytest.fixture
def small_study(tmp_path):
    root = tmp_path / "mine"
    (root / "runs" / "a").mkdir(parents=True)
    for step in (1, 2):
        t = {"w": np.full((3,), step, dtype=np.float32)}
        safetensors_numpy.save_file(t, str(root / "runs" / "a" / f"ckpt-{step:04d}.safetensors"))
    safetensors_numpy.save_file({"w": np.zeros(3, np.float32)}, str(root / "b.safetensors"))
    (root / "notes.md").write_text("the user's notes")
    (root / "study.toml").write_text('title = "mine"\n[runs]\na = "runs/a/"\nb = "b.safetensors"\n')
    return root


def test_out_never_replaces_the_study_folder_or_an_input(small_study, tmp_path, capsys):
    study = str(small_study / "study.toml")
    for out in (small_study, small_study / "runs", small_study / "runs" / "a", tmp_path):
        err = _refused(["report", study, "--out", str(out)], tmp_path, capsys)
        assert "input" in err


def test_out_never_replaces_a_folder_dmlib_did_not_mark(small_study, tmp_path, capsys):
    study = str(small_study / "study.toml")
    only_summary = tmp_path / "looks_like_a_report"
    only_summary.mkdir()
    (only_summary / "summary.json").write_text("{}")
    _refused(["report", study, "--out", str(only_summary)], only_summary, capsys)


def test_collection_index_is_not_written_into_an_unrelated_folder(small_study, tmp_path, capsys):
    other = tmp_path / "other"
    shutil.copytree(small_study, other)
    mine = tmp_path / "existing"
    mine.mkdir()
    (mine / "index.html").write_text("the user's own index")
    args = [
        "report",
        str(small_study / "study.toml"),
        str(other / "study.toml"),
        "--out",
        str(mine),
    ]
    _refused(args, tmp_path, capsys)


def test_an_earlier_report_is_replaced_but_not_when_the_user_added_a_file(
    small_study, tmp_path, capsys
):
    # only a notebook the study has no data for: the report is written without a kernel
    args = ["report", str(small_study / "study.toml"), "--only", "qr_first_divergent_column"]
    out = tmp_path / "rep"
    assert cli([*args, "--out", str(out)]) == 0
    marker = json.loads((out / ".dmlib-report.json").read_text())
    assert marker["title"] == "mine" and "summary.json" in marker["files"]
    assert cli([*args, "--out", str(out)]) == 0  # dmlib's own report: replaced
    (out / "figures").mkdir(exist_ok=True)
    (out / "figures" / "my_plot.png").write_bytes(b"mine")
    capsys.readouterr()
    err = _refused([*args, "--out", str(out)], tmp_path, capsys)
    assert "my_plot.png" in err


# ---------------------------------------------------------------------------
# 3. temporary folders go on every exit path


@pytest.mark.slow
def test_stale_folders_of_dead_runs_are_removed_and_only_those(hostile):
    assert hostile["left"] == {
        "dead": False,  # its owner process is gone: removed
        "live": True,  # its owner is alive: kept
        "unowned": True,  # no owner file: not provably dmlib's, kept
        "kernel_dead": False,
    }
    assert not list(hostile["out"].parent.glob(".report.old-*"))
    assert not list(hostile["tmp"].glob("dmlib-kernel-*"))


def _slow_notebooks(folder: Path) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook()
    params = "STUDY = 'x'\nFIGURE_DIR = 'f'\nSMALL = False"
    nb.cells = [
        nbformat.v4.new_code_cell(params, metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell("import time\nprint('started', flush=True)\ntime.sleep(120)"),
    ]
    folder.mkdir()
    nbformat.write(nb, folder / "slow.ipynb")
    return folder


def _sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_report(small_study: Path, tmp_path: Path, out: Path) -> tuple[subprocess.Popen, Path]:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(REPO)}
    nbs = _slow_notebooks(tmp_path / "nbs")
    cmd = [sys.executable, "-m", "dmlib", "report", str(small_study / "study.toml")]
    cmd += ["--out", str(out), "--notebooks", str(nbs)]
    # SIGINT at its default in the child (see test_security_exitcodes.default_sigint)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint)
    deadline = time.monotonic() + 90
    while not list(tmp.glob("dmlib-kernel-*/kernel-0.json")):  # the kernel is starting
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(3)
    return proc, tmp


@pytest.mark.slow
def test_ctrl_c_exits_130_with_one_line_and_leaves_nothing(small_study, tmp_path):
    out = tmp_path / "rep"
    proc, tmp = _start_report(small_study, tmp_path, out)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err
    lines = [ln for ln in err.splitlines() if not ln.startswith(("running ", "slow: skipped"))]
    assert lines == ["dmlib report: interrupted"], err  # one line naming the command
    assert not out.exists() and not list(tmp_path.glob(".rep.*"))
    assert not list(tmp.glob("dmlib-kernel-*"))


@pytest.mark.slow
def test_after_kill_9_the_next_run_removes_what_the_dead_run_left(small_study, tmp_path):
    out = tmp_path / "rep"
    proc, tmp = _start_report(small_study, tmp_path, out)
    proc.kill()
    proc.communicate(timeout=60)
    assert list(tmp_path.glob(".rep.partial-*")) and list(tmp.glob("dmlib-kernel-*"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tempfile, "tempdir", str(tmp))
        args = ["report", str(small_study / "study.toml"), "--out", str(out)]
        assert cli([*args, "--only", "qr_first_divergent_column"]) == 0
        assert not list(tmp_path.glob(".rep.partial-*"))
        from dmlib.report.runner import run_notebooks

        nbs = tmp_path / "quick"
        nbs.mkdir()
        import nbformat

        nbformat.write(
            nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")]), nbs / "q.ipynb"
        )
        (res,) = run_notebooks([nbs / "q.ipynb"], tmp_path, {})
        assert res.ok
    assert not list(tmp.glob("dmlib-kernel-*"))


# ---------------------------------------------------------------------------
# 4. a title with control characters


def test_control_characters_in_a_title_give_a_valid_study_toml(tmp_path):
    from dmlib.report.study import from_dict
    from dmlib.report.studyfile import resolved_toml

    title = "ctl \x7f \x1b[31m \x00 \x85 \u2028 \t end"
    np.save(tmp_path / "a.npy", np.zeros(3, np.float32))
    study = from_dict(
        {"title": title, "runs": {"a": "a.npy"}}, root=tmp_path, path=tmp_path / "study.toml"
    )
    text = resolved_toml(study, tmp_path)
    assert tomllib.loads(text)["title"] == title
    assert "\x7f" not in text and "\\u007f" in text


# ---------------------------------------------------------------------------
# 5. a failing notebook's error, quoted in the index, names no path of this machine


@pytest.mark.slow
def test_a_failed_notebooks_error_in_the_index_names_no_machine_path(small_study, tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "STUDY = 'x'\nFIGURE_DIR = 'f'\nSMALL = False", metadata={"tags": ["parameters"]}
        ),
        nbformat.v4.new_code_cell(
            "import os\nfrom dmlib import report\nstudy = report.load_study(STUDY)\n"
            "raise ValueError(str(study.root / 'runs') + ' ' + os.path.join(os.getcwd(), 'x'))"
        ),
    ]
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    nbformat.write(nb, nbs / "fails.ipynb")
    out = tmp_path / "rep"
    args = ["report", str(small_study / "study.toml"), "--out", str(out), "--notebooks", str(nbs)]
    assert cli(args) == 1
    summary = json.loads((out / "summary.json").read_text())
    (row,) = summary["results"]
    assert row["status"] == "FAILED" and row["error"].startswith("ValueError: ")
    for page in ("index.html", "report.html", "summary.json"):
        text = (out / page).read_text()
        assert str(small_study) not in text and str(tmp_path) not in text, page
    assert "<study>/runs" in row["error"]


# ---------------------------------------------------------------------------
# 6. the fields added since: mapping labels and files, Trainer run folders and their
# trainer_state.json keys, Orbax tree paths, op names, router and state boundaries

# a tree path or folder cannot hold "/": the payloads that a file name can carry
R2 = [PAYLOADS["script"].replace("/", "|"), PAYLOADS["img"], PAYLOADS["backticks"] + "{{x}}",
      "[x](javascript&colon;alert(1))" + PAYLOADS["ansi"]]  # fmt: skip
R2_LABEL = "<script>alert(1)<script>mapped{{x}}"  # a run label holds no / \ = or space
R2_TRAINER = PAYLOADS["img"] + "{{7-7}}"  # a run folder holds no * ? [ (a glob)


def _cells(name: str) -> list[str]:
    import nbformat

    nb = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _run_cells(name: str, study: Path, figures: Path, shown: list[str]) -> None:
    """Each code cell of a report notebook in this process, as its kernel runs it: what
    the cell shows (its last expression: a table as pandas renders it for the page)
    joins the Markdown the notebook displayed in ``shown``, as HTML."""
    import ast

    import pandas as pd
    from nbconvert.filters.markdown_mistune import markdown2html_mistune

    env: dict = {}
    for i, src in enumerate(_cells(name)):
        if i == 0:
            env.update(STUDY=str(study), FIGURE_DIR=str(figures), SMALL=False)
            continue
        tree = ast.parse(src)
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, name, "exec"), env)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), name, "eval"), env)
            if isinstance(value, (pd.DataFrame, pd.Series)):
                shown.append(value.to_frame()._repr_html_() if isinstance(value, pd.Series)
                             else value._repr_html_())  # fmt: skip
    shown[:] = [markdown2html_mistune(s) if not s.lstrip().startswith("<") else s for s in shown]


def _round_two_study(root: Path) -> Path:
    """Runs: a Trainer output folder and a converted run through a mapping; anatomy: an
    Orbax item and the Trainer checkpoint; captures (module and op level) of a model whose
    module names are payloads, with a router and a state boundary named by payloads."""
    from _support import orbax_hostile as oh

    import dmlib

    root.mkdir()
    names = {"w": np.arange(4, dtype=np.float32)}
    trainer = root / "runs" / R2_TRAINER
    for step in (1, 2):
        ck = trainer / f"checkpoint-{step}"
        ck.mkdir(parents=True)
        safetensors_numpy.save_file({"w": names["w"] * step}, str(ck / "model.safetensors"))
        history = [{"step": step, **{p: float(step) for p in R2}}]
        (ck / "trainer_state.json").write_text(
            json.dumps({"global_step": step, R2[1]: R2[0], "log_history": history})
        )
    conv = root / "conv"
    conv.mkdir()
    for step in (1, 2):
        safetensors_numpy.save_file({R2[1]: names["w"] * step},
                                    str(conv / f"ckpt-{step:04d}.safetensors"))  # fmt: skip
    (root / "maps").mkdir()
    mapfile = root / "maps" / (R2[2] + ".toml")
    mapfile.write_text(  # the reference's trainer.* tensors are none of the converted run's
        f'version = 1\nignore_b = ["trainer.*"]\n[[rule]]\nsource = {json.dumps(R2[1])}\n'
        f'target = "w"\nnote = {json.dumps(R2[0])}\n'
    )
    orbax = root / "orbax" / R2[3]
    oh.item(orbax, {p: oh.zarray([4], [4], compressor=None) for p in R2},
            {f"{p}/0": names["w"].tobytes() for p in R2})  # fmt: skip
    x = torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(5))
    rows = [(REQUEST, j) for j in range(8)]
    for folder, plant in (("ref", False), ("nudged", True)):
        for ops in (False, True):
            model = Hostile(plant)
            where = root / "cap" / (("ops-" if ops else "") + folder)
            # dumped: the capture page lists the differing boundaries with their sizes
            with torch.no_grad(), dmlib.capture(model, where, row_map=rows, ops=ops, dump="*"):
                model(x)
    q = json.dumps
    runs = (
        f"ref = {q('runs/' + R2_TRAINER)}\norb = [{q('orbax/' + R2[3])}]\n{q(R2_LABEL)} = "
        f'{{ path = "conv/", mapping = {q("maps/" + mapfile.name)} }}\n'
    )
    caps = (
        f'[captures]\nrequest = {q(REQUEST)}\nreference = "ref"\n\n[captures.folders]\n'
        f'ref = "cap/ref"\nnudged = "cap/nudged"\n\n[captures.ops]\n'
        f'ref = "cap/ops-ref"\nnudged = "cap/ops-nudged"\n'
    )
    for reference in ("ref", "orb"):  # the anatomy shows the reference run's checkpoint
        (root / f"study_{reference}.toml").write_text(
            f"title = {q('round two ' + R2[0])}\nreference = {q(reference)}\n\n[runs]\n{runs}\n"
            + caps,
            encoding="utf-8",
        )
    return root


def _with_router_and_state(capture: Path) -> None:
    """A router and a state boundary added to a capture's manifest, named by payloads (no
    capture records these kinds yet: a shared capture may still carry them)."""
    manifest = capture / "manifest.json"
    doc = json.loads(manifest.read_text())
    entries = doc["boundaries"]
    out = next(e for e in entries if e.get("kind") == "output" and not e.get("op"))
    for marker, name in (("router", f"{R2[1]}:router#0"), ("state", f"{R2[0]}:state.h#0")):
        entries.append({**out, "name": name, marker: True})
    manifest.write_text(json.dumps(doc))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Glyph:UserWarning")  # a figure's title: a PNG, no HTML
def test_round_two_fields_reach_the_report_escaped(tmp_path, monkeypatch):
    from dmlib.report import notebook

    root = _round_two_study(tmp_path / ("study " + PAYLOADS["img"]))
    for folder in ("ref", "nudged"):
        _with_router_and_state(root / "cap" / folder)
    shown: list[str] = []
    monkeypatch.setattr(notebook, "_display_markdown", shown.append)
    monkeypatch.setenv("DMLIB_CACHE_DIR", str(tmp_path / "cache"))
    pages = {}
    for name, study in (("checkpoint_anatomy", "ref"), ("anatomy_orbax", "orb"),
                        ("run_matrix", "ref"), ("capture_boundaries", "ref")):  # fmt: skip
        shown.clear()
        nb = "checkpoint_anatomy" if name == "anatomy_orbax" else name
        _run_cells(nb, root / f"study_{study}.toml", tmp_path / "figures", shown)
        pages[name] = "\n".join(shown)
    from dmlib.report.htmlsafe import sanitize

    text = {}
    for name, html in pages.items():
        # escaped before the sanitiser (which the page then passes through, as the
        # report does: control characters become visible there)
        assert not re.search(r"<(img|script|a|svg|iframe)\b", html), name
        raw = Scan()
        raw.feed(html)
        raw.close()
        assert raw.bad == [], (name, raw.bad[:5])
        s = Scan()
        s.feed(sanitize(html))
        s.close()
        assert s.bad == [], (name, s.bad[:5])
        text[name] = "".join(s.text)
    for p in R2:  # Orbax tree paths; trainer_state.json keys as tensor names
        assert visible(p) in text["anatomy_orbax"], p
        assert visible(f"trainer.log_history.{p}"[:40]) in text["checkpoint_anatomy"], p
    assert visible(R2_LABEL) in text["run_matrix"]
    assert visible(R2_TRAINER) in text["checkpoint_anatomy"]
    for m in MODULES:  # module names, in the boundaries' and the ops' names
        assert visible(m) in text["capture_boundaries"], m
    for b in (
        f"{R2[1]}:router#0",
        f"{R2[0]}:state.h#0",
        f"{MODULES[0]}/aten.",
    ):  # the culprit's ops
        assert visible(b) in text["capture_boundaries"], b
