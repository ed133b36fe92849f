"""A real browser (Debian chromium driven by Playwright) on the chat and admin pages."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from engine.loader import LoadedModel
from tests.web import ADMIN_PASSWORD, running_server

ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    with running_server(nf4_model, tmp_path_factory.mktemp("browser")) as running:
        yield running


def assistant_text(page: Page) -> str:
    bubbles = page.locator("#chatbot .message.bot, #chatbot [data-testid='bot']")
    return bubbles.last.inner_text() if bubbles.count() else ""


def test_chat_stream_stop_and_reload(browser: Browser, server: tuple) -> None:
    url, engine, sm = server
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": 1100, "height": 900})
    page = context.new_page()
    page.goto(url + "/")
    page.locator("#message textarea").fill("Write a long story about a brave little robot.")
    page.locator("#send").click()
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


def test_admin_login_and_memory_figures(browser: Browser, server: tuple) -> None:
    url, _, _ = server
    ARTIFACTS.mkdir(exist_ok=True)
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.goto(url + "/admin/")
    page.get_by_label("username").fill("admin")
    page.get_by_label("password").fill("wrong password")
    page.get_by_role("button", name="Login").click()
    expect(page.get_by_text("Incorrect credentials")).to_be_visible(timeout=10_000)
    page.get_by_label("username").fill("admin")  # the form is reset after a failed login
    page.get_by_label("password").fill(ADMIN_PASSWORD)
    page.get_by_role("button", name="Login").click()
    expect(page.locator("#memory")).to_contain_text("Device memory", timeout=20_000)
    expect(page.locator("#memory")).to_contain_text("KV used")
    expect(page.locator("#totals")).to_contain_text("KV pool")
    expect(page.locator("#sessions")).to_contain_text("state")
    time.sleep(3)  # a couple of refreshes so the plots have points
    page.screenshot(path=str(ARTIFACTS / "admin.png"), full_page=True)
    context.close()
