"""HTML of a report: one page per notebook, the index, and one self-contained file.

Pages use nbconvert's ``basic`` template (the notebook's body, no scripts) inside a page
of our own with a small inline stylesheet: nothing is fetched from the network, and a
figure is the PNG the notebook saved, embedded as a ``data:`` URI where the notebook
shows it. Every string from the data is escaped where it is written
(:mod:`dmlib.report.htmlsafe`), and every page body is then passed through the
sanitiser, so a finished page holds no script, no event attribute and no
``javascript:`` URL, whatever the checkpoints' names say.
"""

from __future__ import annotations

import base64
import logging
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dmlib.report.htmlsafe import esc, href, md_inline_html, sanitize

__all__ = ["index_page", "notebook_body", "notebook_page", "single_page"]

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;max-width:1100px;
margin:2em auto;padding:0 1em;color:#222;line-height:1.45}
h1,h2,h3{line-height:1.2} a{color:#0645ad}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}
td,th{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:top}
pre{background:#f6f8fa;padding:.5em;overflow-x:auto;font-size:.85em}
.jp-InputArea-editor,.input_area{background:#f6f8fa}
.jp-InputPrompt,.jp-OutputPrompt,.prompt{display:none}
.jp-RenderedImage img,.output_png img{max-width:100%;height:auto}
.thumbs img{height:110px;border:1px solid #ccc;margin:2px}
.finding{margin:.2em 0 .6em 0} .status-FAILED{color:#b00;font-weight:bold}
.status-skipped{color:#777} .note{color:#555;font-size:.9em}
details{margin:.5em 0} code{background:#f6f8fa;padding:0 .2em}
.nb{border-top:3px solid #ccc;margin-top:2.5em;padding-top:.5em}
"""


def page(title: str, body: str) -> str:
    """A whole page: our head (title escaped, our stylesheet), the body sanitised."""
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{CSS}</style></head>\n"
        f"<body>\n{sanitize(body)}\n</body></html>\n"
    )


def notebook_body(nb: Any) -> str:
    """The executed notebook as HTML (nbconvert ``basic``: no scripts, images inline)."""
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(
        template_name="basic", exclude_input_prompt=True, exclude_output_prompt=True
    )
    # nbconvert gives an image without alt text a placeholder and logs a warning per page;
    # every image here is a figure the notebook saved, and says so
    exporter.log.setLevel(logging.ERROR)
    body, _ = exporter.from_notebook_node(parameters_as_run(_visible_streams(nb)))
    return body.replace('alt="No description has been provided for this image"', 'alt="figure"')


def _visible_streams(nb: Any) -> Any:
    """A copy of ``nb`` whose printed text shows control characters as ``\\xNN``.

    What a notebook prints holds names from the data; nbconvert would turn an ANSI escape
    sequence in one into colour (hiding it). Tracebacks (error outputs) keep their colours.
    """
    import copy

    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if out.get("output_type") == "stream" and isinstance(out.get("text"), str):
                out["text"] = _STREAM_HIDDEN.sub(lambda m: f"\\x{ord(m.group(0)):02x}", out["text"])
    return nb


_STREAM_HIDDEN = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")

PARAMETERS_HEADER = "# Parameters as this report ran the notebook"


def parameters_as_run(nb: Any) -> Any:
    """``nb`` with its parameters shown once, as the report ran them.

    The parameters cell keeps its defaults and the runner's injected cell after it
    overrides them (papermill's convention); a reader would see both, defaults first. Here
    the parameters cell's assignments of injected names take the injected values, its
    leading comment (how to change them) gives way to one header line, and the injected
    cell is dropped. Outputs are untouched; ``nb`` is changed in place and returned.
    """
    import ast

    from dmlib.report.runner import INJECTED_TAG

    tags = [c.get("metadata", {}).get("tags", []) for c in nb.cells]
    inj = next((i for i, t in enumerate(tags) if INJECTED_TAG in t), None)
    par = next(
        (
            i
            for i, (c, t) in enumerate(zip(nb.cells, tags))
            if c.cell_type == "code" and "parameters" in t
        ),
        None,
    )
    if inj is None or par is None:
        return nb
    try:
        injected = _assignments(ast.parse(nb.cells[inj].source), nb.cells[inj].source)
        tree = ast.parse(nb.cells[par].source)
    except SyntaxError:
        return nb
    lines = nb.cells[par].source.splitlines()
    out = [PARAMETERS_HEADER]
    first = tree.body[0].lineno if tree.body else len(lines) + 1
    skip_to = 0
    starts = {}
    for node in tree.body:
        names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        if len(names) == 1 and names[0] in injected:
            starts[node.lineno] = (node.end_lineno or node.lineno, names[0])
    for n, line in enumerate(lines, start=1):
        if n < first or n <= skip_to:
            continue
        if n in starts:
            skip_to, name = starts[n]
            out.append(f"{name} = {injected[name]}")
            continue
        out.append(line)
    nb.cells[par].source = "\n".join(out)
    del nb.cells[inj]
    return nb


def _assignments(tree: Any, source: str) -> dict[str, str]:
    """``NAME = value`` statements of a cell: name -> the value's source text."""
    import ast

    out = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            out[node.targets[0].id] = ast.get_source_segment(source, node.value) or ""
    return out


def notebook_page(title: str, body: str) -> str:
    """A notebook's page: :func:`page` with a link back to ``index.html`` above ``body``."""
    nav = '<p><a href="index.html">&larr; index</a></p>'
    return page(title, nav + body)


def _esc(x: Any) -> str:
    return esc(x)


def _study_html(summary: Mapping[str, Any]) -> str:
    rows = []
    for r in summary["runs"]:
        role = ", ".join(r["roles"]) or ""
        rows.append(
            f"<tr><td>{_esc(r['label'])}</td><td>{_esc(role)}</td><td>{r['n_checkpoints']}</td>"
            f"<td>{_esc(r['steps'])}</td><td><code>{_esc(r['path'])}</code></td></tr>"
        )
    parts = (
        [
            "<h2>Runs</h2><table><tr><th>run</th><th>role</th><th>checkpoints</th><th>steps</th>"
            "<th>path (relative to the study)</th></tr>",
            *rows,
            "</table>",
        ]
        if rows  # a study of captures only has no run: no empty table
        else []
    )
    if summary.get("captures"):
        parts.append("<h2>Captures</h2>")
        c = summary["captures"]
        parts.append(
            f"<p>Captures of request <code>{_esc(c['request'])}</code>: "
            + ", ".join(f"{_esc(k)} (<code>{_esc(v)}</code>)" for k, v in c["folders"].items())
            + f"; compared against <b>{_esc(c['reference'])}</b>"
            + (
                "; op level: "
                + " vs ".join(f"{_esc(k)} (<code>{_esc(v)}</code>)" for k, v in c["ops"].items())
                if c.get("ops")
                else ""
            )
            + ".</p>"
        )
    return "\n".join(parts)


def _notebooks_html(
    results: Sequence[Mapping[str, Any]],
    thumbs: Mapping[str, list[str]],
    link: Any,
    *,
    figure_links: Mapping[str, list[str]] | None = None,
) -> str:
    parts = ["<h2>Notebooks</h2>"]
    for r in results:
        status = r["status"]
        head = (
            f'<h3><a href="{link(r["name"])}">{_esc(r["name"])}</a>'
            if status != "skipped"
            else f"<h3>{_esc(r['name'])}"
        )
        head += f' <span class="status-{status}">{_esc(status)}</span></h3>'
        parts.append(head)
        if status == "skipped":
            parts.append(f'<p class="note">Not run: {_esc(r["skipped"])}.</p>')
            continue
        if status == "FAILED":
            parts.append(
                f'<p class="status-FAILED">cell {r["failed_cell"]}: {_esc(r["error"])}</p>'
            )
        if r.get("finding"):
            # a finding is Markdown (names in code spans, the rest escaped text)
            text = md_inline_html(r["finding"])
            parts.append(f'<p class="finding">{text}</p>')
        if r.get("skipped_sections"):
            parts.append(
                '<p class="note">Sections skipped: '
                + "; ".join(_esc(s) for s in r["skipped_sections"])
                + "</p>"
            )
        if thumbs.get(r["name"]):
            imgs = "".join(
                f'<a href="{link(r["name"])}"><img src="{src}" alt="{_esc(r["name"])} figure"></a>'
                for src in thumbs[r["name"]]
            )
            parts.append(f'<div class="thumbs">{imgs}</div>')
        linked = (figure_links or {}).get(r["name"])
        if linked:
            refs = ", ".join(f'<a href="{_fragment("fig-" + f)}">{_esc(f)}</a>' for f in linked)
            parts.append(f'<p class="figlinks">Figures: {refs}</p>')
    return "\n".join(parts)


def _provenance_html(prov: Mapping[str, Any]) -> str:
    versions = ", ".join(f"{_esc(k)} {_esc(v)}" for k, v in prov["versions"].items())
    torch = prov.get("torch")
    if torch is None:
        torch_line = "PyTorch: not installed"
    elif "error" in torch:
        torch_line = f"PyTorch: {_esc(torch['error'])}"
    else:
        torch_line = (
            f"PyTorch {_esc(torch['torch'])}, ATen CPU capability {_esc(torch['cpu_capability'])}, "
            f"{_esc(torch['threads'])} threads"
        )
    rows = "".join(
        f"<tr><td><code>{_esc(f['path'])}</code></td><td>{f['bytes']:,}</td><td><code>{_esc(f['sha256'])}</code></td></tr>"
        for f in prov["inputs"]
    )
    return (
        "<h2>Provenance</h2>"
        f"<p>{versions}.<br>{_esc(prov['platform'])}, CPU: {_esc(prov['cpu'])} "
        f"({_esc(prov['cpu_count'])} logical). {torch_line}.</p>"
        f"<details><summary>sha256 of the {len(prov['inputs'])} input files</summary>"
        f"<table><tr><th>file</th><th>bytes</th><th>sha256</th></tr>{rows}</table></details>"
    )


def _header(summary: Mapping[str, Any]) -> str:
    ok = sum(r["status"] == "ok" for r in summary["results"])
    ran = sum(r["status"] != "skipped" for r in summary["results"])
    made_on = summary.get("made_on")
    machine = (
        f"<p>Runs made on: <b>{_esc(made_on)}</b>. Every finding below is what these files show; "
        "floating-point results depend on the machine (CPU, instruction set, library builds, threads).</p>"
        if made_on
        else "<p>The study does not record the machine that made the runs (<code>made_on</code>): "
        "the findings below are what these files show, and floating-point results depend on that "
        "machine (CPU, instruction set, library builds, threads).</p>"
    )
    if summary["runs"]:
        counts = f"{len(summary['runs'])} runs" + (
            f", control <b>{_esc(summary['control'])}</b>"
            if summary.get("control")
            else ", no control declared"
        )
    else:
        counts = "Captures only, no checkpoint runs"
    return (
        f"<h1>{_esc(summary['title'])}</h1>"
        f"<p>{counts}"
        + f". {ok} of {ran} notebooks ran without error"
        + f"; the study: <code>study.toml</code> beside this page. Made by dmlib {_esc(summary['dmlib'])}.</p>"
        + machine
    )


def _fragment(anchor: str) -> str:
    """``href`` of an element whose ``id`` is ``anchor`` (written with :func:`esc`)."""
    return esc("#" + urllib.parse.quote(anchor, safe=""))


def index_page(summary: Mapping[str, Any], figures: Path) -> str:
    """``index.html``: title, runs and control, per notebook its finding and thumbnails."""
    thumbs = {
        r["name"]: [
            href(f"figures/{f}.png")
            for f in r.get("figures", [])
            if (figures / f"{f}.png").is_file()
        ]
        for r in summary["results"]
    }
    body = (
        _header(summary)
        + '<p>The whole report in one file: <a href="report.html">report.html</a>.</p>'
        + _study_html(summary)
        + _notebooks_html(summary["results"], thumbs, lambda n: href(f"{n}.html"))
        + _provenance_html(summary["provenance"])
    )
    return page(summary["title"], body)


def single_page(summary: Mapping[str, Any], bodies: Mapping[str, str], figures: Path) -> str:
    """``report.html``: the index and every notebook in one file, figures embedded once.

    Each figure's bytes appear once, inline where its notebook shows it; the index part
    links to it by name (``#fig-NAME``) instead of repeating it as a thumbnail, which
    would double the file's size.
    """
    links: dict[str, list[str]] = {}
    sections = []
    for name, body in bodies.items():
        result: Mapping[str, Any] = next((r for r in summary["results"] if r["name"] == name), {})
        body, anchored = _anchor_figures(body, result.get("figures", []), figures)
        links[name] = anchored
        sections.append(f'<section class="nb" id="nb-{_esc(name)}">{body}</section>')
    body = (
        _header(summary)
        + _study_html(summary)
        + _notebooks_html(
            summary["results"], {}, lambda n: _fragment(f"nb-{n}"), figure_links=links
        )
        + _provenance_html(summary["provenance"])
        + "\n".join(sections)
    )
    return page(summary["title"], body)


_IMG = re.compile(r'<img\b([^>]*?)src="data:image/png;base64,([^"]+)"')


def _anchor_figures(body: str, names: Sequence[str], figures: Path) -> tuple[str, list[str]]:
    """Give each inline image that is one of ``names``' PNG files the id ``fig-NAME``."""
    by_bytes: dict[bytes, str] = {}
    for f in names:
        path = figures / f"{f}.png"
        if path.is_file():
            by_bytes.setdefault(path.read_bytes(), f)
    anchored: list[str] = []

    def tag(m: re.Match[str]) -> str:
        name = by_bytes.get(base64.b64decode(m.group(2)))
        if name is None or name in anchored:
            return m.group(0)
        anchored.append(name)
        return f'<img id="fig-{_esc(name)}"{m.group(1)}src="data:image/png;base64,{m.group(2)}"'

    return _IMG.sub(tag, body), anchored
