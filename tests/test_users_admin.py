"""Users on the admin page (with --auth): add, disable and enable, reset a password, grant and
revoke the admin role, revoke API keys; each change counts at once over HTTP and is logged."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, expect

from engine import InvalidRequest
from engine.model.loader import LoadedModel
from tests.browser_rig import ADMIN_VIEW, log_in, open_page
from tests.test_doors import PASSWORD, add_user
from tests.web import bearer, running_server
from ui.auth import User, parse_users, users_checker
from ui.users_admin import UsersAdmin

HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
PAGE = "/export/all.json"  # a chat-page route that needs a sign-in (the form's are open)


def login_status(url: str, name: str, password: str) -> int:
    return httpx.post(f"{url}/login", data={"username": name, "password": password}).status_code


def test_the_users_file_keeps_the_disabled_flag_and_reads_old_files() -> None:
    data = b"ann:h1\nroot:h2:admin\nbob:h3:disabled\neve:h4:admin,disabled\n"
    users = parse_users(data, Path("users.txt"))
    assert users["ann"] == User("ann", "h1")
    assert users["root"].admin and not users["root"].disabled
    assert users["bob"].disabled and not users["bob"].admin
    assert users["eve"].admin and users["eve"].disabled
    assert "".join(u.line + "\n" for u in users.values()).encode() == data
    with pytest.raises(InvalidRequest, match="unknown role 'boss'"):
        parse_users(b"ann:h1:boss\n", Path("users.txt"))


def sign_in(url: str, name: str, password: str) -> httpx.Client:
    http = httpx.Client(base_url=url, timeout=60)
    r = http.post("/login", data={"username": name, "password": password})
    assert r.status_code == 200, (name, r.text)
    return http


def test_each_change_counts_at_once_over_http_and_is_logged(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    users_file = tmp_path / "users.txt"
    add_user(users_file, "root", "--admin")
    add_user(users_file, "bob")
    apps: list = []
    with running_server(
        nf4_model, tmp_path / "data", apps=apps, auth_file=users_file, admin_password=None
    ) as (url, _engine, sm):
        doors = apps[0].state.doors
        admin = UsersAdmin(doors.resolver.users, doors.keys, sm)
        _row, key = doors.keys.issue("user:bob", "laptop")
        bob = sign_in(url, "bob", PASSWORD)
        assert bob.get(PAGE).status_code == 200
        assert (
            httpx.post(f"{url}/v1/chat/completions", json=HI, headers=bearer(key)).status_code
            == 200
        )
        table = admin.table().set_index("user")
        assert table.loc["bob", "last sign-in"] != "never" and table.loc["bob", "API keys"] == 1
        assert table.loc["root", "role"] == "admin" and table.loc["root", "last sign-in"] == "never"

        # disabled: bob's sign-in, his key and a new sign-in all stop at once
        assert admin.set_disabled("root", "bob", True) == "bob is disabled. 1 API key revoked."
        assert bob.get(PAGE).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=bearer(key)).status_code == 401
        assert login_status(url, "bob", PASSWORD) == 400
        assert admin.set_disabled("root", "root", True).startswith("Error: you cannot")
        assert admin.set_disabled("root", "bob", False) == "bob is enabled."
        # re-enabled: his old key stays revoked (issue 57); a new one works
        assert httpx.get(f"{url}/v1/models", headers=bearer(key)).status_code == 401
        _row, key = doors.keys.issue("user:bob", "laptop")
        assert httpx.get(f"{url}/v1/models", headers=bearer(key)).status_code == 200
        bob = sign_in(url, "bob", PASSWORD)

        # a reset password ends the sign-ins made with the old one; a generated one shows once
        said = admin.reset_password("root", "bob", "")
        new = re.search(r"`(.+)`", said).group(1)
        assert bob.get(PAGE).status_code == 401
        assert (
            httpx.post(f"{url}/login", data={"username": "bob", "password": PASSWORD}).status_code
            == 400
        )
        bob = sign_in(url, "bob", new)

        # the admin role opens /admin; taken back, it closes it
        assert bob.get("/admin/").status_code == 403
        assert admin.set_admin("root", "bob", True) == "bob is an admin."
        assert bob.get("/admin/").status_code == 200
        assert admin.set_admin("root", "bob", False) == "bob is no longer an admin."
        assert bob.get("/admin/").status_code == 403
        assert admin.set_admin("root", "root", False).startswith("Error")

        # his keys, revoked
        assert admin.revoke_keys("root", "bob") == "Revoked 1 API key of bob."
        assert httpx.get(f"{url}/v1/models", headers=bearer(key)).status_code == 401

        # a new user: a set password, or a generated one; names and passwords are checked
        assert (
            admin.add("root", "carol", "carols-password")
            == "Added carol with the password you set."
        )
        sign_in(url, "carol", "carols-password").close()
        dave = re.search(r"`(.+)`", admin.add("root", "dave", "")).group(1)
        sign_in(url, "dave", dave).close()
        bad = [("bad:name", "long-enough"), ("eve", "short"), ("carol", "long-enough"), ("", "x")]
        for name, password in bad:
            assert admin.add("root", name, password).startswith("Error"), name
        log = admin.changes()
        assert list(log["change"])[:3] == ["added", "added", "revoked 1 API keys of"]
        assert set(log["by"]) == {"root"} and "disabled" in set(log["change"])
        bob.close()


def test_a_disabled_user_is_refused_in_the_same_time_as_a_wrong_password(tmp_path: Path) -> None:
    users_file = tmp_path / "users.txt"
    add_user(users_file, "bob")
    seen: list[str] = []
    check = users_checker(users_file, seen.append)
    assert check("bob", PASSWORD) and seen == ["bob"]
    users_file.write_text(users_file.read_text().strip() + ":disabled\n")
    assert not check("bob", PASSWORD) and seen == ["bob"]


def test_the_admin_page_adds_a_user_who_then_signs_in(
    browser: Browser, nf4_model: LoadedModel, tmp_path: Path
) -> None:
    users_file = tmp_path / "users.txt"
    add_user(users_file, "root", "--admin")
    with running_server(
        nf4_model, tmp_path / "data", auth_file=users_file, admin_password=None
    ) as (url, _engine, _sm):
        context, page = open_page(browser, url + "/", ADMIN_VIEW)
        log_in(page, "root", PASSWORD)
        expect(page.locator("#message textarea")).to_be_visible(timeout=30_000)
        page.goto(url + "/admin/")
        expect(page.locator("#users-table")).to_contain_text("root", timeout=30_000)
        page.locator("#user-name textarea, #user-name input").first.fill("zoe")
        page.locator("#user-add").click()
        expect(page.locator("#user-said")).to_contain_text("Added zoe", timeout=20_000)
        password = re.search(r"once: (\S+)", page.locator("#user-said").inner_text()).group(1)
        expect(page.locator("#users-table")).to_contain_text("zoe")
        context.close()
        context, page = open_page(browser, url + "/")
        log_in(page, "zoe", password.strip("`"))
        expect(page.locator("#message textarea")).to_be_visible(timeout=30_000)
        context.close()
