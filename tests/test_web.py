"""The web app over HTTP: Gradio clients chatting at once, admin credential, no file leaks."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from engine.model.loader import LoadedModel
from tests.web import ADMIN_PASSWORD, running_server


def owner_of(client: Client) -> str:
    """The owner string of a gradio_client's anonymous identity (the cookie /config set)."""
    browser_id = client.cookies["crowdchat_id"].partition(".")[0]
    assert len(browser_id) == 32
    return f"browser:{browser_id}"


def reply_text(chatbot: list[dict]) -> list[tuple[str, str]]:
    out = []
    for m in chatbot:
        content = m["content"]
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        out.append((m["role"], content))
    return out


def test_three_clients_chat_at_once_and_see_only_their_own(server: tuple) -> None:
    url, engine, sm = server
    results: dict[int, list[tuple[str, str]]] = {}
    users: dict[int, str] = {}

    def chat(i: int) -> None:
        client = Client(url, verbose=False)
        users[i] = owner_of(client)
        out = client.predict(
            f"Tell me a long story about the number {i}.",
            "",
            0.0,
            1.0,
            96,
            1.0,
            api_name="/on_send",
        )
        results[i] = reply_text(out[0])
        follow = client.predict(
            "Thanks! One more sentence please.", "", 0.0, 1.0, 16, 1.0, api_name="/on_send"
        )
        results[i] = reply_text(follow[0])

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == [0, 1, 2]
    for i, history in results.items():
        assert [r for r, _ in history] == ["user", "assistant", "user", "assistant"]
        assert history[0][1] == f"Tell me a long story about the number {i}."
        assert all(text for _, text in history)
        sessions = sm.list_sessions(users[i])
        assert len(sessions) == 1 and len(sm.messages(users[i], sessions[0]["id"])) == 4
    assert engine.stats().max_batch_seen > 1  # they really shared forward passes


def test_bad_input_shows_a_message_and_keeps_the_text(server: tuple) -> None:
    url, _, _ = server
    client = Client(url, verbose=False)
    out = client.predict("   ", "", 0.7, 0.9, 64, 1.0, api_name="/on_send")
    assert "type a message" in out[1].lower() or "empty" in out[1].lower()
    big = "x" * 40_000
    out = client.predict(big, "", 0.7, 0.9, 64, 1.0, api_name="/on_send")
    assert "limit" in out[1]
    # past a slider's range (an API caller can send anything): Gradio refuses it by name
    with pytest.raises(AppError, match="greater than maximum value 2"):
        client.predict("Hi", "", 0.7, 0.9, 64, 5.0, api_name="/on_send")
    out = client.predict("Hi", "", 0.0, 1.0, 16, 1.3, api_name="/on_send")  # in range: a reply
    assert out[0][-1]["role"] == "assistant" and out[0][-1]["content"] and out[1] == ""


def test_admin_needs_the_password(server: tuple) -> None:
    url, _, _ = server
    with httpx.Client(base_url=url) as http:
        for path in ("/admin/config", "/admin/gradio_api/info"):
            assert http.get(path).status_code == 401
        bad = http.post("/admin/login", data={"username": "admin", "password": "nope"})
        assert bad.status_code in (400, 401)
        assert http.get("/admin/config").status_code == 401
        ok = http.post("/admin/login", data={"username": "admin", "password": ADMIN_PASSWORD})
        assert ok.status_code == 200
        assert http.get("/admin/config").status_code == 200


def test_database_and_snapshots_are_never_served(server: tuple) -> None:
    url, _, sm = server
    db = sm.store.path.resolve()
    paths = [
        "/crowdchat.db",
        "/snapshots/",
        "/../crowdchat.db",
        f"/gradio_api/file={db}",
        "/gradio_api/file=crowdchat.db",
        f"/file={db}",
        "/static/../crowdchat.db",
        "/gradio_api/file=../../etc/passwd",
        "/%2e%2e/%2e%2e/etc/passwd",
    ]
    with httpx.Client(base_url=url) as http:
        for path in paths:
            r = http.get(path)
            assert r.status_code in (400, 403, 404, 405), (path, r.status_code)
            assert b"SQLite format" not in r.content


def test_admin_is_disabled_without_a_password(nf4_model: LoadedModel, tmp_path: Path) -> None:
    with running_server(nf4_model, tmp_path, admin_password=None) as (url, _, _):
        r = httpx.get(url + "/admin/")
        assert r.status_code == 404 and "disabled" in r.text


def test_a_client_that_goes_away_frees_its_slot(server: tuple) -> None:
    url, engine, _ = server
    import time

    client = Client(url, verbose=False)
    job = client.submit(
        "Write an endless story about the sea.",
        "",
        0.0,
        1.0,
        2000,
        1.0,
        api_name="/on_send",
    )
    deadline = time.time() + 60
    while engine.stats().running == 0 and time.time() < deadline:
        time.sleep(0.1)
    assert engine.stats().running == 1
    time.sleep(0.5)
    job.cancel()
    client.close()
    deadline = time.time() + 10
    while engine.stats().running and time.time() < deadline:
        time.sleep(0.1)
    assert engine.stats().running == 0
