"""Every door checks the same identity, over HTTP against the real server: with sign-in the
API, /metrics and /admin refuse without credentials; per-user API keys; sign-in throttling.
The anonymous cookie, the new-identity cap and the body cap are
tests/test_doors_anonymous.py's."""

from __future__ import annotations

import hashlib
import io
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from gradio_client import Client

from doors.config import AppConfig
from engine.errors import InvalidRequest
from engine.model.loader import LoadedModel
from tests.web import ADMIN_PASSWORD, bearer, running_server
from ui import auth
from ui.pages import gradio_app

PASSWORD = "s3cret-pass"
METRICS_TOKEN = "metrics-token-0123456789"
HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def add_user(users: Path, name: str, *flags: str, password: str = PASSWORD) -> None:
    old = sys.stdin
    sys.stdin = io.StringIO(password + "\n")
    try:
        auth.main([str(users), name, *flags])
    finally:
        sys.stdin = old


def cli_key(data_dir: Path, *args: str, capsys: pytest.CaptureFixture) -> str:
    """Run `python -m ui.auth keys DATA_DIR ...` in-process; its last output line."""
    capsys.readouterr()
    auth.main(["keys", str(data_dir), *args])
    return capsys.readouterr().out.strip().splitlines()[-1]


@contextmanager
def signed_in(url: str, name: str, password: str = PASSWORD) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/login", data={"username": name, "password": password})
        assert r.status_code == 200, r.text
        yield http


@pytest.fixture(scope="module")
def users_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    users = tmp_path_factory.mktemp("users") / "users.txt"
    add_user(users, "ann")
    add_user(users, "bob")
    add_user(users, "root", "--admin")
    add_user(users, "jösé")
    return users


@pytest.fixture(scope="module")
def signin(
    nf4_model: LoadedModel, users_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, object, Path]]:
    data = tmp_path_factory.mktemp("doors")
    with running_server(
        nf4_model, data, auth_file=users_file, admin_password=None, metrics_token=METRICS_TOKEN
    ) as (url, _engine, sm):
        yield url, sm, data


def test_with_sign_in_every_door_refuses_without_credentials(signin: tuple) -> None:
    url, _, _ = signin
    with httpx.Client(base_url=url, timeout=60) as http:
        for method, path in (
            ("GET", "/v1/models"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/v1/sessions"),
        ):
            r = http.request(method, path, json=HI)
            assert r.status_code == 401, (path, r.status_code)
            assert r.json()["error"]["code"] == "invalid_api_key"
        bad = http.get("/v1/models", headers=bearer("cc-" + "x" * 43))
        assert bad.status_code == 401 and "invalid" in bad.json()["error"]["message"].lower()
        assert http.get("/metrics").status_code == 401
        assert http.get("/metrics", headers=bearer("wrong-token-0123456789")).status_code == 401
        assert http.get("/admin/").status_code == 401
        assert http.get("/admin/config").status_code == 401
        assert http.post("/gradio_api/queue/join", json={}).status_code == 401
        assert http.get("/gradio_api/upload_progress").status_code == 401
        assert http.get("/health").status_code == 200
        assert http.get("/").status_code == 200  # the sign-in form renders


def test_a_users_key_opens_the_api_until_it_is_revoked(
    signin: tuple, capsys: pytest.CaptureFixture
) -> None:
    url, sm, data = signin
    key = cli_key(data, "create", "ann", "laptop", capsys=capsys)
    assert key.startswith("cc-") and len(key) == 46
    with httpx.Client(base_url=url, timeout=120) as http:
        assert http.get("/v1/models", headers=bearer(key)).status_code == 200
        r = http.post("/v1/chat/completions", json=HI, headers=bearer(key))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        listed = cli_key(data, "list", "ann", capsys=capsys)
        key_id = listed.split("\t")[0]
        assert "user:ann" in listed and "active" in listed and "never" not in listed
        assert key not in listed and hashlib.sha256(key.encode()).hexdigest() not in listed
        assert cli_key(data, "revoke", key_id, capsys=capsys) == f"key {key_id} revoked"
        r = http.get("/v1/models", headers=bearer(key))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # only the hash is stored
    row = sm.store.sql.reader().execute("select hash from api_keys where id = ?", [key_id])
    assert row.fetchone()[0] == hashlib.sha256(key.encode()).hexdigest()


def test_a_second_users_key_cannot_reach_the_first_users_sessions(
    signin: tuple, capsys: pytest.CaptureFixture
) -> None:
    url, sm, data = signin
    ann = cli_key(data, "create", "ann", capsys=capsys)
    bob = cli_key(data, "create", "bob", capsys=capsys)
    with httpx.Client(base_url=url, timeout=120) as http:
        sid = http.post("/v1/sessions", json={"title": "ann's"}, headers=bearer(ann)).json()["id"]
        assert [s["id"] for s in sm.list_sessions("user:ann")].count(sid) == 1  # the page's too
        turn = {**HI, "messages": HI["messages"]}
        r = http.post(
            "/v1/chat/completions", json=turn, headers={**bearer(bob), "X-Session-Id": sid}
        )
        assert r.status_code == 404
        r = http.post(
            "/v1/chat/completions", json=turn, headers={**bearer(ann), "X-Session-Id": sid}
        )
        assert r.status_code == 200
    assert len(sm.messages("user:ann", sid)) == 2


def test_metrics_needs_an_admins_key_or_the_metrics_token(
    signin: tuple, capsys: pytest.CaptureFixture
) -> None:
    url, _, data = signin
    ann = cli_key(data, "create", "ann", capsys=capsys)
    root = cli_key(data, "create", "root", capsys=capsys)
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/metrics", headers=bearer(ann)).status_code == 403
        assert http.get("/metrics", headers=bearer(root)).status_code == 200
        r = http.get("/metrics", headers=bearer(METRICS_TOKEN))
        assert r.status_code == 200 and "crowdchat_engine_up" in r.text


def test_admin_needs_the_admin_role_and_non_ascii_names_sign_in(signin: tuple) -> None:
    url, _, _ = signin
    with signed_in(url, "ann") as http:
        assert http.get("/gradio_api/info").status_code == 200  # the chat page is hers
        r = http.get("/admin/config")
        assert r.status_code == 403 and "not an admin" in r.text
    with signed_in(url, "root") as http:
        assert http.get("/admin/config").status_code == 200
        assert http.get("/admin/gradio_api/info").status_code == 200
    with httpx.Client(base_url=url, timeout=60) as http:
        bad = http.post("/login", data={"username": "jösé", "password": "wrong-password"})
        assert bad.status_code == 400  # refused, not a TypeError (500)
    with signed_in(url, "jösé") as http:
        assert http.get("/admin/config").status_code == 403


def test_a_sign_in_ends_after_its_hours_and_when_the_password_changes(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    users = tmp_path / "users.txt"
    add_user(users, "ann")
    add_user(users, "bob")
    apps: list = []
    with running_server(
        nf4_model, tmp_path, apps=apps, auth_file=users, admin_password=None, sign_in_hours=2
    ) as (url, _, _):
        sign_ins = apps[0].state.doors.sign_ins
        with signed_in(url, "ann") as ann, signed_in(url, "bob") as bob:
            assert ann.get("/gradio_api/info").status_code == 200
            assert bob.get("/gradio_api/info").status_code == 200
            # bob's password changes (it leaked): his sign-in ends at once, ann's does not
            add_user(users, "bob", password="a-new-s3cret")
            assert bob.get("/gradio_api/info").status_code == 401
            assert ann.get("/gradio_api/info").status_code == 200
            # two hours and a second later ann's ends too, and its token is dropped
            sign_ins.clock = lambda: time.monotonic() + 2 * 3600 + 1
            assert ann.get("/gradio_api/info").status_code == 401
            assert len(sign_ins) == 0
            sign_ins.clock = time.monotonic
        with signed_in(url, "ann") as ann:  # signing in again works
            assert ann.get("/gradio_api/info").status_code == 200
        with httpx.Client(base_url=url, timeout=60) as http:
            old = http.post("/login", data={"username": "bob", "password": PASSWORD})
            assert old.status_code == 400
        with signed_in(url, "bob", "a-new-s3cret") as bob:
            assert bob.get("/gradio_api/info").status_code == 200
    with pytest.raises(InvalidRequest, match="sign-in-hours"):
        AppConfig(sign_in_hours=0)


def test_the_chat_page_section_issues_lists_and_revokes_keys(signin: tuple) -> None:
    url, _, _ = signin
    client = Client(url, auth=("bob", PASSWORD), verbose=False)
    shown, table, _name = client.predict("script", api_name="/on_create")
    key = next(word for word in shown.split() if word.startswith("cc-"))
    key_id = table["data"][0][0]
    assert table["data"][0][1] == "script" and table["data"][0][4] == "active"
    assert httpx.get(url + "/v1/models", headers=bearer(key)).status_code == 200
    note, table, _ = client.predict(key_id, api_name="/on_revoke")
    assert "revoked" in note and table["data"][0][4] == "revoked"
    assert httpx.get(url + "/v1/models", headers=bearer(key)).status_code == 401


def test_sign_in_is_throttled_per_name_and_address_before_pbkdf2_runs(
    nf4_model: LoadedModel, users_file: Path, tmp_path: Path
) -> None:
    apps: list = []
    with running_server(
        nf4_model,
        tmp_path,
        apps=apps,
        auth_file=users_file,
        admin_password=None,
        login_failures_per_name=3,
        login_failures_per_address=5,
    ) as (url, _, _):
        throttle = apps[0].state.doors.throttle
        with httpx.Client(base_url=url, timeout=60) as http:

            def login(name: str, password: str = "wrong-password") -> httpx.Response:
                return http.post("/login", data={"username": name, "password": password})

            assert [login("ann").status_code for _ in range(3)] == [400] * 3
            hashes = throttle.hashes_run
            refused = login("ann", PASSWORD)  # even the right password waits now
            assert refused.status_code == 429 and "wait a minute" in refused.json()["detail"]
            assert throttle.hashes_run == hashes  # refused before any PBKDF2 ran
            assert login("bob", PASSWORD).status_code == 200  # another name still signs in
            assert [login(n).status_code for n in ("bob", "root")] == [400, 400]
            hashes = throttle.hashes_run
            assert login("jösé").status_code == 429  # 5 failures from this address
            assert throttle.hashes_run == hashes
        assert httpx.get(url + "/health").status_code == 200


def test_admin_password_login_ends_and_is_throttled_too(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    apps: list = []
    with running_server(nf4_model, tmp_path, apps=apps, login_failures_per_name=2) as (url, _, _):
        with signed_in(url + "/admin", "admin", ADMIN_PASSWORD) as admin:
            assert admin.get("/config").status_code == 200
            admin_app = gradio_app(apps[0], "/admin")
            admin_app.tokens.clock = lambda: time.monotonic() + 24 * 3600 + 1
            assert admin.get("/config").status_code == 401  # a day later: sign in again
        with httpx.Client(base_url=url, timeout=60) as http:
            codes = [
                http.post("/admin/login", data={"username": "admin", "password": "no"}).status_code
                for _ in range(3)
            ]
            assert codes == [400, 400, 429]
