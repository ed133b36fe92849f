"""A real browser (Debian chromium driven by Playwright) on crowdchat's pages: what the browser
tests (and tests/test_vllm.py's page test) do and read there. The `browser` and `server`
fixtures are in tests/conftest.py."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from playwright.sync_api import Browser, BrowserContext, Page, expect

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
CHAT_VIEW = {"width": 1100, "height": 900}
ADMIN_VIEW = {"width": 1280, "height": 1000}
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


def open_page(
    browser: Browser, url: str, viewport: dict[str, int] = CHAT_VIEW
) -> tuple[BrowserContext, Page]:
    """`url` in a new browser context (its own cookies): the context, to close, and the page."""
    context = browser.new_context(viewport=viewport)  # type: ignore[arg-type]
    page = context.new_page()
    page.goto(url)
    return context, page


def log_in(page: Page, name: str, password: str) -> None:
    """Fill in and send the sign-in form on the page (the admin page's or the Doors' one)."""
    page.get_by_label("username").fill(name)
    page.get_by_label("password").fill(password)
    page.get_by_role("button", name="Login").click()


def send(page: Page, text: str) -> None:
    """Type `text` into the chat page's message box and press Send."""
    if page.locator("#system textarea").is_visible():
        close_settings(page)
    page.locator("#message textarea").fill(text)
    page.locator("#send").click()


def assistant_text(page: Page) -> str:
    bubbles = page.locator("#chatbot .message.bot, #chatbot [data-testid='bot']")
    return bubbles.last.inner_text() if bubbles.count() else ""


def session_titled(sm: object, title: str, replies: int, timeout: float = 300) -> dict:
    """The stored conversation whose title starts with `title`, once it has `replies`
    committed assistant messages."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for row in sm.store.all_sessions():  # type: ignore[attr-defined]
            if row["title"].startswith(title):
                msgs = sm.store.messages(row["id"])  # type: ignore[attr-defined]
                if sum(m["role"] == "assistant" for m in msgs) >= replies:
                    return row
        time.sleep(0.2)
    raise AssertionError(f"no conversation {title!r} with {replies} replies")


def loaded(page: Page) -> Page:
    """Wait until the page's load handler has run (it marks the body when done): a Send
    before it could be painted over by the load's empty page."""
    page.wait_for_function("() => document.body.dataset.crowdchatLoaded === '1'", timeout=60_000)
    return page


def set_max_tokens(page: Page, n: int) -> None:
    """Type `n` into the settings dialog's max-tokens box (opened for it, closed after)."""
    was_open = page.locator("#system textarea").is_visible()
    if not was_open:
        open_settings(page)
    box = page.locator("#max-tokens input[type=number]")
    box.fill(str(n))
    box.press("Tab")
    if not was_open:
        close_settings(page)


def open_settings(page: Page) -> None:
    """Open the settings dialog from the header's ⚙."""
    page.locator("#settings-open").click()
    expect(page.locator("#system textarea")).to_be_visible(timeout=10_000)


def close_settings(page: Page) -> None:
    page.locator("#settings-close").click()
    expect(page.locator("#system textarea")).to_be_hidden(timeout=10_000)


def owner_of(context: BrowserContext) -> str:
    """The owner string of the browser context's anonymous identity (its signed cookie)."""
    cookie = {c["name"]: c["value"] for c in context.cookies()}["crowdchat_id"]
    return f"browser:{cookie.partition('.')[0]}"


def item_menu(page: Page, title: str) -> None:
    """Open the ⋯ menu of the conversation titled `title` in the sidebar."""
    item = page.locator("#convos .cc-item", has_text=title).first
    item.hover()
    item.locator(".cc-dots").click()
    expect(item.locator(".cc-menu")).to_be_visible(timeout=5_000)


def reply_ended(page: Page, timeout: float = 120_000) -> None:
    """Wait until no reply streams on screen (Send is back in Stop's place). Call it once the
    reply is known to have started: before its first update, Send still shows."""
    expect(page.locator("#send")).to_be_visible(timeout=timeout)


def fill_kept(page: Page, selector: str, text: str) -> None:
    """Type `text` into the box at `selector` until it stays there: a box in an accordion
    opened a moment ago may still be mounting, and its component then sets the value it was
    created with over what was typed (seen in CI: the system prompt read "" 10 s after the
    fill)."""
    box = page.locator(selector)
    for _ in range(3):
        box.fill(text)
        try:
            expect(box).to_have_value(text, timeout=3_000)
            page.wait_for_timeout(300)  # and still there after the component settled
            expect(box).to_have_value(text, timeout=1_000)
            return
        except AssertionError:
            continue
    expect(box).to_have_value(text, timeout=1_000)


def open_conversation(page: Page, title: str, shows: str) -> None:
    """Click a conversation in the list until the chat shows `shows`: the list re-renders when
    a new conversation gets its title, and a click on the item it replaces is lost (seen once
    in CI while the other reply streamed: the chat never switched)."""
    for _ in range(3):
        page.locator("#convos").get_by_text(title).click()
        try:
            expect(page.locator("#chatbot")).to_contain_text(shows, timeout=8_000)
            return
        except AssertionError:
            continue
    expect(page.locator("#chatbot")).to_contain_text(shows, timeout=8_000)


def plain(text: str) -> str:
    """A piece of a reply that reads the same rendered as Markdown: its first plain words
    (letters of any script; never across a line, which Markdown may render as no space)."""
    found = re.search(r"[^\W\d_](?:[^\W_]|[ ,']){5,}", text)
    first_line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return (found.group() if found else first_line)[:20].strip()


def replies_in_tree(sm: object, sid: str, n: int, timeout: float = 300) -> list[str]:
    """The texts of the conversation's assistant messages, every branch, once there are `n`."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        tree = sm.store.message_tree(sid)  # type: ignore[attr-defined]
        replies = [m["content"] for m in tree if m["role"] == "assistant"]
        if len(replies) >= n:
            return replies
        time.sleep(0.2)
    raise AssertionError(f"no {n} replies in {sid}")
