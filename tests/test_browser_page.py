"""A real browser (Debian chromium driven by Playwright) on the chat page as issue 56 found it:
Gradio's chrome (footer, run history in localStorage, its API and settings pages) off on every
page, a delete that deletes, a status line that never lies; and the page's layout at desktop
(1280x900) and phone (390x844) sizes: the sidebar (a drawer on a phone), conversations by day
with their menus, 500 conversations, the composer on screen."""

from __future__ import annotations

import re
import secrets
import time

import httpx
from playwright.sync_api import Browser, Page, expect

from sessions.chat_settings import ChatSettings
from tests.browser_rig import (
    ADMIN_VIEW,
    ARTIFACTS,
    DESKTOP,
    PHONE,
    assistant_text,
    item_menu,
    loaded,
    open_page,
    owner_of,
    reply_ended,
    send,
    session_titled,
)
from tests.web import ADMIN_PASSWORD

GRADIO_CHROME = ("Use via API", "Built with Gradio", "Runs")
# what Gradio's progress shows on an output while an event runs: "0.0s", "queue: 1/1 |
# 0.0/13.3s", "processing | 0.1/13.3s"
PROGRESS = re.compile(r"\d+\.\d+s|queue:|processing")
WATCH_STATUS = """() => {
  window.__seen = [];
  const look = () => {
    for (const el of document.querySelectorAll(
        '#status, .progress-text, .meta-text, .meta-text-center, .eta-bar, .progress-level')) {
      const t = (el.innerText || '').trim();  // what a person sees: shown, not transparent
      if (t && el.checkVisibility({visibilityProperty: true, opacityProperty: true}))
        window.__seen.push(t);
    }
  };
  new MutationObserver(look).observe(document.body,
    {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def short_replies(page: Page, sm: object, tokens: int = 16) -> None:
    """Make this browser's replies `tokens` long (its last settings, which a new
    conversation starts from) and reload the page with them."""
    choice = ChatSettings(max_tokens=tokens).to_json()
    sm.store.put_settings(owner_of(page.context), None, choice)  # type: ignore[attr-defined]
    page.reload()
    loaded(page)


def no_chrome(page: Page) -> None:
    """Nothing of Gradio's footer on the page."""
    for text in GRADIO_CHROME:
        expect(page.get_by_text(text, exact=True)).to_have_count(0)
    expect(page.locator("footer")).to_have_count(0)


def test_gradio_chrome_is_off_and_nothing_of_a_conversation_stays_in_the_browser(
    browser: Browser, server: tuple
) -> None:
    """Issue 56, defect 3: the footer's "Runs" kept conversation text in localStorage, "Use
    via API" listed the pages' internal events, its "Settings" was Gradio's developer panel."""
    url, _engine, sm = server
    context, page = open_page(browser, url + "/", DESKTOP)
    loaded(page)
    short_replies(page, sm)
    send(page, "Remember the secret word pelican.")
    session_titled(sm, "Remember the secret word", replies=1)
    reply_ended(page)
    no_chrome(page)
    stored = page.evaluate("JSON.stringify(Object.entries(localStorage))")
    assert "pelican" not in stored and "run-history" not in stored, stored
    # Gradio's own views are sent back to the page
    for view in ("settings", "api"):
        page.goto(f"{url}/?view={view}")
        loaded(page)
        assert "view=" not in page.url
        expect(page.get_by_text("Display Theme")).to_have_count(0)
        expect(page.get_by_text("API Recorder")).to_have_count(0)
        no_chrome(page)
    info = httpx.get(f"{url}/gradio_api/info").json()
    assert not info["named_endpoints"] and not info["unnamed_endpoints"], info
    context.close()
    # and the admin page, signed in
    context, admin = open_page(browser, url + "/admin/", ADMIN_VIEW)
    admin.get_by_label("username").fill("admin")
    admin.get_by_label("password").fill(ADMIN_PASSWORD)
    admin.get_by_role("button", name="Login").click()
    expect(admin.locator("#memory")).to_contain_text("Device memory", timeout=30_000)
    no_chrome(admin)
    assert "run-history" not in admin.evaluate("JSON.stringify(Object.keys(localStorage))")
    admin.goto(url + "/admin/?view=settings")
    expect(admin.locator("#memory")).to_contain_text("Device memory", timeout=30_000)
    assert "view=" not in admin.url
    expect(admin.get_by_text("Display Theme")).to_have_count(0)
    context.close()


def test_delete_deletes_the_conversation_and_the_next_message_starts_afresh(
    browser: Browser, server: tuple
) -> None:
    """Issue 56, defect 2: the chat's trash icon only hid the messages; the conversation
    stayed in the list and its next reply was answered with the hidden history."""
    url, _engine, sm = server
    context, page = open_page(browser, url + "/", DESKTOP)
    loaded(page)
    short_replies(page, sm)
    send(page, "Doomed: my cat is called Biscuit.")
    doomed = session_titled(sm, "Doomed: my cat", replies=1)
    reply_ended(page)
    # no control only hides a conversation: Gradio's trash is gone from the chat
    expect(page.locator("#chatbot button[aria-label='Clear']")).to_be_hidden()
    item_menu(page, "Doomed: my cat")
    page.locator("#convos .cc-menu .cc-delete").click()
    confirm = page.locator("#convos .cc-confirm")
    expect(confirm).to_contain_text("Delete “Doomed: my cat is called Biscuit.”?")
    confirm.locator(".cc-confirm-yes").click()
    expect(page.locator("#convos")).not_to_contain_text("Doomed", timeout=10_000)
    expect(page.locator("#chatbot")).not_to_contain_text("Biscuit", timeout=10_000)
    deadline = time.time() + 10
    while sm.store.get_session(doomed["id"]) is not None and time.time() < deadline:
        time.sleep(0.1)
    assert sm.store.get_session(doomed["id"]) is None
    send(page, "Fresh: what is my cat called?")
    fresh = session_titled(sm, "Fresh: what is my cat", replies=1)
    assert [m["role"] for m in sm.store.messages(fresh["id"])] == ["user", "assistant"]
    page.reload()
    loaded(page)
    expect(page.locator("#convos")).to_contain_text("Fresh: what is my cat")
    expect(page.locator("#convos")).not_to_contain_text("Doomed")
    context.close()


def test_the_status_line_speaks_only_while_a_reply_waits_and_the_header_names_the_model(
    browser: Browser, server: tuple
) -> None:
    """Issue 56, defect 4: Gradio's progress text flashed on every send, an idle server said
    "Waiting for a free slot (about 13 s)…", once "Waiting: -1 ahead of you"."""
    url, engine, sm = server
    context, page = open_page(browser, url + "/", DESKTOP)
    loaded(page)
    short_replies(page, sm, 48)
    page.evaluate(WATCH_STATUS)
    send(page, "Status: tell me about the moon.")
    deadline = time.time() + 60
    while not assistant_text(page).strip() and time.time() < deadline:
        time.sleep(0.05)
    assert assistant_text(page).strip()
    # the reply streams: the status line is empty, Send is Stop
    expect(page.locator("#status")).to_have_text("", timeout=2_000)
    reply_ended(page)
    page.locator("#new-chat").click()
    expect(page.locator("#chatbot")).not_to_contain_text("moon", timeout=10_000)
    page.locator("#convos").get_by_text("Status: tell me").click()
    expect(page.locator("#chatbot")).to_contain_text("moon", timeout=10_000)
    seen = page.evaluate("window.__seen")
    assert not [t for t in seen if PROGRESS.search(t)], seen
    assert not [t for t in seen if "Waiting" in t or "-1" in t], seen  # nothing waited
    assert engine.stats().running == 0
    expect(page.locator("#header")).to_contain_text(engine.model_id)
    context.close()


def seed(sm: object, owner: str, title: str, days_ago: float, *messages: str) -> str:
    """A conversation of `owner`'s, last active `days_ago` days ago, with `messages`
    (alternately the user's and replies)."""
    # straight into the store: past the per-user cap on conversations (an import, or an
    # operator's higher --max-sessions-per-user, can hold more)
    sid = sm.store.create_session(secrets.token_hex(16), owner, title, "", None)["id"]  # type: ignore[attr-defined]
    for i, text in enumerate(messages):
        sm.store.add_message(sid, ("user", "assistant")[i % 2], text)  # type: ignore[attr-defined]
    when = time.time() - days_ago * 86400
    sm.store.update_session(sid, last_active=when)  # type: ignore[attr-defined]
    return sid


def test_the_sidebar_groups_conversations_by_day_one_line_each_each_with_its_menu(
    browser: Browser, server: tuple
) -> None:
    url, _engine, sm = server
    context, page = open_page(browser, url + "/", DESKTOP)
    loaded(page)
    owner = owner_of(context)
    long = "A very long title that goes on and on about a great many things " * 2
    seed(sm, owner, "Old taxes", 40, "About old taxes")
    trip = seed(sm, owner, "Last week's trip", 4, "About the trip")
    recipe = seed(sm, owner, "Yesterday's recipe", 1, "About a recipe", "Use eggs.")
    seed(sm, owner, long.strip(), 0.01, "About a long title")
    seed(sm, owner, "Today's plan", 0, "About today")
    page.reload()
    loaded(page)
    groups = page.locator("#convos .cc-group")
    expect(groups).to_have_text(["Today", "Yesterday", "Previous 7 days", "Older"])
    titles = page.locator("#convos .cc-item .cc-title")
    expect(titles).to_have_text(
        ["Today's plan", long.strip(), "Yesterday's recipe", "Last week's trip", "Old taxes"]
    )
    # one line each, a long title cut with an ellipsis
    cut = titles.nth(1)
    shape = cut.evaluate(
        "e => [e.getBoundingClientRect().height, e.scrollWidth > e.clientWidth,"
        " getComputedStyle(e).textOverflow, getComputedStyle(e).whiteSpace]"
    )
    assert shape[0] <= 40 and shape[1:] == [True, "ellipsis", "nowrap"], shape
    # the open one is marked
    page.locator("#convos").get_by_text("Yesterday's recipe").click()
    expect(page.locator("#chatbot")).to_contain_text("Use eggs.", timeout=10_000)
    opened = page.locator("#convos .cc-item[aria-current=page]")
    expect(opened).to_have_count(1)
    expect(opened).to_have_text("Yesterday's recipe⋯")
    page.screenshot(path=str(ARTIFACTS / "chat-sidebar.png"))
    # its menu: rename in place, share, export, delete after a confirmation
    item_menu(page, "Yesterday's recipe")
    menu = page.locator("#convos .cc-menu")
    expect(menu.locator(".cc-export-md")).to_have_attribute("href", f"export/{recipe}.md")
    expect(menu.locator(".cc-export-json")).to_have_attribute("href", f"export/{recipe}.json")
    expect(menu.locator(".cc-share")).to_be_visible()
    menu.locator(".cc-rename").click()
    box = page.locator("#convos .cc-rename-box")
    expect(box).to_have_value("Yesterday's recipe")
    box.fill("Omelette recipe")
    box.press("Enter")
    expect(page.locator("#convos .cc-item[aria-current=page]")).to_contain_text("Omelette recipe")
    deadline = time.time() + 10
    while sm.store.get_session(recipe)["title"] != "Omelette recipe":
        assert time.time() < deadline
        time.sleep(0.1)
    item_menu(page, "Last week's trip")
    page.locator("#convos .cc-menu .cc-delete").click()
    page.locator("#convos .cc-confirm-no").click()  # changed their mind: nothing happens
    expect(page.locator("#convos")).to_contain_text("Last week's trip")
    assert sm.store.get_session(trip) is not None
    # search as you type: debounced, each conversation once
    calls: list[str] = []
    real = sm.search

    def counted(who: str, text: str, *args: object, **kwargs: object) -> list[dict]:
        calls.append(text)
        return real(who, text, *args, **kwargs)

    sm.search = counted
    try:
        page.locator("#convos .cc-find").press_sequentially("omelette", delay=40)
        hits = page.locator("#convos .cc-hit")
        expect(hits).to_have_count(1, timeout=10_000)  # its title and nothing else
        expect(hits).to_contain_text("Omelette recipe")
        assert 1 <= len(calls) <= 2, calls  # not one search a keystroke
        page.locator("#convos .cc-find").fill("eggs")
        expect(hits).to_contain_text("Use eggs.", timeout=10_000)
        hits.first.click()
        expect(page.locator("#chatbot")).to_contain_text("Use eggs.")
    finally:
        del sm.search
    context.close()


def test_on_a_phone_the_sidebar_is_a_drawer_and_the_composer_stays_on_screen(
    browser: Browser, server: tuple
) -> None:
    url, _engine, sm = server
    context, page = open_page(browser, url + "/", PHONE)
    loaded(page)
    owner = owner_of(context)
    long_reply = "\n\n".join(
        f"Paragraph {i}: " + "words that fill the screen " * 8 for i in range(8)
    )
    seed(sm, owner, "Phone: a short one", 0.1, "Hello there", "Hi!")
    seed(sm, owner, "Phone: a long one", 0, "Tell me a lot", long_reply)
    page.reload()
    loaded(page)
    expect(page.locator("#chatbot")).to_contain_text("Paragraph 7", timeout=10_000)

    def on_screen(selector: str) -> dict:
        box = page.locator(selector).bounding_box()
        assert box is not None, selector
        assert box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"] + 0.5, (selector, box)
        assert box["y"] >= 0 and box["y"] + box["height"] <= PHONE["height"] + 0.5, (selector, box)
        return box

    def drawer_shut() -> bool:
        box = page.locator(".sidebar").bounding_box()
        return box is None or box["x"] + box["width"] <= 1

    deadline = time.time() + 5
    while not drawer_shut():  # a phone opens on the chat
        assert time.time() < deadline, page.locator(".sidebar").bounding_box()
        time.sleep(0.1)
    assert on_screen("#message textarea")["width"] >= 250
    on_screen("#send")
    on_screen("#header")
    assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
    page.screenshot(path=str(ARTIFACTS / "chat-phone.png"))
    page.locator(".sidebar .toggle-button").click()  # ☰: the drawer opens over the chat
    expect(page.locator("#convos").get_by_text("Phone: a short one")).to_be_visible()
    page.locator("#convos").get_by_text("Phone: a short one").click()
    expect(page.locator("#chatbot")).to_contain_text("Hello there", timeout=10_000)
    deadline = time.time() + 5
    while not drawer_shut():  # and shuts once a conversation is picked
        assert time.time() < deadline
        time.sleep(0.1)
    on_screen("#message textarea")
    context.close()


def test_five_hundred_conversations_open_fast_and_page_in_as_the_list_scrolls(
    browser: Browser, server: tuple
) -> None:
    url, _engine, sm = server
    context, page = open_page(browser, url + "/", DESKTOP)
    loaded(page)
    owner = owner_of(context)
    for i in range(500):
        seed(sm, owner, f"Bulk {i:03d}", i / 50)
    started = time.monotonic()
    page.reload()
    loaded(page)
    items = page.locator("#convos .cc-item")
    expect(items.first).to_have_text("Bulk 000⋯")
    took = time.monotonic() - started
    assert took < 8, took  # a fresh page with its list, on a 2-core box beside the tests
    assert items.count() == 100  # the rest pages in as the list scrolls
    for shown in (200, 300, 400, 500):
        page.locator("#convos .cc-more").scroll_into_view_if_needed()
        expect(items).to_have_count(shown, timeout=10_000)
    expect(page.locator("#convos .cc-more")).to_have_count(0)
    expect(items.last).to_have_text("Bulk 499⋯")
    page.locator("#convos").get_by_text("Bulk 450").click()
    expect(page.locator("#convos .cc-item[aria-current=page]")).to_have_text("Bulk 450⋯")
    context.close()
