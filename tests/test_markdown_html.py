"""A message's markdown as the share page renders it (api/markdown_html.py): tables, code
with its colours, the four kinds of LaTeX as MathML, and nothing a message could run."""

from __future__ import annotations

import random
import re
from html.parser import HTMLParser

import pytest

from api.markdown_html import HTML, MATHML, markdown_html

# each must come out inert: no element or attribute that runs, loads or styles anything
XSS = [
    "<script>alert(1)</script>",
    "<img src=x onerror=alert(1)>",
    '<a href="javascript:alert(1)">x</a>',
    "[click](javascript:alert(1))",
    "[click](JaVaScRiPt:alert(1))",
    "[click](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
    "[click](vbscript:msgbox(1))",
    "![x](javascript:alert(1))",
    "<iframe src=//evil.test></iframe>",
    '<div style="position:fixed;inset:0">covered</div>',
    "<svg onload=alert(1)>",
    "<details open ontoggle=alert(1)>",
    "<math><mtext><table><mglyph><style><img src=x onerror=alert(1)>",
    r"$\text{<img src=x onerror=alert(1)>}$",
    r"$\href{javascript:alert(1)}{x}$",
    r"\(\text{</math><script>alert(1)</script>}\)",
    r"$$\text{<svg onload=alert(1)>}$$",
    r"\[\style{color:red}{x}\]",
    r"$\mathbf{\text{<b onclick=alert(1)>}}$",
    '```js" onmouseover="alert(1)\nx\n```',
    "<!-- <script>alert(1)</script> -->",
    "&lt;script&gt;alert(1)&lt;/script&gt;",
    "<a href='http://x' onclick='alert(1)'>x</a>",
    '[x](http://ok.test "title" onclick=alert(1))',
]
SAFE_TAGS = HTML | MATHML
SAFE_LINK = re.compile(r"^(https?:|mailto:)", re.IGNORECASE)


class Elements(HTMLParser):
    """Every element and attribute of a piece of HTML, as a browser's parser sees them."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.found: list[tuple[str, dict[str, str | None]]] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, dict(attrs)))


def runs(out: str) -> list[str]:
    """What in `out` could run, load or restyle anything: tags beyond the allowed ones, event
    handlers, style, links other than http(s)/mailto."""
    bad = []
    for tag, attrs in Elements(out).found:
        if tag not in SAFE_TAGS:
            bad.append(tag)
        for name, value in attrs.items():
            if name.startswith("on") or name in ("style", "src", "srcdoc", "action"):
                bad.append(f"{tag} {name}")
            if name == "href" and not SAFE_LINK.match(value or ""):
                bad.append(f"{tag} href={value}")
    return bad


def test_markdown_tables_and_code_render() -> None:
    out = markdown_html(
        "**bold** and *it*\n\n| a | b |\n|--:|---|\n| 1 | 2 |\n\n```python\nprint('hi')\n```"
    )
    assert "<strong>bold</strong>" in out and "<em>it</em>" in out
    assert '<div class="table"><table>' in out and '<th class="align-right">a</th>' in out
    assert '<code class="language-python">' in out
    assert '<span class="nb">print</span>' in out  # Pygments' class for a builtin
    assert "**" not in out and "|--" not in out and "```" not in out


@pytest.mark.parametrize(
    ("text", "display"),
    [
        (r"Pythagoras: $a^2+b^2=c^2$.", "inline"),
        (r"Pythagoras: \(a^2+b^2=c^2\).", "inline"),
        ("$$a^2+b^2=c^2$$", "block"),
        (r"\[a^2+b^2=c^2\]", "block"),
    ],
)
def test_the_four_latex_delimiters_become_mathml(text: str, display: str) -> None:
    out = markdown_html(text)
    assert f'<math xmlns="http://www.w3.org/1998/Math/MathML" display="{display}">' in out
    assert "<msup><mi>a</mi><mn>2</mn></msup>" in out
    assert "$" not in out and "\\(" not in out and "\\[" not in out


def test_prices_stay_text_and_bad_tex_shows_its_source() -> None:
    assert "<math" not in markdown_html("It costs $5 or $10, not $ 20 $.")
    out = markdown_html(r"Broken: $x_$ and $\frac{1}{$")
    assert '<code class="tex">x_</code>' in out and "Broken" in out


def test_the_checker_sees_what_runs() -> None:
    assert runs('<p><img src=x onerror="alert(1)"><a href="javascript:x">y</a></p>') == [
        "img",
        "img src",
        "img onerror",
        "a href=javascript:x",
    ]


@pytest.mark.parametrize("payload", XSS)
def test_nothing_in_a_message_runs(payload: str) -> None:
    for text in (payload, f"Before {payload} after", f"- item\n\n  {payload}\n\n| {payload} |"):
        out = markdown_html(text)
        assert not runs(out), (text, out)


def test_seeded_random_mixes_of_payloads_and_markdown_stay_inert() -> None:
    rng = random.Random(56)
    pieces = [
        *XSS,
        "**b**",
        "`c`",
        "$x$",
        r"\(y\)",
        "$$z$$",
        "\n\n",
        "| a |\n|---|\n| b |\n",
        "```",
    ]
    for _ in range(300):
        text = "".join(rng.choice(pieces) + rng.choice(["", " ", "\n"]) for _ in range(6))
        out = markdown_html(text)
        assert not runs(out), (text, out)
