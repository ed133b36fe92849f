"""A real browser (Debian chromium driven by Playwright) on the chat page: a reply streams, stops
and survives a reload; the system prompt; replies stay in their own conversation; regenerate and
the branch switcher on the reply. The admin page and the sign-in form are
tests/test_browser_admin.py's."""

from __future__ import annotations

import time

from playwright.sync_api import Browser, expect

from tests.browser_rig import (
    ARTIFACTS,
    assistant_text,
    fill_kept,
    loaded,
    open_conversation,
    open_page,
    open_settings,
    plain,
    replies_in_tree,
    reply_ended,
    send,
    session_titled,
    set_max_tokens,
)


def test_chat_stream_stop_and_reload(browser: Browser, server: tuple) -> None:
    url, engine, sm = server
    ARTIFACTS.mkdir(exist_ok=True)
    context, page = open_page(browser, url + "/")
    # the identity is a signed HttpOnly cookie: the browser keeps it, page scripts cannot read it
    cookie = {c["name"]: c for c in context.cookies()}["crowdchat_id"]
    assert cookie["httpOnly"] and cookie["sameSite"] == "Lax"
    assert "crowdchat_id" not in page.evaluate("document.cookie")
    send(page, "Write a long story about a brave little robot.")
    # the reply streams in: text appears and keeps growing
    expect(page.locator("#chatbot")).to_contain_text("brave little robot", timeout=30_000)
    deadline = time.time() + 60
    while len(assistant_text(page)) < 40 and time.time() < deadline:
        time.sleep(0.2)
    first = assistant_text(page)
    assert len(first) >= 40
    page.locator("#stop").click()
    expect(page.locator("#status")).to_contain_text("Stopped", timeout=20_000)
    stopped = assistant_text(page)
    time.sleep(1.5)
    assert assistant_text(page) == stopped  # no more tokens after Stop
    assert engine.stats().running == 0
    page.screenshot(path=str(ARTIFACTS / "chat.png"), full_page=True)
    # a reload (same browser) finds the conversation, the partial reply included
    page.reload()
    expect(page.locator("#chatbot")).to_contain_text("brave little robot", timeout=20_000)
    expect(page.locator("#chatbot")).to_contain_text(stopped.strip()[:30], timeout=20_000)
    expect(page.locator("#convos")).to_contain_text("Write a long story")
    context.close()


def test_system_prompt_survives_a_reload_and_the_next_send(browser: Browser, server: tuple) -> None:
    url, _, sm = server
    context, page = open_page(browser, url + "/")
    loaded(page)
    open_settings(page)
    # the settings may still render as the page settles: the prompt must be in the box (and
    # the box left) before the send reads it (CI once sent an empty one)
    fill_kept(page, "#system textarea", "You are a pirate.")
    page.locator("#system textarea").press("Tab")
    set_max_tokens(page, 16)  # a short reply on a slow CPU
    send(page, "Ahoy, who sails this ship?")
    row = session_titled(sm, "Ahoy, who sails", replies=1)
    assert row["system_prompt"] == "You are a pirate."
    page.reload()
    expect(page.locator("#chatbot")).to_contain_text("Ahoy, who sails", timeout=20_000)
    open_settings(page)
    expect(page.locator("#system textarea")).to_have_value("You are a pirate.", timeout=20_000)
    set_max_tokens(page, 16)
    send(page, "And where are we going?")
    row = session_titled(sm, "Ahoy, who sails", replies=2)
    assert sm.store.get_session(row["id"])["system_prompt"] == "You are a pirate."
    context.close()


def test_a_reply_streams_only_into_the_conversation_on_screen(
    browser: Browser, server: tuple
) -> None:
    url, _, sm = server
    context, page = open_page(browser, url + "/")
    loaded(page)
    open_settings(page)
    set_max_tokens(page, 16)  # a short first reply on a slow CPU
    send(page, "Name one colour.")
    session_titled(sm, "Name one colour", replies=1)
    set_max_tokens(page, 1024)  # the story must still run when the user comes back to it
    page.locator("#new-chat").click()
    send(page, "Write a long story about a lighthouse keeper.")
    expect(page.locator("#chatbot")).to_contain_text("lighthouse keeper", timeout=30_000)
    deadline = time.time() + 60
    while len(assistant_text(page)) < 10 and time.time() < deadline:
        time.sleep(0.2)
    open_conversation(page, "Name one colour.", "Name one colour")
    for _ in range(10):  # the story keeps running, but never paints over this one
        time.sleep(0.3)
        assert "lighthouse" not in page.locator("#chatbot").inner_text()
    # back to the story: it paints there again, up to Stop. The model may have ended the story
    # by itself (EOS) meanwhile, sooner on a faster kernel: then Stop has nothing left to stop
    # and the status is empty, which the stored reply's finish reason tells apart.
    open_conversation(page, "Write a long story", "lighthouse keeper")
    page.locator("#stop").click()
    story = session_titled(sm, "Write a long story about a lighthouse", replies=1)
    last = sm.store.messages(story["id"])[-1]
    reply = last["content"]
    stopped = last["finish_reason"] == "cancelled"
    assert stopped or last["finish_reason"] in ("stop", "length"), last["finish_reason"]
    if stopped:
        expect(page.locator("#status")).to_contain_text("Stopped", timeout=20_000)
    else:
        expect(page.locator("#status")).not_to_contain_text("Replying", timeout=20_000)
    assert len(reply) > 10 and "Name one colour" not in page.locator("#chatbot").inner_text()
    expect(page.locator("#chatbot")).to_contain_text(plain(reply), timeout=10_000)
    context.close()


def test_regenerate_keeps_both_replies_and_the_switcher_picks_the_branch_that_goes_on(
    browser: Browser, server: tuple
) -> None:
    url, _, sm = server
    context, page = open_page(browser, url + "/")
    loaded(page)
    open_settings(page)
    set_max_tokens(page, 16)  # short replies on a slow CPU
    send(page, "Name one fruit, please.")
    sid = session_titled(sm, "Name one fruit", replies=1)["id"]
    reply_ended(page)
    page.locator("#chatbot .cc-regen").last.click()  # ↻ under the reply
    first, second = replies_in_tree(sm, sid, 2)
    switcher = page.locator("#chatbot .cc-branch")  # ‹ n/m › on the reply it switches
    expect(switcher).to_contain_text("2/2", timeout=30_000)
    expect(switcher.locator(".cc-prev")).to_have_text("‹")
    expect(switcher.locator(".cc-next")).to_have_text("›")
    expect(page.locator("#chatbot")).to_contain_text(plain(second), timeout=10_000)
    switcher.locator(".cc-prev").click()
    expect(switcher).to_contain_text("1/2", timeout=20_000)
    expect(page.locator("#chatbot")).to_contain_text(plain(first), timeout=10_000)
    if plain(second) not in first:
        assert plain(second) not in page.locator("#chatbot").inner_text()
    page.reload()  # the choice is stored: a reload shows the first reply again
    expect(switcher).to_contain_text("1/2", timeout=30_000)
    expect(page.locator("#chatbot")).to_contain_text(plain(first), timeout=10_000)
    open_settings(page)
    set_max_tokens(page, 16)
    send(page, "And what colour is it?")
    replies_in_tree(sm, sid, 3)
    path = [m["content"] for m in sm.store.messages(sid)]
    assert path[:3] == ["Name one fruit, please.", first, "And what colour is it?"]
    assert len(path) == 4  # the next turn went on from the branch on screen
    expect(switcher).to_contain_text("1/2", timeout=30_000)
    context.close()
