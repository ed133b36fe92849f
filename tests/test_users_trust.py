"""Issue 57, the users: a sign-in in flight during a reset is dead (defect 2), the users file
keeps its mode (7), the last admin stays (8), one name validator with line numbers (9), a
disabled user's one-off replies stop (11), and what disabling and re-enabling bring back
(decision 1). Over HTTP on a real --auth server, and on the classes."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine import InvalidRequest
from engine.model.loader import LoadedModel
from tests.test_doors import PASSWORD, add_user
from tests.web import bearer, running_server
from ui import auth
from ui.auth import UsersFile, parse_users
from ui.users_admin import UsersAdmin

PAGE = "/export/all.json"  # a chat-page route that needs a sign-in


@pytest.fixture(scope="module")
def served(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    root = tmp_path_factory.mktemp("users")
    users_file = root / "users.txt"
    add_user(users_file, "root", "--admin")
    for name in ("bob", "cat", "dan"):
        add_user(users_file, name)
    apps: list = []
    with running_server(
        nf4_model,
        root / "data",
        apps=apps,
        auth_file=users_file,
        admin_password=None,
        login_failures_per_name=50,
    ) as (url, _engine, sm):
        doors = apps[0].state.doors
        yield url, sm, UsersAdmin(doors.resolver.users, doors.keys, sm), doors


def sign_in(url: str, name: str, password: str = PASSWORD) -> httpx.Client:
    http = httpx.Client(base_url=url, timeout=120)
    r = http.post("/login", data={"username": name, "password": password})
    assert r.status_code == 200, (name, r.text)
    return http


def test_a_sign_in_checked_against_the_old_password_is_dead_after_a_reset_in_flight(
    served: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _sm, admin, _doors = served
    real = auth.verify_password

    def reset_while_checking(password: str, stored: str) -> bool:
        ok = real(password, stored)  # checked against the old hash...
        if password == PASSWORD:  # ...and the admin's reset lands before the token is made
            assert admin.reset_password("root", "cat", "a-new-password").startswith("cat's")
        return ok

    monkeypatch.setattr(auth, "verify_password", reset_while_checking)
    http = sign_in(url, "cat")  # the old password was right when it was checked
    monkeypatch.setattr(auth, "verify_password", real)
    assert http.get(PAGE).status_code == 401
    assert sign_in(url, "cat", "a-new-password").get(PAGE).status_code == 200


def test_re_enabling_brings_back_neither_old_sign_ins_nor_old_keys(served: tuple) -> None:
    url, sm, admin, doors = served
    _row, key = doors.keys.issue("user:dan", "laptop")
    http = sign_in(url, "dan")
    sid = http.post("/v1/sessions", headers=bearer(key), json={}).json()["id"]
    sm.store.add_message(sid, "user", "hello there")
    token = sm.share("user:dan", sid)["token"]
    assert http.get(f"/share/{token}").status_code == 200
    said = admin.set_disabled("root", "dan", True)
    assert said.startswith("dan is disabled.") and "1 API key revoked" in said
    reader = sign_in(url, "bob")
    assert reader.get(f"/share/{token}").status_code == 404  # a disabled user's links
    assert admin.set_disabled("root", "dan", False) == "dan is enabled."
    assert http.get(PAGE).status_code == 401  # the old sign-in stays ended
    assert httpx.get(f"{url}/v1/models", headers=bearer(key)).status_code == 401
    assert reader.get(f"/share/{token}").status_code == 200  # the links are back
    assert sign_in(url, "dan").get(PAGE).status_code == 200


def test_a_disabled_users_one_off_reply_stops(served: tuple) -> None:
    url, _sm, admin, doors = served
    _row, key = doors.keys.issue("user:bob", "script")
    body = {
        "messages": [{"role": "user", "content": "Count to a thousand."}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    chunks = 0
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, headers=bearer(key), timeout=300
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunks += 1
            if chunks == 2:
                admin.set_disabled("root", "bob", True)
            finish = json.loads(line[6:])["choices"][0].get("finish_reason")
            if finish:
                break
    admin.set_disabled("root", "bob", False)
    assert finish != "length" and chunks < 100


def test_the_last_admin_is_never_demoted_or_disabled_even_at_once(
    served: tuple, tmp_path: Path
) -> None:
    _url, _sm, admin, _doors = served
    assert admin.set_admin("root", "bob", True) == "bob is an admin."
    # two admins take each other's role at the same moment: one of them stays an admin
    start = threading.Barrier(2)
    said: list[str] = []

    def demote(actor: str, name: str) -> None:
        start.wait()
        said.append(admin.set_admin(actor, name, False))

    threads = [threading.Thread(target=demote, args=p) for p in (("root", "bob"), ("bob", "root"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(s.startswith("Error") for s in said) == [False, True], said
    users = admin.users.all()
    left = [n for n, u in users.items() if u.admin]
    assert len(left) == 1
    last = left[0]
    for refused in (
        admin.set_admin("cat", last, False),
        admin.set_disabled("cat", last, True),
    ):
        assert refused.startswith("Error") and "last active admin" in refused
    with pytest.raises(SystemExit, match="last active admin"):  # the CLI, without --admin
        add_user(admin.users.path, last)
    assert admin.set_admin("root", "root", True).endswith("an admin.")


def test_an_admin_change_keeps_the_users_files_mode_and_a_new_file_is_0600(
    served: tuple, tmp_path: Path
) -> None:
    _url, _sm, admin, _doors = served
    path = admin.users.path
    os.chmod(path, 0o600)
    assert admin.set_disabled("root", "cat", True) == "cat is disabled."
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    os.chmod(path, 0o640)
    assert admin.set_disabled("root", "cat", False) == "cat is enabled."
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    os.chmod(path, 0o600)
    fresh = tmp_path / "new-users.txt"
    add_user(fresh, "ann", "--admin")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
    add_user(fresh, "ben")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600


@pytest.mark.parametrize("bad", ["zed\ncarol", "zed\rcarol", "a:b", "a,b", "", "x" * 65,
                                 "tab\there", ".dot"])  # fmt: skip
def test_one_name_rule_for_the_admin_page_the_cli_and_the_file(
    served: tuple, tmp_path: Path, bad: str
) -> None:
    _url, _sm, admin, _doors = served
    before = admin.users.path.read_bytes()
    assert admin.add("root", bad, "a-long-password").startswith("Error: a user name is")
    assert admin.users.path.read_bytes() == before  # nobody was overwritten
    with pytest.raises(SystemExit, match="a user name is"):
        add_user(tmp_path / "cli.txt", bad)
    good = f"ann:{auth.hash_password('x' * 8)}\n"
    data = f"# users\n{good}{bad}:h:admin\n".encode()
    if any(c in bad for c in "\n\r:") or bad.strip() != bad or not bad.strip():
        return  # a line break, a ':' or an outer space is no name a line can hold
    path = tmp_path / "users.txt"
    path.write_bytes(data)
    with pytest.raises(InvalidRequest, match=r"users\.txt line 3: a user name is"):
        UsersFile(path)


def test_a_file_naming_a_user_twice_is_refused_with_the_line() -> None:
    with pytest.raises(InvalidRequest, match=r"line 3: user 'carol' is there twice"):
        parse_users(b"carol:h1\nzed:h2\ncarol:h3\n", Path("users.txt"))
    with pytest.raises(InvalidRequest, match=r"line 1: user 'ann' has no password hash"):
        parse_users(b"ann:\n", Path("users.txt"))
