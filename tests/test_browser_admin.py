"""A real browser (Debian chromium driven by Playwright) on the admin page (its sign-in, memory
figures, upstream replicas) and on the chat page's sign-in form with its API keys section."""

from __future__ import annotations

import time
from pathlib import Path

from playwright.sync_api import Browser, expect

from engine.model.loader import LoadedModel, dtype_name
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


def test_with_sign_in_the_page_signs_in_and_shows_the_api_keys_section(
    browser: Browser, nf4_model: LoadedModel, tmp_path: Path
) -> None:
    users = tmp_path / "users.txt"
    users.write_text(f"ann:{hash_password('s3cret-pass')}\n")
    with running_server(nf4_model, tmp_path / "data", auth_file=users) as (url, _, _):
        # the sign-in form renders behind the Doors middleware
        context, page = open_page(browser, url + "/")
        log_in(page, "ann", "s3cret-pass")
        expect(page.locator("#message textarea")).to_be_visible(timeout=30_000)
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
