"""Issue 34 item 6: in the open API (no --auth, no --api-keys) a caller is its client address,
whatever bearer string it sends, and a forwarded address counts only from a --trusted-proxy.
Before, each bearer string was an owner of its own: a new one per request escaped the per-user
caps, the token budget and fair share, and left state behind for each."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from doors.config import AppConfig
from doors.identity import address_owner, client_key
from engine.errors import InvalidRequest
from engine.model.loader import LoadedModel
from tests.web import PROXY, running_server

HI = [{"role": "user", "content": "Hi"}]
LONG = {"messages": HI, "max_tokens": 500, "ignore_eos": True, "stream": True}


def test_a_client_is_its_ipv4_address_or_its_ipv6_slash_64() -> None:
    assert client_key("203.0.113.7") == "203.0.113.7"
    assert client_key("::ffff:203.0.113.7") == "203.0.113.7"  # IPv4-mapped: the same client
    # one host is given a whole /64 and may send from any address in it
    assert (
        client_key("2001:db8:1:2::1") == client_key("2001:db8:1:2:ffff::9") == ("2001:db8:1:2::/64")
    )
    assert client_key("2001:db8:1:3::1") != client_key("2001:db8:1:2::1")
    assert client_key("unknown") == "unknown"  # a Unix socket's peer: as it is
    assert address_owner("2001:db8:1:2::1") == "address:2001:db8:1:2::/64"


@pytest.mark.parametrize("bad", ["10.0.0.300", "proxy.local", "10.0.0.0/33", "*"])
def test_a_trusted_proxy_that_is_no_address_or_network_stops_the_start(bad: str) -> None:
    with pytest.raises(InvalidRequest, match="--trusted-proxy"):
        AppConfig(trusted_proxy=f"127.0.0.1, {bad}")
    assert AppConfig(trusted_proxy=" 127.0.0.1, 10.0.0.0/8,::1 ").proxies() == [
        "127.0.0.1",
        "10.0.0.0/8",
        "::1",
    ]


def new_bearer(**headers: str) -> dict[str, str]:
    """Headers with a bearer string never sent before."""
    return {"Authorization": f"Bearer {secrets.token_hex(16)}", **headers}


def session(url: str, **headers: str) -> str:
    r = httpx.post(f"{url}/v1/sessions", headers=new_bearer(**headers), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def turn(url: str, sid: str, **headers: str) -> int:
    body = {"messages": HI, "max_tokens": 2}
    headers = new_bearer(**{"X-Session-Id": sid, **headers})
    return httpx.post(
        f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120
    ).status_code


@pytest.fixture(scope="module")
def behind_proxy(nf4_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    caps = {"max_requests_per_user": 2}
    data = tmp_path_factory.mktemp("proxied")
    with running_server(nf4_model, data, session_overrides=caps, trusted_proxy=PROXY) as (
        url,
        _,
        _,
    ):
        yield url


def test_another_bearer_string_from_the_same_address_is_the_same_user(behind_proxy: str) -> None:
    here, there = {"X-Forwarded-For": "198.18.0.1"}, {"X-Forwarded-For": "198.18.0.2"}
    sid = session(behind_proxy, **here)
    assert turn(behind_proxy, sid, **here) == 200  # another bearer: still the owner
    assert turn(behind_proxy, sid, **there) == 404  # another client's conversation: not found
    # the right-most address the trusted proxy did not add is the client: one a client put
    # in front of it names nobody
    spoofed = {"X-Forwarded-For": "198.18.0.1, 198.18.0.2"}
    assert turn(behind_proxy, sid, **spoofed) == 404


def test_a_new_bearer_string_per_request_does_not_escape_the_per_user_cap(
    behind_proxy: str,
) -> None:
    here, there = {"X-Forwarded-For": "198.18.1.1"}, {"X-Forwarded-For": "198.18.1.2"}
    with ExitStack() as stack:
        http = stack.enter_context(httpx.Client(timeout=120))
        for _ in range(2):  # the cap: two requests queued or answering
            r = stack.enter_context(
                http.stream("POST", f"{behind_proxy}/v1/chat/completions", json=LONG,
                            headers=new_bearer(**here))
            )  # fmt: skip
            assert r.status_code == 200
        r = http.post(f"{behind_proxy}/v1/chat/completions", json=LONG, headers=new_bearer(**here))
        assert r.status_code == 429 and "limit is 2" in r.json()["error"]["message"]
        r = http.post(f"{behind_proxy}/v1/chat/completions", json={**LONG, "max_tokens": 2},
                      headers=new_bearer(**there))  # fmt: skip
        assert r.status_code == 200  # another client meanwhile


def test_without_a_trusted_proxy_a_forwarded_address_is_not_believed(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    with running_server(nf4_model, tmp_path) as (url, _, _):
        sid = session(url, **{"X-Forwarded-For": "198.18.2.1"})
        # both come from 127.0.0.1, whatever they say: one client
        assert turn(url, sid, **{"X-Forwarded-For": "198.18.2.2"}) == 200
        assert turn(url, sid) == 200
