"""A real browser on the chat page's per-conversation settings, its export links and its import
upload (Debian chromium driven by Playwright, as tests/test_browser.py)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from playwright.sync_api import Browser, Page, expect

from tests.browser_rig import (
    ARTIFACTS,
    close_settings,
    item_menu,
    loaded,
    open_conversation,
    open_settings,
    reply_ended,
    set_max_tokens,
)
from tests.transfer_rig import chatgpt_conversation


def choose_max_tokens(page: Page, sm: object, n: int) -> None:
    """Type `n` in the max-tokens box and wait until the server kept it as the user's choice.
    Typed again if the page painted over it: a conversation's settings arriving just after
    it was typed (the user clicked New chat a moment before) win, as they would for a person."""
    for _ in range(5):
        set_max_tokens(page, n)
        deadline = time.time() + 5
        while time.time() < deadline:
            row = (
                sm.store.sql.reader()
                .execute(  # type: ignore[attr-defined]
                    "SELECT settings FROM owner_settings ORDER BY updated DESC LIMIT 1"
                )
                .fetchone()
            )
            if row and json.loads(row[0])["max_tokens"] == n:
                time.sleep(0.3)  # anything still on its way to paint over it has arrived
                if page.locator("#max-tokens input[type=number]").input_value() == str(n):
                    return
                break
            time.sleep(0.1)
    raise AssertionError(f"max tokens {n} was not kept")


def upload_file(page: Page, path: Path) -> None:
    with page.expect_file_chooser() as chooser:
        page.locator("#import").click()
    chooser.value.set_files(str(path))


def send(page: Page, text: str) -> None:
    if page.locator("#system textarea").is_visible():
        close_settings(page)
    page.locator("#message textarea").fill(text)
    page.locator("#send").click()
    expect(page.locator("#chatbot")).to_contain_text(text, timeout=30_000)
    reply_ended(page)


def test_each_conversation_shows_its_own_settings(browser: Browser, server: tuple) -> None:
    url, _engine, sm = server
    context = browser.new_context(viewport={"width": 1100, "height": 1000})
    page = context.new_page()
    page.goto(url + "/")
    loaded(page)
    open_settings(page)
    choose_max_tokens(page, sm, 32)
    send(page, "Settings one: say hi.")
    # the settings dialog's usage line says where this user stands against the limits
    open_settings(page)
    expect(page.locator("#usage")).to_contain_text("tokens this minute", timeout=20_000)
    expect(page.locator("#usage")).to_contain_text("1 of 200 conversations")
    close_settings(page)
    page.locator("#new-chat").click()
    expect(page.locator("#chatbot")).not_to_contain_text("Settings one", timeout=10_000)
    expect(page.locator("#max-tokens input[type=number]")).to_have_value("32")  # last choice
    choose_max_tokens(page, sm, 48)
    send(page, "Settings two: say hi.")
    open_conversation(page, "Settings one", "Settings one")
    expect(page.locator("#max-tokens input[type=number]")).to_have_value("32", timeout=10_000)
    open_conversation(page, "Settings two", "Settings two")
    expect(page.locator("#max-tokens input[type=number]")).to_have_value("48", timeout=10_000)
    page.reload()
    loaded(page)
    open_conversation(page, "Settings one", "Settings one")
    expect(page.locator("#max-tokens input[type=number]")).to_have_value("32", timeout=10_000)
    rows = {r["title"]: r for r in sm.store.all_sessions() if r["title"].startswith("Settings")}
    stored = {t: json.loads(r["settings"])["max_tokens"] for t, r in rows.items()}
    assert stored == {"Settings one: say hi.": 32, "Settings two: say hi.": 48}
    context.close()


def test_export_links_download_and_an_upload_imports(
    browser: Browser, server: tuple, tmp_path: Path
) -> None:
    url, _engine, _sm = server
    context = browser.new_context(viewport={"width": 1100, "height": 1000}, accept_downloads=True)
    page = context.new_page()
    page.goto(url + "/")
    loaded(page)
    send(page, "Export me: name a fruit.")
    item_menu(page, "Export me")  # the conversation's own menu
    with page.expect_download() as got:
        page.locator("#convos .cc-menu .cc-export-md").click()
    markdown = Path(got.value.path()).read_text(encoding="utf-8")
    assert "## You\n\nExport me: name a fruit." in markdown and "## Assistant" in markdown
    open_settings(page)  # everything: the settings dialog's data section
    with page.expect_download() as got:
        page.locator("#export-all").click()
    everything = json.loads(Path(got.value.path()).read_text(encoding="utf-8"))
    assert [c["title"] for c in everything["conversations"]] == ["Export me: name a fruit."]
    # ChatGPT's conversations.json comes in through the upload button
    upload = tmp_path / "conversations.json"
    upload.write_text(json.dumps([chatgpt_conversation()]), encoding="utf-8")
    upload_file(page, upload)
    expect(page.locator("#status")).to_contain_text("Imported 1 conversation", timeout=30_000)
    expect(page.locator("#convos")).to_contain_text("Trip to Porto")
    close_settings(page)
    open_conversation(page, "Trip to Porto", "Try a francesinha.")
    page.screenshot(path=str(ARTIFACTS / "import.png"), full_page=True)
    # a bad file says why, and imports nothing
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "crowdchat", "version": 1, "conversations": [{"messages": '
                   '[{"id": 1, "role": "wizard", "content": "hi"}]}]}')  # fmt: skip
    open_settings(page)
    upload_file(page, bad)
    expect(page.locator("#status")).to_contain_text("nothing was imported", timeout=30_000)
    expect(page.locator("#status")).to_contain_text("unknown role 'wizard'")
    context.close()


def test_a_share_link_opens_in_another_browser_which_continues_its_own_copy(
    browser: Browser, server: tuple
) -> None:
    url, _engine, sm = server
    owner = browser.new_context(viewport={"width": 1100, "height": 1000})
    page = owner.new_page()
    page.goto(url + "/")
    loaded(page)
    send(page, "Share me: name a tree.")
    item_menu(page, "Share me")
    page.locator("#convos .cc-menu .cc-share").click()  # a link, in the share dialog
    link_box = page.locator("#share-link textarea, #share-link input").first
    expect(link_box).to_have_value(re.compile(r"/share/[\w-]{32}$"), timeout=20_000)
    link = link_box.input_value()
    assert link.startswith(url + "/share/")
    viewer = browser.new_context(viewport={"width": 1100, "height": 1000})
    shared = viewer.new_page()
    shared.goto(link)
    expect(shared.locator("body")).to_contain_text("Share me: name a tree.")
    shared.screenshot(path=str(ARTIFACTS / "share.png"), full_page=True)
    shared.locator("#continue").click()
    shared.wait_for_url(url + "/", timeout=20_000)
    loaded(shared)
    expect(shared.locator("#chatbot")).to_contain_text("Share me: name a tree.", timeout=20_000)
    expect(shared.locator("#convos")).to_contain_text("Share me")
    # revoked on the owner's page: the link shows nothing now
    page.locator("#share-revoke").click()
    expect(page.locator("#status")).to_contain_text("Revoked", timeout=20_000)
    assert shared.goto(link).status == 404
    owners = {r["owner"] for r in sm.store.all_sessions() if r["title"].startswith("Share me")}
    assert len(owners) == 2  # the original and the viewer's copy, each its own
    owner.close()
    viewer.close()
