"""A real browser (Debian chromium driven by Playwright) on a share link's page, at a desktop's
and a phone's size: the messages' markdown rendered (a table, coloured code with Copy, LaTeX
as MathML), long lines wrapped inside the screen, and no payload in a message running."""

from __future__ import annotations

import pytest
from playwright.sync_api import Browser, expect

from tests.browser_rig import ARTIFACTS

DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
LONG = "x" * 300
QUESTION = (
    "Explain Pythagoras, with **a table** and code. "
    "<script>window.pwned = 1</script><img src=x onerror='window.pwned = 2'> "
    "[click me](javascript:window.pwned=3) $\\text{<b onclick=alert(1)>b</b>}$ "
    "$\\href{javascript:alert(1)}{link}$"
)
ANSWER = f"""In a right triangle, $a^2 + b^2 = c^2$, also written \\(c = \\sqrt{{a^2+b^2}}\\).

$$c^2 = a^2 + b^2$$

\\[ \\frac{{a}}{{c}} = \\sin\\alpha \\]

| a | b | c |
|---|---|---|
| 3 | 4 | 5 |
| 5 | 12 | 13 |

```python
def hypotenuse(a, b):
    return (a * a + b * b) ** 0.5  # {LONG}
```

A long word: {LONG}

<svg onload="window.pwned = 4"></svg>"""


@pytest.fixture(scope="module")
def link(server: tuple) -> str:
    url, _, sm = server
    sid = sm.create_session("browser:share-test", "Pythagoras **rendered**")["id"]
    sm.store.add_message(sid, "user", QUESTION)
    sm.store.add_message(sid, "assistant", ANSWER)
    return url + "/share/" + sm.share("browser:share-test", sid)["token"]


@pytest.mark.parametrize("size", [DESKTOP, PHONE], ids=["1280x900", "390x844"])
def test_the_share_page_renders_markdown_code_and_latex_safely(
    browser: Browser, link: str, size: dict
) -> None:
    context = browser.new_context(viewport=size)  # type: ignore[arg-type]
    context.grant_permissions(["clipboard-read", "clipboard-write"])
    page = context.new_page()
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    answer = page.goto(link)
    assert answer is not None and "script-src 'sha256-" in answer.headers["content-security-policy"]
    reply = page.locator(".message.assistant")
    expect(reply.locator("table")).to_have_count(1)
    expect(reply.locator("table td").first).to_have_text("3")
    expect(reply.locator("pre code .k").first).to_have_text("def")  # Pygments' keyword class
    expect(reply.locator("math[display=inline]")).to_have_count(2)
    expect(reply.locator("math[display=block]")).to_have_count(2)
    expect(page.locator(".message.user strong")).to_have_text("a table")
    assert "**" not in page.locator(".message.user").inner_text()
    assert "|---" not in reply.inner_text() and "$$" not in reply.inner_text()
    # long lines wrap: nothing wider than the screen
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= size["width"], f"{width} px wide at {size['width']}"
    # the payloads are text or gone: nothing ran, no handler, no link to javascript:
    expect(page.locator(".message.user")).to_contain_text("[click me](javascript:")  # as text
    expect(page.locator(".message.user a")).to_have_count(0)
    assert page.evaluate("window.pwned") is None and dialogs == []
    handlers = page.evaluate(
        "[...document.querySelectorAll('*')].flatMap(e => [...e.attributes]"
        ".filter(a => a.name.startsWith('on') || a.value.includes('javascript:'))"
        ".map(a => e.tagName + ' ' + a.name))"
    )
    assert handlers == [] and page.evaluate("document.scripts.length") == 1  # the page's own
    assert page.locator("svg, img, iframe").count() == 0
    # Copy puts the code block's text on the clipboard
    page.locator(".message.assistant pre .copy").click()
    expect(page.locator(".message.assistant pre .copy")).to_have_text("Copied")
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied.startswith("def hypotenuse(a, b):") and "Copy" not in copied
    ARTIFACTS.mkdir(exist_ok=True)
    name = "share.png" if size is DESKTOP else "share-phone.png"
    page.screenshot(path=str(ARTIFACTS / name), full_page=size is DESKTOP)
    context.close()
