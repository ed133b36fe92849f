"""A real browser (Debian chromium driven by Playwright) on the chat page's messages, composer
and settings, as issue 56 asks for them: edit any message and regenerate any reply, each a
branch switched by ‹ n/m › on the message; a reply's stats; Enter, Shift+Enter, Esc and
Ctrl+Shift+O; Send turning into Stop; the settings dialog and a theme kept per browser; inline
and display LaTeX; markup in a title or a message never runs."""

from __future__ import annotations

import time

from playwright.sync_api import Browser, Page, expect

from sessions.chat_settings import ChatSettings
from tests.browser_rig import (
    ARTIFACTS,
    DESKTOP,
    PHONE,
    loaded,
    open_page,
    owner_of,
    plain,
    replies_in_tree,
    reply_ended,
    send,
    session_titled,
)


def short_replies(page: Page, sm: object, tokens: int = 16) -> None:
    """Make this browser's replies `tokens` long (its last settings, which a new
    conversation starts from) and reload the page with them."""
    choice = ChatSettings(max_tokens=tokens).to_json()
    sm.store.put_settings(owner_of(page.context), None, choice)  # type: ignore[attr-defined]
    page.reload()
    loaded(page)


def texts(page: Page) -> list[str]:
    """The chat's messages as shown, first first."""
    return page.locator("#chatbot .message-row").all_inner_texts()


def test_any_reply_regenerates_and_any_message_edits_into_a_branch_switched_on_the_message(
    browser: Browser, server: tuple
) -> None:
    url, _engine, sm = server
    context, page = open_page(browser, url + "/", DESKTOP)
    loaded(page)
    # an empty chat offers no action that has nothing to act on
    expect(page.locator("#chatbot .cc-regen")).to_have_count(0)
    expect(page.locator("#chatbot button[aria-label='Edit']")).to_have_count(0)
    short_replies(page, sm)
    send(page, "Branch one: name a fruit.")
    session_titled(sm, "Branch one", replies=1)
    reply_ended(page)
    send(page, "Branch two: name a colour.")
    sid = session_titled(sm, "Branch one", replies=2)["id"]
    reply_ended(page)
    first_reply = sm.store.messages(sid)[1]["content"]
    # each reply says how it streamed; each message can be copied
    stats = page.locator("#chatbot .cc-stats")
    expect(stats).to_have_count(2, timeout=10_000)
    expect(stats.first).to_contain_text("tokens/s")
    expect(stats.first).to_contain_text("first token in")
    expect(page.locator("#chatbot button[aria-label='Copy message']")).to_have_count(4)
    # regenerate the FIRST reply: a branch beside it, what followed it stays on the old one
    page.locator("#chatbot .cc-regen").first.click()
    new_first = replies_in_tree(sm, sid, 3)[-1]
    reply_ended(page)
    expect(page.locator("#chatbot .message-row")).to_have_count(2, timeout=10_000)
    switch = page.locator("#chatbot .cc-branch-n")
    expect(switch).to_have_text(["2/2"])
    page.locator("#chatbot .cc-prev").click()
    expect(page.locator("#chatbot .message-row")).to_have_count(4, timeout=10_000)
    expect(page.locator("#chatbot")).to_contain_text("Branch two: name a colour.")
    expect(switch).to_have_text(["1/2"])
    expect(page.locator("#chatbot")).to_contain_text(plain(first_reply))
    page.locator("#chatbot .cc-next").click()
    expect(page.locator("#chatbot")).to_contain_text(plain(new_first), timeout=10_000)
    page.locator("#chatbot .cc-prev").click()
    expect(page.locator("#chatbot .message-row")).to_have_count(4, timeout=10_000)
    # edit the FIRST message in place: a branch beside it, answered anew
    first = page.locator("#chatbot .message-row").first
    first.hover()
    page.locator("#chatbot button[aria-label='Edit']").first.click()
    box = page.locator("#chatbot textarea").first
    expect(box).to_have_value("Branch one: name a fruit.")
    box.fill("Branch one: name a vegetable.")
    page.locator("#chatbot button[aria-label='Submit']").first.click()
    deadline = time.time() + 120
    while len([m for m in sm.store.message_tree(sid) if m["role"] == "assistant"]) < 4:
        assert time.time() < deadline
        time.sleep(0.2)
    reply_ended(page)
    expect(page.locator("#chatbot .message-row")).to_have_count(2, timeout=10_000)
    expect(page.locator("#chatbot")).to_contain_text("name a vegetable")
    expect(switch).to_have_text(["2/2"])  # on the message it switches: the edited one
    roots = [m for m in sm.store.message_tree(sid) if m["parent_id"] is None]
    assert [m["content"] for m in roots] == [
        "Branch one: name a fruit.",
        "Branch one: name a vegetable.",
    ]
    page.locator("#chatbot .cc-prev").first.click()
    expect(page.locator("#chatbot")).to_contain_text("Branch two: name a colour.", timeout=10_000)
    expect(page.locator("#chatbot .cc-branch-n").first).to_have_text("1/2")
    page.screenshot(path=str(ARTIFACTS / "chat-branches.png"))
    context.close()


def test_enter_sends_shift_enter_breaks_esc_stops_and_ctrl_shift_o_starts_a_new_chat(
    browser: Browser, server: tuple
) -> None:
    url, engine, sm = server
    context, page = open_page(browser, url + "/", DESKTOP)
    loaded(page)
    short_replies(page, sm, 400)
    box = page.locator("#message textarea")
    box.click()
    one_line = box.bounding_box()["height"]
    box.press_sequentially("Keys: line one")
    box.press("Shift+Enter")
    box.press_sequentially("line two")
    for _ in range(3):
        box.press("Shift+Enter")
        box.press_sequentially("more")
    expect(box).to_have_value("Keys: line one\nline two\nmore\nmore\nmore")
    assert box.bounding_box()["height"] > 2.5 * one_line  # the box grew with its text
    expect(page.locator("#chatbot .message-row")).to_have_count(0)  # nothing was sent
    box.fill("Keys: write a long story about a lighthouse.")
    box.press("Enter")
    expect(page.locator("#chatbot")).to_contain_text("Keys: write a long story", timeout=30_000)
    expect(page.locator("#stop")).to_be_visible(timeout=30_000)  # Send became Stop
    expect(page.locator("#send")).to_be_hidden()
    expect(box).to_have_value("")
    deadline = time.time() + 60
    while engine.stats().running == 0 and time.time() < deadline:
        time.sleep(0.05)
    page.keyboard.press("Escape")
    expect(page.locator("#status")).to_contain_text("Stopped", timeout=20_000)
    expect(page.locator("#send")).to_be_visible()
    expect(page.locator("#stop")).to_be_hidden()
    assert engine.stats().running == 0
    # typed text is never lost: a message over the limit stays in the box with the reason
    too_long = "x" * (sm.config.max_message_chars + 1)
    box.fill(too_long)
    box.press("Enter")
    expect(page.locator("#status")).to_contain_text("Error", timeout=20_000)
    expect(box).to_have_value(too_long, timeout=10_000)
    box.fill("")
    page.keyboard.press("Control+Shift+O")
    expect(page.locator("#chatbot .message-row")).to_have_count(0, timeout=10_000)
    expect(page.locator("#convos .cc-item[aria-current=page]")).to_have_count(0)
    expect(box).to_be_focused()
    context.close()


def test_settings_open_from_the_header_with_the_usage_and_the_theme_is_kept_per_browser(
    browser: Browser, server: tuple
) -> None:
    url, _engine, _sm = server
    for view in (DESKTOP, PHONE):
        context, page = open_page(browser, url + "/", view)
        loaded(page)
        system = page.locator("#system textarea")
        expect(system).to_be_hidden()  # not under the composer: in a dialog
        expect(page.locator("#usage")).to_be_hidden()
        page.locator("#settings-open").click()
        expect(system).to_be_visible()
        expect(page.locator("#usage")).to_contain_text("conversations", timeout=10_000)
        dialog = page.locator("#settings-dialog").bounding_box()
        assert dialog["x"] >= 0 and dialog["x"] + dialog["width"] <= view["width"], dialog
        if view is PHONE:
            page.screenshot(path=str(ARTIFACTS / "settings-phone.png"))
        page.keyboard.press("Escape")
        expect(system).to_be_hidden()
        dark = page.evaluate("document.body.classList.contains('dark')")
        page.locator("#theme-toggle").click()
        assert page.evaluate("document.body.classList.contains('dark')") != dark
        page.reload()
        loaded(page)
        assert page.evaluate("document.body.classList.contains('dark')") != dark  # kept
        keys = page.evaluate("Object.keys(localStorage)")
        assert keys == ["crowdchat-theme"], keys  # and nothing else
        context.close()


def test_latex_renders_inline_and_display_and_markup_in_titles_or_messages_never_runs(
    browser: Browser, server: tuple
) -> None:
    url, _engine, sm = server
    context, page = open_page(browser, url + "/", DESKTOP)
    loaded(page)
    owner = owner_of(context)
    attack = '<img src=x onerror="window.__xss=1">'
    sid = sm.create_session(owner, f"Math {attack}")["id"]
    sm.store.add_message(sid, "user", f"Show me some math {attack}<script>window.__xss=2</script>")
    sm.store.add_message(
        sid,
        "assistant",
        "Inline $a^2+b^2=c^2$ and \\(e^{i\\pi}+1=0\\) in a sentence.\n\n"
        "Display:\n\n$$\\int_0^1 x\\,dx = \\tfrac12$$\n\nand\n\n\\[\\sum_{n=1}^{N} n\\]\n\n"
        '<a href="javascript:window.__xss=3">a link</a> ' + "unbroken" * 60,
    )
    page.reload()
    loaded(page)
    chat = page.locator("#chatbot")
    expect(chat.locator(".katex-display")).to_have_count(2, timeout=10_000)
    expect(chat.locator(".katex")).to_have_count(4)
    shown = chat.inner_text()
    assert "\\(" not in shown and "$a^2" not in shown and "\\[" not in shown, shown
    expect(page.locator("#convos .cc-title").first).to_have_text(f"Math {attack}")
    for link in chat.locator("a").all():
        if link.inner_text() == "a link":
            link.click()
    page.wait_for_timeout(500)
    assert page.evaluate("window.__xss") is None
    # the first line is never under a label, and a long line wraps
    expect(chat.locator("[data-testid='block-label']")).to_have_count(0)
    assert page.evaluate("document.documentElement.scrollWidth") <= DESKTOP["width"]
    row = chat.locator(".message-row").last.bounding_box()
    assert row["x"] + row["width"] <= DESKTOP["width"]
    page.screenshot(path=str(ARTIFACTS / "chat-latex.png"))
    context.close()
