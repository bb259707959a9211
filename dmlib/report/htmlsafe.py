"""Strings from data in a shared report: escaped for Markdown and HTML, and a sanitiser.

A report is mailed to people who open it in a browser; every name, label, path, title
and metadata string in it comes from files dmlib did not write. Three lines of defence:

* :func:`md_text` and :func:`md_code` make a data string safe inside the Markdown the
  notebooks display (every ASCII punctuation character backslash-escaped; a code span
  fenced by more backticks than the string holds), so it can carry no HTML, no link and
  no emphasis, and cannot end the code span it sits in;
* :func:`esc` escapes a string for HTML text or a quoted attribute;
* :func:`sanitize` passes every finished page body through ``nh3`` (the ammonia HTML
  sanitiser) with an allow-list: no ``<script>``, no ``<style>`` but the page's own, no
  event attribute, no URL but relative ones, ``http(s)``/``mailto`` links and images as
  ``data:image/...`` URIs.

Control characters (C0, DEL, C1) are shown as visible ``\\xNN`` escapes in all three, so
an ANSI escape sequence in a tensor name reads as text, not as an invisible code.
"""

from __future__ import annotations

import html
import re
import urllib.parse
from typing import Any

__all__ = [
    "esc",
    "href",
    "md_code",
    "md_inline_html",
    "md_text",
    "sanitize",
    "visible",
]

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# CommonMark: any ASCII punctuation character may be backslash-escaped
_PUNCT = re.compile(r"([!-/:-@\[-`{-~])")
_ALWAYS = set("\\`*[]<>&$~|")
# what opens a block at the start of a line: a heading, a list item, a setext underline
_BLOCK_START = re.compile(r"^\s*(?:(#{1,6}|[+-])(?=\s|$)|([=-])[=\-\s]*$|\d{1,9}([.)])(?=\s|$))")


def visible(text: Any) -> str:
    """``text`` with every control character written as ``\\xNN`` (so it can be seen)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group(0)):02x}", str(text))


def esc(text: Any) -> str:
    """HTML text or attribute value: ``& < > " '`` escaped, control characters visible."""
    return html.escape(visible(text), quote=True)


def md_text(text: Any) -> str:
    """Plain text for Markdown: no markup, no HTML, no link can come out of it.

    Escaped with a backslash: ``\\ ` * [ ] < > & $ ~ |`` everywhere, ``_`` unless it
    joins two letters or digits (``alpha_again`` stays readable: an underscore inside a
    word opens no emphasis), and at the start a character that would open a block
    (``# x``, ``- x``, ``+ x``, ``1. x``, a line of ``=`` or ``-``); control characters
    become a visible ``\\xNN``.
    """
    s = str(text)
    out = []
    for i, ch in enumerate(s):
        if ch in _ALWAYS or (
            ch == "_" and not (0 < i < len(s) - 1 and s[i - 1].isalnum() and s[i + 1].isalnum())
        ):
            out.append("\\" + ch)
        elif _CONTROL.match(ch):
            out.append(f"\\\\x{ord(ch):02x}")
        else:
            out.append(ch)
    escaped = "".join(out)
    m = _BLOCK_START.match(escaped)
    if m:
        at = next(m.start(g) for g in (1, 2, 3) if m.group(g))
        escaped = escaped[:at] + "\\" + escaped[at:]
    return escaped


def md_code(text: Any) -> str:
    """``text`` as one Markdown code span, whatever backticks it holds.

    The fence is one backtick longer than the longest run of backticks inside (a code
    span ends only at a run of exactly its fence's length); the content is padded with a
    space when it starts or ends with a backtick or a space (CommonMark strips one from
    each side). Inside a code span the renderer escapes ``<``, ``>`` and ``&`` itself.
    """
    body = visible(text)
    runs = [len(r) for r in re.findall(r"`+", body)]
    fence = "`" * (max(runs, default=0) + 1)
    if body[:1] in ("`", " ") or body[-1:] in ("`", " "):
        body = f" {body} "
    return f"{fence}{body or ' '}{fence}"


def md_inline_html(text: Any) -> str:
    """HTML of a one-line Markdown finding built with :func:`md_text` / :func:`md_code`.

    Understands only code spans and backslash escapes (what the prose uses); everything
    else is text, escaped. Used for the index's copy of each notebook's finding.
    """
    src = str(text)
    out: list[str] = []
    i = 0
    plain: list[str] = []
    while i < len(src):
        ch = src[i]
        if ch == "\\" and i + 1 < len(src) and _PUNCT.match(src[i + 1]):
            plain.append(src[i + 1])
            i += 2
            continue
        if ch == "`":
            n = len(src) - i - len(src[i:].lstrip("`"))
            close = _closing_fence(src, i + n, n)
            if close is not None:
                code = src[i + n : close]
                if len(code) > 2 and code[0] == " " and code[-1] == " " and code.strip():
                    code = code[1:-1]
                out.append(esc("".join(plain)))
                plain = []
                out.append(f"<code>{esc(code)}</code>")
                i = close + n
                continue
            plain.append(src[i : i + n])
            i += n
            continue
        plain.append(ch)
        i += 1
    out.append(esc("".join(plain)))
    return "".join(out)


def _closing_fence(src: str, start: int, n: int) -> int | None:
    """Where the next run of exactly ``n`` backticks from ``start`` begins, or None."""
    for m in re.finditer(r"`+", src[start:]):
        if len(m.group(0)) == n:
            return start + m.start()
    return None


def href(path: str) -> str:
    """A relative link to ``path`` (``/``-separated): percent-encoded, then HTML-escaped.

    A leading segment that would read as a URL scheme (``javascript:``) is prefixed with
    ``./`` so the browser takes it as a path.
    """
    quoted = urllib.parse.quote(path, safe="/")
    if quoted.startswith("/") or ":" in quoted.split("/", 1)[0]:
        quoted = "./" + quoted.lstrip("/")
    return esc(quoted)


# ---------------------------------------------------------------------------
# the sanitiser

_TAGS = {
    "a", "abbr", "article", "b", "blockquote", "br", "caption", "code", "col", "colgroup",
    "dd", "del", "details", "div", "dl", "dt", "em", "figcaption", "figure", "h1", "h2",
    "h3", "h4", "h5", "h6", "hr", "i", "img", "ins", "kbd", "li", "main", "mark", "nav",
    "ol", "p", "pre", "q", "s", "samp", "section", "small", "span", "strong", "sub",
    "summary", "sup", "table", "tbody", "td", "tfoot", "th", "thead", "tr", "u", "ul",
    "var", "wbr",
}  # fmt: skip
# removed with everything inside them (not only the tags)
_DROP_WITH_CONTENT = {
    "script", "style", "svg", "math", "iframe", "object", "embed", "noscript", "template",
    "textarea", "select", "title", "frameset", "noembed", "xmp",
}  # fmt: skip
_ATTRIBUTES = {
    "*": {"class", "id", "title", "lang", "dir"},
    "a": {"href"},
    "img": {"src", "alt", "width", "height"},
    "td": {"colspan", "rowspan", "align"},
    "th": {"colspan", "rowspan", "align", "scope"},
    "table": {"border"},
    "ol": {"start"},
    "col": {"span"},
    "colgroup": {"span"},
}
# control characters but tab, newline and carriage return (the page's own layout)
_HIDDEN = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_IMAGE_URI = re.compile(r"^data:image/(png|jpeg|gif|webp|svg\+xml);base64,[A-Za-z0-9+/=\s]*$")


def _attribute(tag: str, name: str, value: str) -> str | None:
    """Per attribute: images only from ``data:image/...;base64`` or a relative path; no
    ``data:`` link (a ``data:text/html`` page runs script when opened)."""
    if name == "src":
        if value.startswith("data:"):
            return value if _IMAGE_URI.match(value) else None
        return None if ":" in value.split("/", 1)[0] else value
    if name == "href" and value.strip().lower().startswith("data:"):
        return None
    return value


def sanitize(fragment: str) -> str:
    """``fragment`` (a page body) with everything a shared report must not run removed."""
    import nh3

    # a control character left in the page (a DataFrame cell, say) is shown, not hidden
    fragment = _HIDDEN.sub(lambda m: f"\\x{ord(m.group(0)):02x}", fragment)
    return nh3.clean(
        fragment,
        tags=_TAGS,
        clean_content_tags=_DROP_WITH_CONTENT,
        attributes=_ATTRIBUTES,
        attribute_filter=_attribute,
        url_schemes={"http", "https", "mailto", "data"},
        strip_comments=True,
        link_rel="noopener noreferrer",
    )
