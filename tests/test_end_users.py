"""An app backend through one identity: a client (an address, a key) that names its end users
(OpenAI's `user` field, or the header the operator names with --end-user-header) gets the
per-user token budget per end user, and all its end users together the per-client cap; over
HTTP on a real server."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from bench.stream_client import client_address
from doors.identity import address_owner
from engine.model.loader import LoadedModel
from sessions.admission import limit_key
from tests.web import PROXY, client_at, running_server

HI = [{"role": "user", "content": "Hi"}]
# a request reserves its prompt (~35 tokens) and 40 to generate, and costs at least the 40:
# one end user's second request passes the per-user 100, the client's tenth the 400
PER_USER, PER_CLIENT, REPLY = 100, 400, 40
HEADER = "X-End-User"


@pytest.fixture(scope="module")
def server(
    nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, object]]:
    with running_server(
        nf4_model,
        tmp_path_factory.mktemp("end_users"),
        {"max_model_len": 1024},
        session_overrides={
            "tokens_per_minute": PER_USER,
            "tokens_per_minute_per_client": PER_CLIENT,
        },
        trusted_proxy=PROXY,
        end_user_header=HEADER,
    ) as (url, _engine, sm):
        yield url, sm


def chat(url: str, client: str, user: object = None, **headers: str) -> httpx.Response:
    """One short reply for `client` (an address of its own), naming end user `user` in the
    body (None: not at all)."""
    body: dict[str, object] = {"messages": HI, "max_tokens": REPLY, "ignore_eos": True}
    if user is not None:
        body["user"] = user
    return httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={**client_at(client), **headers},
        timeout=120,
    )


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_end_users_of_one_address_each_get_the_per_user_budget(
    server: tuple[str, object],
) -> None:
    url, _sm = server
    # four end users' requests cost more than one user's budget together, and are all served
    for name in ("ann", "bob", "cy", "dee"):
        r = chat(url, "app-many", name)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == REPLY


def test_one_end_user_past_the_budget_gets_429_and_the_others_are_served(
    server: tuple[str, object],
) -> None:
    url, _sm = server
    assert chat(url, "app-one", "greedy").status_code == 200
    e = error(chat(url, "app-one", "greedy"), 429)
    assert f"the limit is {PER_USER} per user" in e["message"]
    assert e["code"] == "rate_limit_exceeded"
    assert chat(url, "app-one", "modest").status_code == 200  # the same address, another user


def test_a_client_without_end_users_keeps_one_budget(server: tuple[str, object]) -> None:
    url, _sm = server
    assert chat(url, "plain").status_code == 200
    assert "per user" in error(chat(url, "plain"), 429)["message"]


def test_rotating_end_users_cannot_pass_the_per_client_cap(server: tuple[str, object]) -> None:
    url, sm = server
    served, refusal = 0, None
    for i in range(12):  # 12 requests of 40+ tokens each: past the client's 400
        r = chat(url, "rotator", f"fresh-{i}")
        if r.status_code == 429:
            refusal = r.json()["error"]["message"]
            break
        assert r.status_code == 200, r.text
        served += 1
    assert refusal is not None, "a new end user per request escaped the per-client cap"
    assert f"{PER_CLIENT} per client" in refusal and "--tokens-per-minute-per-client" in refusal
    assert REPLY * served <= PER_CLIENT
    used = sm.admission.client_limiter.used("address:" + client_at("rotator")["X-Forwarded-For"])
    assert REPLY * served <= used <= PER_CLIENT
    assert chat(url, "rotator-neighbour", "fresh-0").status_code == 200  # others are served


@pytest.mark.parametrize(
    "user, says",
    [
        (123, "must be a string"),
        (["a"], "must be a string"),
        ("", "must not be empty"),
        ("   ", "must not be empty"),
        ("x" * 257, "at most 256 characters"),
        ("a\nb", "control characters"),
        ("a\x00b", "control characters"),
    ],
)
def test_a_bad_user_field_gets_400_and_the_server_keeps_serving(
    server: tuple[str, object], user: object, says: str
) -> None:
    url, _sm = server
    e = error(chat(url, "bad-user", user), 400)
    assert says in e["message"] and e["param"] == "user"
    after = f"after-{abs(hash(repr(user)))}"  # each case's own client, under its own cap
    assert chat(url, after, "fine").status_code == 200


def test_the_operator_named_header_names_the_end_user(server: tuple[str, object]) -> None:
    url, _sm = server
    for name in ("h1", "h2", "h3"):
        assert chat(url, "by-header", **{HEADER: name}).status_code == 200
    assert chat(url, "by-header", **{HEADER: "h1"}).status_code == 429
    # the header wins over the body: the operator's front end sets it
    assert chat(url, "by-header", "h9", **{HEADER: "h1"}).status_code == 429
    e = error(chat(url, "by-header", **{HEADER: "y" * 300}), 400)
    assert e["param"] == HEADER.lower() and "at most 256 characters" in e["message"]


def test_a_header_the_operator_did_not_name_is_ignored(server: tuple[str, object]) -> None:
    url, _sm = server
    assert chat(url, "other-header", **{"X-User-Id": "u1"}).status_code == 200
    assert chat(url, "other-header", **{"X-User-Id": "u2"}).status_code == 429


def test_a_session_turn_with_an_end_user_stays_the_clients_conversation(
    server: tuple[str, object],
) -> None:
    url, _sm = server
    headers = client_at("sessions-app")
    sid = httpx.post(f"{url}/v1/sessions", headers=headers, timeout=60).json()["id"]
    for name in ("s1", "s2"):  # two end users' turns: past one user's budget, both served
        r = chat(url, "sessions-app", name, **{"X-Session-Id": sid})
        assert r.status_code == 200, r.text
    listed = httpx.get(f"{url}/v1/sessions", headers=headers, timeout=60).json()["data"]
    assert [s["id"] for s in listed] == [sid]
    messages = httpx.get(f"{url}/v1/sessions/{sid}", headers=headers, timeout=60).json()
    assert sum(m["role"] == "assistant" for m in messages["messages"]) == 2


def test_the_fair_share_stays_the_clients_whatever_end_users_it_names(
    server: tuple[str, object],
) -> None:
    """The engine's fair share orders clients, not the names they send: a client rotating
    end-user names gets no more of the engine than one naming nobody (its end users share
    its slice, in arrival order)."""
    url, sm = server
    owner = address_owner(client_address("fair-app"))
    for name in ("f1", "f2"):
        assert chat(url, "fair-app", name).status_code == 200
    served = sm.engine.scheduler.policy.served.rows  # user -> [prompt, generated] tokens
    assert owner in served and served[owner][1] >= 2 * REPLY
    assert not {limit_key(owner, "f1"), limit_key(owner, "f2")} & served.keys()


def test_usage_says_where_a_named_end_user_stands(server: tuple[str, object]) -> None:
    """`/v1/usage?user=NAME` (or the operator's header) answers for that end user of the
    client, and the client's standing against its cap beside it; a bad name is a 400."""
    url, _sm = server
    assert chat(url, "usage-app", "u-busy").status_code == 200

    def usage(**params: str) -> dict:
        headers = {**client_at("usage-app"), **params.pop("headers", {})}
        r = httpx.get(f"{url}/v1/usage", params=params, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    busy, idle, client = usage(user="u-busy"), usage(user="u-idle"), usage()
    assert busy["end_user"] == "u-busy" and busy["tokens_used"] >= REPLY
    assert idle["end_user"] == "u-idle" and idle["tokens_used"] == 0
    assert client["end_user"] is None and client["tokens_used"] == 0  # its own name: unused
    assert busy["client_tokens_used"] == client["client_tokens_used"] >= REPLY
    assert busy["tokens_per_minute"] == PER_USER
    assert client["tokens_per_minute_per_client"] == PER_CLIENT
    assert usage(headers={HEADER: "u-busy"})["tokens_used"] == busy["tokens_used"]
    r = httpx.get(f"{url}/v1/usage", params={"user": "a\x00b"}, headers=client_at("usage-app"))
    assert r.status_code == 400 and error(r, 400)["param"] == "user"
