"""Failover over fake replicas: a killed replica hands its conversations to the other, one dying
mid-reply keeps the part; cancels, upstream errors and timeouts, cache salts, and what stats,
metrics and the admin page say."""

from __future__ import annotations

import httpx
import pytest

from engine import (
    EngineStopped,
    RequestFailed,
    SamplingParams,
)
from tests.upstream_rig import ask, new_session, upstream_server, wait_for
from ui.admin_page import replicas_table, totals


def test_a_killed_replica_hands_the_whole_conversation_to_the_other(up, replicas) -> None:  # noqa: ANN001
    url, backend, sm, _ = up
    sid = new_session(url)
    first = ask(url, "first question", sid).json()["choices"][0]["message"]["content"]
    home = next(r for r in replicas if r.requests)
    other = next(r for r in replicas if r is not home)
    home.stop()
    got = ask(url, "second question", sid)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"].startswith(f"[{other.name}]")
    sent = backend.tokenizer.decode(other.requests[-1]["prompt"])
    assert "first question" in sent and first.strip() in sent and "second question" in sent
    owner = sm.store.get_session(sid)["owner"]
    assert [m["role"] for m in sm.messages(owner, sid)] == ["user", "assistant"] * 2
    assert ask(url, "third question", sid).status_code == 200  # stays on the survivor
    assert len(other.requests) == 2


def test_a_replica_dying_mid_reply_keeps_the_part_and_the_next_turn_moves(up, replicas) -> None:  # noqa: ANN001
    url, backend, sm, _ = up
    owner = "user:mid"
    sid = sm.create_session(owner)["id"]
    sm.chat(owner, sid, "warm up", SamplingParams(max_new_tokens=8)).result()
    home = next(r for r in replicas if r.requests)
    other = next(r for r in replicas if r is not home)
    home.fault, home.die_after = "die", 2
    failed_before = {r.url: r.failures for r in backend.stats().replicas}[home.url]
    turn = sm.chat(owner, sid, "this one breaks", SamplingParams(max_new_tokens=8))
    with pytest.raises(RequestFailed, match="stopped in the middle of this reply"):
        turn.result()
    assert turn.text == f"[{home.name}] w1 "
    last = sm.messages(owner, sid)[-1]
    assert (last["role"], last["content"]) == ("assistant", turn.text)
    nxt = sm.chat(owner, sid, "again", SamplingParams(max_new_tokens=8)).result()
    assert nxt.startswith(f"[{other.name}]")
    assert "this one breaks" in backend.tokenizer.decode(other.requests[-1]["prompt"])
    down = {r.url: r for r in backend.stats().replicas}[home.url]
    assert not down.healthy and down.failures == failed_before + 1 and down.last_error


def test_cancel_closes_the_upstream_stream(up, replicas) -> None:  # noqa: ANN001
    url, backend, sm, _ = up
    for r in replicas:
        r.delay, r.words = 0.2, 50
    owner = "user:stop"
    sid = sm.create_session(owner)["id"]
    turn = sm.chat(owner, sid, "a long answer please", SamplingParams(max_new_tokens=60))
    it = iter(turn)
    assert next(it).startswith("[r")
    turn.cancel()
    rest = list(it)
    assert len(rest) < 5 and turn.finish_reason == "cancelled"
    wait_for(lambda: sum(r.aborted for r in replicas) == 1, 5)
    assert sum(r.completed for r in replicas) == 0
    assert sm.messages(owner, sid)[-1]["finish_reason"] == "cancelled"
    # no KV snapshots here: the upstream keeps the KV, SQLite the conversation
    assert not sm.persist_now(sid) and sm.stats().snapshots == 0
    wait_for(lambda: backend.stats().running == 0, 5)


# -- errors ------------------------------------------------------------------------------------
def test_upstream_errors_become_clear_messages(up, replicas) -> None:  # noqa: ANN001
    url, backend, sm, _ = up
    for r in replicas:
        r.fault = "400"
    got = ask(url, "too long for the upstream")
    assert got.status_code == 400
    assert got.json()["error"]["code"] == "context_length_exceeded"
    assert "maximum context length" in got.json()["error"]["message"]
    for r in replicas:
        r.fault = "429"
    got = ask(url, "the upstream is overloaded")
    assert got.status_code == 429 and got.json()["error"]["code"] == "server_busy"
    assert "model server is busy" in got.json()["error"]["message"]
    for r in replicas:
        r.fault = "500"
    got = ask(url, "both replicas fail")
    assert got.status_code == 503, got.text
    assert "no model server is reachable" in got.json()["error"]["message"]
    assert sum(len(r.requests) for r in replicas) == 1 + 1 + 2  # 400, 429, each replica once
    for r in replicas:  # now both crash: the health checks see it, new turns are refused
        r.fault = "unhealthy"
    wait_for(lambda: httpx.get(f"{url}/health").status_code == 503, 5)
    with pytest.raises(EngineStopped):
        backend.submit([1, 2, 3])
    assert "no model server is reachable" in httpx.get(f"{url}/health").text
    for r in replicas:
        r.fault = None
    wait_for(lambda: all(r.healthy for r in backend.stats().replicas), 5)  # health checks
    assert ask(url, "back").status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_slow_first_token_times_out_with_a_message(replicas, local, tmp_path) -> None:  # noqa: ANN001
    for r in replicas:
        if r.server is None:
            r.start()
        r.fault, r.delay = None, 1.5
    try:
        with upstream_server(replicas, tmp_path, local, upstream_first_token_s=0.3) as s:
            _url, backend, sm, _ = s
            handle = backend.submit(sm.prompts.encode([{"role": "user", "content": "hi"}], 999))
            with pytest.raises(RequestFailed, match="did not start answering"):
                handle.result()
    finally:
        for r in replicas:
            r.delay = 0.0


def test_each_prefix_cache_namespace_salts_the_replicas_cache_with_its_own_secret_salt(
    up,
    replicas,  # noqa: ANN001
) -> None:
    """vLLM shares cached blocks between requests of one `cache_salt` only: without it, one
    user's cached conversation shortened another's time to first token for the same text."""
    _url, backend, sm, _ = up
    ids = sm.prompts.encode([{"role": "user", "content": "the same words"}], 999)

    def salt_of(cache_ns: str | None) -> str | None:
        before = [len(r.requests) for r in replicas]
        backend.submit(ids, cache_ns=cache_ns, user="u").result()
        (body,) = [b for r, n in zip(replicas, before, strict=True) for b in r.requests[n:]]
        return body.get("cache_salt")

    alice, bob = salt_of("user:alice"), salt_of("user:bob")
    assert alice and bob and alice != bob and salt_of("user:alice") == alice
    assert len(alice) == 44 and "alice" not in alice  # 256 bits, no name in it
    assert salt_of(None) is None  # no namespace: nothing to keep apart


# -- admin, metrics, drain ---------------------------------------------------------------------
def test_stats_metrics_admin_and_drain(up, replicas) -> None:  # noqa: ANN001
    url, backend, sm, monitor = up
    before = backend.stats()
    sids = [new_session(url) for _ in range(8)]
    for sid in sids:
        assert ask(url, "hello", sid).status_code == 200
    wait_for(lambda: all(r.upstream for r in backend.stats().replicas), 5)
    after = backend.stats()
    rows = {r.url: r for r in after.replicas}
    assert sum(r.served for r in rows.values()) - sum(r.served for r in before.replicas) == 8
    assert after.generated_tokens_total - before.generated_tokens_total == 8 * 5
    assert rows[replicas[0].url].upstream["kv_cache_usage_perc"] == 0.25
    table = replicas_table(monitor.engine)
    assert list(table["url"]) == [r.url for r in replicas] and set(table["state"]) == {"up"}
    assert "upstream: 2/2 replicas healthy" in totals(monitor, sm, 2000)
    prom = httpx.get(f"{url}/metrics").text
    assert f"crowdchat_generated_tokens_total {after.generated_tokens_total:.1f}" in prom
    assert 'crowdchat_served_tokens_total{kind="generated",owner="' in prom  # per user too
    assert "crowdchat_engine_up 1.0" in prom
    backend.drain(replicas[0].url)
    for r in replicas:
        r.requests.clear()
    for sid in sids:
        assert ask(url, "again", sid).status_code == 200
    assert not replicas[0].requests and len(replicas[1].requests) == 8
    assert set(replicas_table(monitor.engine)["state"]) == {"draining", "up"}
