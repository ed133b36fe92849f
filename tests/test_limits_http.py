"""Each per-user limit and each bound on work per request, over HTTP on a real server: a clear
error for the one who passes it, while another user is served at the same time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import httpx
import pytest

from engine import InvalidRequest, SamplingParams
from engine.model.loader import LoadedModel
from tests.web import PROXY, client_at, running_server

HI = [{"role": "user", "content": "Hi"}]
SHORT = SamplingParams(max_new_tokens=4)
LONG = {"messages": HI, "max_tokens": 500, "ignore_eos": True, "stream": True}
CAPS = {
    "max_turns_per_user": 1,
    "max_requests_per_user": 2,
    "max_sessions_per_user": 3,
    "max_pending_creates": 3,
    "max_pending_creates_per_user": 2,
    "max_messages_per_request": 256,
}


@pytest.fixture(scope="module")
def server(
    nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, object]]:
    with running_server(
        nf4_model,
        tmp_path_factory.mktemp("limits"),
        {"max_model_len": 1024},
        session_overrides=CAPS,
        trusted_proxy=PROXY,
    ) as (url, _engine, sm):
        yield url, sm


def key(name: str) -> dict[str, str]:
    """User `name` of the open API: a client at an address of its own."""
    return client_at(name)


def chat(url: str, who: str, **extra: object) -> httpx.Response:
    headers = key(who)
    if "session" in extra:
        headers["X-Session-Id"] = str(extra.pop("session"))
    body = {"messages": HI, "max_tokens": 4, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def create(url: str, who: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/sessions", headers=key(who), timeout=60)


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def wait_for(cond: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def hold_streams(stack: ExitStack, url: str, who: str, n: int, **headers: str) -> None:
    """Open `n` streaming replies of `who` and keep them answering (until `stack` closes)."""
    client = stack.enter_context(httpx.Client(timeout=120))
    for _ in range(n):
        r = stack.enter_context(
            client.stream(
                "POST",
                f"{url}/v1/chat/completions",
                json=LONG,
                headers={**key(who), **headers},
            )
        )
        assert r.status_code == 200


def test_requests_past_the_per_user_cap_get_429_and_others_are_served(
    server: tuple[str, object],
) -> None:
    url, _sm = server
    with ExitStack() as stack:
        hold_streams(stack, url, "busy", 2)
        e = error(chat(url, "busy"), 429)
        assert "2 requests queued or answering" in e["message"] and "limit is 2" in e["message"]
        assert e["code"] == "rate_limit_exceeded"
        assert chat(url, "calm").status_code == 200  # at the same time
    # the client closed its streams: their places come back
    wait_for(lambda: chat(url, "busy").status_code == 200)


def test_turns_past_the_per_user_cap_get_429_and_others_are_served(
    server: tuple[str, object],
) -> None:
    url, _sm = server
    first, second = (create(url, "talker").json()["id"] for _ in range(2))
    with ExitStack() as stack:
        hold_streams(stack, url, "talker", 1, **{"X-Session-Id": first})
        e = error(chat(url, "talker", session=second), 429)
        assert "1 conversations answering at once" in e["message"]
        other = create(url, "listener").json()["id"]
        assert chat(url, "listener", session=other).status_code == 200


def test_the_turns_cap_counts_each_end_user_a_client_names(server: tuple[str, object]) -> None:
    url, _sm = server
    first, second = (create(url, "app-backend").json()["id"] for _ in range(2))
    with httpx.Client(timeout=120) as client:
        held = {**key("app-backend"), "X-Session-Id": first}
        body = {**LONG, "user": "alice"}
        with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=held) as r:
            assert r.status_code == 200
            e = error(chat(url, "app-backend", session=second, user="alice"), 429)
            assert "1 conversations answering at once" in e["message"]
            assert chat(url, "app-backend", session=second, user="bob").status_code == 200


def test_conversations_past_the_per_user_cap_get_429(server: tuple[str, object]) -> None:
    url, _sm = server
    for _ in range(3):
        assert create(url, "hoarder").status_code == 200
    e = error(create(url, "hoarder"), 429)
    assert "you have 3 conversations" in e["message"] and "delete some" in e["message"]
    assert create(url, "modest").status_code == 200


def test_a_flood_of_session_creations_is_bounded_and_others_are_served(
    server: tuple[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, sm = server
    release, entered = threading.Event(), []
    real = sm.store.create_session

    def slow(*args: object) -> dict:  # a writer queue that does not drain yet
        entered.append(1)
        assert release.wait(60)
        return real(*args)

    monkeypatch.setattr(sm.store, "create_session", slow)
    results: list[int] = []
    threads = [
        threading.Thread(target=lambda who=who: results.append(create(url, who).status_code))
        for who in ("flood", "flood", "neighbour")
    ]
    try:
        for i, t in enumerate(threads):
            t.start()
            wait_for(lambda i=i: len(entered) == i + 1)
        e = error(create(url, "another"), 429)  # every place is taken, by anyone
        assert e["code"] == "server_busy" and "3 conversations are being created" in e["message"]
        assert chat(url, "reader").status_code == 200  # turns are not queued behind them
    finally:
        release.set()
        for t in threads:
            t.join(60)
    assert results == [200, 200, 200]
    monkeypatch.setattr(sm.store, "create_session", slow)
    release.clear()
    entered.clear()
    threads = [
        threading.Thread(target=lambda: results.append(create(url, "flood2").status_code))
        for _ in range(2)
    ]
    try:
        for i, t in enumerate(threads):
            t.start()
            wait_for(lambda i=i: len(entered) == i + 1)
        e = error(create(url, "flood2"), 429)
        assert "already creating 2" in e["message"]
    finally:
        release.set()
        for t in threads:
            t.join(60)


def count_tokenizer_calls(sm: object, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    tokenizer = sm.formatter.tokenizer  # type: ignore[attr-defined]
    calls = [0]
    real = tokenizer.encode

    def counting(*args: object, **kwargs: object) -> list[int]:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting)
    return calls


def test_ten_thousand_messages_are_refused_before_any_is_tokenized(
    server: tuple[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, sm = server
    calls = count_tokenizer_calls(sm, monkeypatch)
    many = [{"role": "user", "content": f"message {i}"} for i in range(10_000)]
    e = error(chat(url, "verbose", messages=many), 400)
    assert e["param"] == "messages" and "10000 messages" in e["message"]
    assert "at most 256" in e["message"] and calls[0] == 0
    with pytest.raises(InvalidRequest, match="10000 messages; the limit is 256"):
        sm.complete("api:direct", many, SHORT)  # type: ignore[attr-defined]
    assert calls[0] == 0
    assert chat(url, "terse").status_code == 200


def test_a_conversation_past_the_context_stops_being_tokenized_there(
    server: tuple[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, sm = server
    calls = count_tokenizer_calls(sm, monkeypatch)
    long = [{"role": "user", "content": f"{i} " + "word " * 120} for i in range(200)]
    e = error(chat(url, "chatty", messages=long), 400)
    assert e["code"] == "context_length_exceeded" and "context holds 1024" in e["message"]
    assert 0 < calls[0] <= 10  # about 1024 / 120 messages, not 200, and no template piece
    calls[0] = 0
    with pytest.raises(InvalidRequest, match="5000000 characters; the limit is 32000"):
        sm.complete(  # type: ignore[attr-defined]
            "api:huge", [{"role": "user", "content": "x" * 5_000_000}], SHORT
        )
    assert calls[0] == 0  # refused on its length alone
    assert chat(url, "brief").status_code == 200


def test_one_program_sending_32_requests_at_once_gets_all_32_answered(
    nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """An app backend serving its own users through one identity, as peers serve it: the
    requests wait in the engine's queue (fair share orders everyone's), where the default cap
    refused 24 of 32 with 429 at once."""
    with running_server(nf4_model, tmp_path_factory.mktemp("one-program")) as (url, _, _sm):
        body = {"messages": HI, "max_tokens": 3, "stream": True}
        codes: list[int] = []

        def one() -> None:
            with httpx.Client(timeout=600) as http:
                r = http.post(f"{url}/v1/chat/completions", json=body, headers=key("backend"))
                codes.append(r.status_code)

        threads = [threading.Thread(target=one) for _ in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert codes == [200] * 32
