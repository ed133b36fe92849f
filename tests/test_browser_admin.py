"""A real browser (Debian chromium driven by Playwright) on the admin page (its sign-in, memory
figures, upstream replicas) and on the chat page's sign-in form with its API keys section."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from playwright.sync_api import Browser, expect

from engine.model.loader import LoadedModel, dtype_name
from engine.served import owner_label
from tests.browser_rig import ADMIN_VIEW, ARTIFACTS, log_in, open_page
from tests.web import ADMIN_PASSWORD, running_server
from ui.auth import hash_password


def test_admin_login_and_memory_figures(browser: Browser, server: tuple) -> None:
    url, _, _ = server
    ARTIFACTS.mkdir(exist_ok=True)
    context, page = open_page(browser, url + "/admin", ADMIN_VIEW)  # as the server prints it
    log_in(page, "admin", "wrong password")
    expect(page.get_by_text("Incorrect credentials")).to_be_visible(timeout=10_000)
    expect(page.get_by_label("username")).to_have_value("admin")  # kept; the password is not
    expect(page.get_by_label("password")).to_have_value("")
    page.get_by_label("password").fill(ADMIN_PASSWORD)
    page.get_by_role("button", name="Login").click()
    expect(page.locator("#memory")).to_contain_text("Device memory", timeout=20_000)
    expect(page.locator("#memory")).to_contain_text("KV used")
    expect(page.locator("#totals")).to_contain_text("KV pool")
    # the pool's dtype beside its bytes a token (bfloat16 on this CPU with nf4, see --kv-dtype)
    kv_dtype = dtype_name(server[1].loaded.kv_dtype)
    expect(page.locator("#totals")).to_contain_text(f"MB, {kv_dtype}, ")
    expect(page.locator("#sessions")).to_contain_text("state")
    time.sleep(3)  # a couple of refreshes so the plots have points
    page.screenshot(path=str(ARTIFACTS / "admin.png"), full_page=True)
    context.close()


def test_with_sign_in_a_wrong_password_keeps_the_name_then_the_page_shows_the_api_keys(
    browser: Browser, nf4_model: LoadedModel, tmp_path: Path
) -> None:
    users = tmp_path / "users.txt"
    users.write_text(f"ann:{hash_password('s3cret-pass')}\n")
    with running_server(nf4_model, tmp_path / "data", auth_file=users) as (url, _, _):
        # the sign-in form renders behind the Doors middleware; a refusal says why and keeps
        # the name (Gradio's own form emptied both fields)
        context, page = open_page(browser, url + "/")
        log_in(page, "ann", "wrong password")
        expect(page.get_by_text("Incorrect credentials")).to_be_visible(timeout=10_000)
        expect(page.get_by_label("username")).to_have_value("ann")
        expect(page.get_by_label("password")).to_have_value("")
        page.get_by_label("password").fill("s3cret-pass")
        page.get_by_role("button", name="Login").click()
        expect(page.locator("#message textarea")).to_be_visible(timeout=30_000)
        page.locator("#settings-open").click()  # the keys are in the settings dialog
        page.locator("#api-keys").get_by_role("button").first.click()
        page.locator("#api-keys input").first.fill("from the browser")
        page.locator("#create-key").click()
        expect(page.locator("#new-key")).to_contain_text("cc-", timeout=20_000)
        expect(page.locator("#keys")).to_contain_text("from the browser", timeout=20_000)
        context.close()


def test_admin_shows_upstream_replicas(browser: Browser, model_dir: Path, tmp_path: Path) -> None:
    """With --engine-url the admin page lists the replicas with what their /metrics say."""
    from engine import EngineConfig
    from engine.model.loader import local_tokenizer
    from tests.fake_upstream import FakeReplica
    from tests.upstream_rig import upstream_server

    local = local_tokenizer(EngineConfig(data_dir=model_dir))
    reps = [FakeReplica("r0").start(), FakeReplica("r1").start()]
    app = {"admin_password": ADMIN_PASSWORD}
    try:
        with upstream_server(reps, tmp_path, local, app=app) as (url, backend, _sm, _m):
            backend.drain(reps[1].url)
            context, page = open_page(browser, url + "/admin/", ADMIN_VIEW)
            log_in(page, "admin", ADMIN_PASSWORD)
            table = page.locator("#replicas")
            expect(table).to_contain_text(reps[0].url, timeout=20_000)
            expect(table).to_contain_text("draining")
            expect(table).to_contain_text("25")  # vllm:kv_cache_usage_perc 0.25
            expect(page.locator("#totals")).to_contain_text("upstream: 2/2 replicas healthy")
            page.screenshot(path=str(ARTIFACTS / "admin-upstream.png"), full_page=True)
            context.close()
    finally:
        for r in reps:
            r.stop()


DESKTOP = {"width": 1280, "height": 900}
WIDEST = """() => [...document.querySelectorAll('*')].filter(e => e.getBoundingClientRect().right
  > innerWidth + 1 && ![...e.children].some(c => c.getBoundingClientRect().right > innerWidth + 1))
  .slice(0, 8).map(e => e.tagName + '#' + e.id + '.' + e.className).join(' | ')"""
PHONE = {"width": 390, "height": 844}


def _session_of(sm: object, owner: str, text: str) -> str:
    from engine import SamplingParams

    sid = sm.create_session(owner)["id"]  # type: ignore[attr-defined]
    sm.chat(owner, sid, text, SamplingParams(temperature=0, max_new_tokens=4)).result()  # type: ignore[attr-defined]
    return sid


@pytest.mark.parametrize("size", [DESKTOP, PHONE], ids=["1280x900", "390x844"])
def test_admin_page_fits_the_screen_names_users_alike_and_acts_on_a_clicked_row(
    browser: Browser, server: tuple, size: dict
) -> None:
    url, _, sm = server
    sid = _session_of(sm, "user:dora", "Name three rivers of Europe.")
    _session_of(sm, "browser:admin-test-browser-id", "Name one mountain.")
    context, page = open_page(browser, url + "/admin/", size)
    log_in(page, "admin", ADMIN_PASSWORD)
    sessions = page.locator("#sessions")
    expect(sessions).to_contain_text("Name three rivers", timeout=20_000)
    # clock times: the server's zone, said on the page
    expect(page.locator("#zone")).to_contain_text(time.localtime().tm_zone)
    # the same user, the same name in both tables; a browser by its hash, never its id
    label = "browser " + owner_label("browser:admin-test-browser-id")
    for table in ("#sessions", "#served"):
        expect(page.locator(table)).to_contain_text("dora", timeout=20_000)
        expect(page.locator(table)).to_contain_text(label)
    assert "admin-test-browser-id"[-6:] not in page.locator("#sessions").inner_text()
    # nothing wider than the screen; on a phone the plots stand one above another
    page.wait_for_timeout(500)
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= size["width"], (width, page.evaluate(WIDEST))
    boxes = [page.locator("#plots > *").nth(i).bounding_box() for i in range(4)]
    assert all(b is not None and b["x"] + b["width"] <= size["width"] for b in boxes)
    if size is PHONE:
        assert boxes[0]["y"] < boxes[1]["y"] < boxes[2]["y"] < boxes[3]["y"]  # type: ignore[index]
    ARTIFACTS.mkdir(exist_ok=True)
    name = "admin-desktop.png" if size is DESKTOP else "admin-phone.png"
    page.screenshot(path=str(ARTIFACTS / name), full_page=True)
    # a click on the row chooses the session; the buttons act on it
    sessions.get_by_text("Name three rivers").filter(visible=True).first.click()
    expect(page.locator("#session-id input, #session-id textarea")).to_have_value(sid[:12])
    expect(page.locator("#picked")).to_contain_text("dora")
    page.locator("#persist").click()
    expect(page.locator("#result")).to_contain_text(f"persisted {sid[:12]}")
    page.locator("#drop-kv").click()
    expect(page.locator("#result")).to_contain_text(f"dropped the KV of {sid[:12]}")
    page.locator("#delete").click()
    expect(page.locator("#result")).to_contain_text(f"deleted {sid[:12]}")
    assert sm.store.get_session(sid) is None
    context.close()
