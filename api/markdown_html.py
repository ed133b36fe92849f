"""A message's markdown as safe HTML, for pages the server renders itself (the share page).

Libraries, each for its own job: markdown-it-py parses (CommonMark, as Gradio's chat does,
plus tables and strikethrough; raw HTML in the markdown stays text); mdit-py-plugins finds the
math (`$…$`, `$$…$$` by dollarmath, `\\(…\\)`, `\\[…\\]` by texmath); latex2mathml turns it into
MathML, which Chromium, Firefox and Safari draw natively, so the page needs no script or font
from elsewhere; Pygments colours code (classes, styled by static/share.css); nh3 (the ammonia
sanitizer) keeps only the tags and attributes listed here from the whole result, because
latex2mathml copies `\\text{…}` into its MathML unescaped and passes `\\href` through."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any
from xml.etree.ElementTree import tostring

import nh3
from latex2mathml.converter import convert_to_element
from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from markdown_it.token import Token
from mdit_py_plugins.dollarmath import dollarmath_plugin
from mdit_py_plugins.texmath import texmath_plugin
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound

MATHML = {
    "math", "mrow", "mi", "mn", "mo", "ms", "mtext", "mspace", "mfrac", "msqrt", "mroot",
    "msup", "msub", "msubsup", "munder", "mover", "munderover", "mtable", "mtr", "mtd",
    "mstyle", "mpadded", "mphantom", "menclose", "merror", "semantics", "annotation",
}  # fmt: skip
HTML = {
    "p", "br", "hr", "h1", "h2", "h3", "h4", "h5", "h6", "strong", "em", "del", "s", "code",
    "pre", "blockquote", "ul", "ol", "li", "a", "table", "thead", "tbody", "tr", "th", "td",
    "span", "div",
}  # fmt: skip
MATH_ATTRIBUTES = {
    "mathvariant", "stretchy", "fence", "separator", "lspace", "rspace", "displaystyle",
    "scriptlevel", "columnalign", "rowalign", "columnspacing", "rowspacing", "columnlines",
    "rowlines", "frame", "width", "height", "depth", "accent", "accentunder", "linethickness",
    "minsize", "maxsize", "movablelimits", "symmetric", "largeop", "form", "notation",
    "mathcolor", "mathsize", "mathbackground", "voffset",
}  # fmt: skip
ATTRIBUTES = {
    "a": {"href", "title"},
    "math": {"display", "xmlns"},
    "ol": {"start"},
    "span": {"class"},
    "code": {"class"},
    "div": {"class"},
    "th": {"class"},
    "td": {"class"},
    **{tag: MATH_ATTRIBUTES for tag in MATHML - {"math"}},
}
MATH_TOKENS = {  # token type -> displayed as a block; dollarmath and texmath share the names
    "math_inline": False,
    "math_inline_double": True,
    "math_block": True,
    "math_block_eqno": True,
    "math_block_label": True,
}
CHAR_REF = re.compile(r"&amp;(#x[0-9A-Fa-f]+;)")  # a symbol latex2mathml wrote as "&#x…;"
CODE = HtmlFormatter(nowrap=True)  # spans with Pygments' short class names


def math_html(tex: str, block: bool) -> str:
    """MathML for `tex`; TeX that latex2mathml cannot read shows as its source, as code.
    Serialized here, not by latex2mathml's `convert`: that one unescapes its whole output
    (to let its symbols' character references through), so `\\text{<b>}` came out as a tag;
    only those references are let through here, every other `<` and `&` stays escaped."""
    try:
        tree = convert_to_element(tex.strip(), display="block" if block else "inline")
    except Exception:  # noqa: BLE001 (its parser raises a dozen kinds on bad TeX)
        return f'<code class="tex">{escapeHtml(tex)}</code>'
    return CHAR_REF.sub(r"&\1", tostring(tree, encoding="unicode"))


def code_html(code: str, lang: str, _attrs: str) -> str:
    """A fence's code coloured by Pygments when its language is known, else escaped."""
    try:
        lexer = get_lexer_by_name(lang.split()[0]) if lang.strip() else None
    except ClassNotFound:
        lexer = None
    return escapeHtml(code) if lexer is None else highlight(code, lexer, CODE)


def _render_math(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    token = tokens[idx]
    block = MATH_TOKENS[token.type]
    inner = math_html(token.content, block)
    return f'<div class="math">{inner}</div>\n' if block else inner


def _cell_align(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    """A table cell's `style="text-align:…"` as a class: the page's policy allows no inline
    style."""
    token = tokens[idx]
    style = str(token.attrs.pop("style", ""))
    if style.startswith("text-align:"):
        token.attrSet("class", "align-" + style.split(":", 1)[1])
    return self.renderToken(tokens, idx, options, env)


def _table_open(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    # a wide table scrolls in its own box, not the page
    return '<div class="table">' + self.renderToken(tokens, idx, options, env)


def _table_close(self: Any, tokens: Sequence[Token], idx: int, options: Any, env: Any) -> str:
    return self.renderToken(tokens, idx, options, env) + "</div>"


def build_markdown() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "highlight": code_html})
    md.enable(["table", "strikethrough"])
    md.disable("image")  # `![alt](url)` shows as a link: no request to elsewhere on opening
    # "$5 or $10" stays text: no space inside the dollars, no digit right outside them
    md.use(dollarmath_plugin, allow_space=False, allow_digits=False, double_inline=True)
    md.use(texmath_plugin, delimiters="brackets")
    for kind in MATH_TOKENS:
        md.add_render_rule(kind, _render_math)
    for kind in ("th_open", "td_open"):
        md.add_render_rule(kind, _cell_align)
    md.add_render_rule("table_open", _table_open)
    md.add_render_rule("table_close", _table_close)
    return md


MARKDOWN = build_markdown()


def markdown_html(text: str) -> str:
    """`text` (markdown with TeX) as sanitized HTML: no script, no event handler, no style,
    links only to http(s) and mailto."""
    return nh3.clean(
        MARKDOWN.render(text),
        tags=HTML | MATHML,
        attributes=ATTRIBUTES,
        url_schemes={"http", "https", "mailto"},
        link_rel="noopener noreferrer nofollow",
        strip_comments=True,
    )
