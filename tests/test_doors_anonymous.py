"""The doors in anonymous mode, over HTTP against the real server: the signed identity cookie
(a forged or altered one is a new identity, another browser's id gets nothing), the cap on new
identities per address, the body cap, and an API keys file that closes the open API."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gradio_client import Client

from engine.model.loader import LoadedModel
from tests.web import bearer, running_server

HI = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def anonymous(
    nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, object, Path]]:
    data = tmp_path_factory.mktemp("anonymous")
    with running_server(nf4_model, data, max_body_bytes=4096) as (url, _engine, sm):
        yield url, sm, data


def test_the_anonymous_identity_is_a_signed_httponly_samesite_cookie(anonymous: tuple) -> None:
    url, _, data = anonymous
    r = httpx.get(url + "/")
    header = r.headers["set-cookie"]
    assert "HttpOnly" in header and "SameSite=Lax" in header and "Path=/" in header
    value = r.cookies["crowdchat_id"]
    browser_id, _, mac = value.partition(".")
    key = (data / "cookie.key").read_text().strip().encode()
    want = hmac.new(key, b"crowdchat_id:" + browser_id.encode(), hashlib.sha256).hexdigest()
    assert len(browser_id) == 32 and mac == want
    assert (data / "cookie.key").stat().st_mode & 0o077 == 0
    again = httpx.get(url + "/", cookies={"crowdchat_id": value})
    assert "set-cookie" not in again.headers  # a valid cookie is kept


def test_a_forged_or_altered_cookie_is_a_new_identity(anonymous: tuple) -> None:
    url, sm, _ = anonymous
    alice = Client(url, verbose=False)
    alice.predict("Hello, I am Alice.", "", 0.0, 1.0, 16, 1.0, api_name="/on_send")
    value = alice.cookies["crowdchat_id"]
    alice_id, _, mac = value.partition(".")
    assert len(sm.list_sessions(f"browser:{alice_id}")) == 1
    forged = [
        f"{alice_id}.{'0' * 64}",  # her id, a made-up signature
        f"{alice_id}.{mac[:-1]}{'0' if mac[-1] != '0' else '1'}",  # one character changed
        alice_id,  # no signature at all
    ]
    for cookie in forged:
        r = httpx.get(url + "/config", cookies={"crowdchat_id": cookie})
        assert r.status_code == 200
        assert r.cookies["crowdchat_id"].partition(".")[0] != alice_id
        mallory = Client(url, verbose=False, httpx_kwargs={"cookies": {"crowdchat_id": cookie}})
        history, _status, _system, listing, *_ = mallory.predict(api_name="/on_load")
        assert listing["items"] == [] and history == []


def test_new_identities_per_address_are_capped(nf4_model: LoadedModel, tmp_path: Path) -> None:
    with running_server(nf4_model, tmp_path, new_identities_per_minute=3) as (url, _, _):
        first = httpx.get(url + "/")
        codes = [first.status_code] + [httpx.get(url + "/").status_code for _ in range(2)]
        assert codes == [200, 200, 200]
        r = httpx.get(url + "/")
        assert r.status_code == 429 and "too many new visitors" in r.text.lower()
        assert "set-cookie" not in r.headers
        # the ones who have an identity keep being served
        again = httpx.get(url + "/config", cookies={"crowdchat_id": first.cookies["crowdchat_id"]})
        assert again.status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 200


def load_event_as_sent_by_hand(url: str, client: Client, data: list) -> list[str]:
    """POST the page's load event to Gradio's queue with `data` as its inputs, as a script
    would (the page never sends an owner); returns the queue's messages for it."""
    load = next(d for d in client.config["dependencies"] if d.get("api_name") == "on_load")
    session = "h" + "0" * 10
    with httpx.Client(base_url=url + "/gradio_api", cookies=client.cookies, timeout=60) as http:
        body = {"data": data, "fn_index": load["id"], "session_hash": session}
        http.post("/queue/join", json=body).raise_for_status()
        with http.stream("GET", "/queue/data", params={"session_hash": session}) as events:
            lines = []
            for line in events.iter_lines():
                lines.append(line)
                if "process_completed" in line:
                    return lines
    return lines


def test_knowing_another_browsers_id_gets_nothing_of_its_conversations(
    anonymous: tuple,
) -> None:
    """An older version moved every conversation of a browser id the load event was sent (its
    localStorage id) to the caller: a script knowing Alice's id took her list."""
    url, sm, _ = anonymous
    alice = Client(url, verbose=False)
    alice.predict("Hello, I am Alice.", "", 0.0, 1.0, 16, 1.0, api_name="/on_send")
    alice_id = alice.cookies["crowdchat_id"].partition(".")[0]
    hers = [s["id"] for s in sm.list_sessions(f"browser:{alice_id}")]
    assert len(hers) == 1
    bob = Client(url, verbose=False)
    bob_id = bob.cookies["crowdchat_id"].partition(".")[0]
    for data in ([alice_id, None], [alice_id], [f"browser:{alice_id}", None]):
        load_event_as_sent_by_hand(url, bob, data)
    history, _status, _system, listing, *_ = bob.predict(api_name="/on_load")
    assert listing["items"] == [] and history == []
    assert sm.list_sessions(f"browser:{bob_id}") == []
    assert [s["id"] for s in sm.list_sessions(f"browser:{alice_id}")] == hers
    again = alice.predict(api_name="/on_load")[3]
    assert [item["id"] for item in again["items"]] == hers


def test_a_body_over_the_cap_gets_413_and_the_server_keeps_serving(anonymous: tuple) -> None:
    url, _, _ = anonymous
    big = {"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 2}
    with httpx.Client(base_url=url, timeout=120) as http:
        r = http.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: the cap holds while reading
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}], "max_tokens": 2}'

        r = http.post("/v1/chat/completions", content=chunks())
        assert r.status_code == 413, r.text
        r = http.post("/gradio_api/queue/join", content=b"z" * 5000)
        assert r.status_code == 413 and "too large" in r.text
    ok = httpx.post(url + "/v1/chat/completions", json=HI, timeout=120)
    assert ok.status_code == 200


def test_api_keys_file_closes_the_anonymous_api(nf4_model: LoadedModel, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# service keys\nci:ci-key-0123456789abcdef\nplain-key-0123456789abcdef\n")
    with running_server(nf4_model, tmp_path / "data", api_keys_file=keys) as (url, _, sm):
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.get("/v1/models").status_code == 401
            assert (
                http.get("/v1/models", headers=bearer("nope-0123456789abcdef")).status_code == 401
            )
            for key in ("ci-key-0123456789abcdef", "plain-key-0123456789abcdef"):
                assert http.get("/v1/models", headers=bearer(key)).status_code == 200
            sid = http.post("/v1/sessions", headers=bearer("ci-key-0123456789abcdef")).json()["id"]
        assert sm.get_session("api:ci", sid)["owner"] == "api:ci"
