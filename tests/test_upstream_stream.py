"""Turns relayed from fake replicas: the prompt ids and sampling sent, sticky sessions, one
connection per session, and how the stream interval follows the relayed rate."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine import (
    EngineConfig,
    InvalidRequest,
)
from engine.metrics import WINDOW_S, Metrics
from tests.fake_upstream import MODEL, FakeReplica
from tests.upstream_rig import ask, new_session, upstream_server


def test_api_chat_sends_crowdchat_prompt_ids_and_sampling_and_streams(up, replicas) -> None:  # noqa: ANN001
    url, backend, sm, _ = up
    got = ask(url, "Hello there", temperature=0.3, top_p=0.9, seed=7, stop=["zz"])
    assert got.status_code == 200, got.text
    text = got.json()["choices"][0]["message"]["content"]
    assert text.startswith("[r") and text.endswith("w1 w2 w3 w4 ")
    [body] = [b for r in replicas for b in r.requests]
    expected = sm.prompts.encode([{"role": "user", "content": "Hello there"}], 10**6)
    assert body["prompt"] == expected and body["model"] == MODEL
    assert (body["temperature"], body["top_p"], body["seed"]) == (0.3, 0.9, 7)
    assert (body["max_tokens"], body["stop"], body["stream"]) == (16, ["zz"], True)
    assert got.json()["usage"]["completion_tokens"] == 5
    lines = []
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "stream": True},
        headers={"authorization": "Bearer t1"},
    ) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 4
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == backend.model_id


def test_sessions_stick_to_one_replica_and_spread_over_both(up, replicas) -> None:  # noqa: ANN001
    url, backend, sm, _ = up
    homes = []
    for i in range(12):
        sid = new_session(url)
        names = set()
        for turn in range(3):
            before = [len(r.requests) for r in replicas]
            got = ask(url, f"turn {turn} of {i}", sid)
            assert got.status_code == 200 and got.headers["x-crowdchat-kv"] == "upstream"
            names |= {r.name for r, n in zip(replicas, before, strict=True) if len(r.requests) > n}
        assert len(names) == 1, names  # sticky_fraction 1.0 while both are healthy
        homes.append(names.pop())
    assert set(homes) == {"r0", "r1"}, homes


def test_a_sessions_turns_reuse_one_upstream_connection(up, replicas) -> None:  # noqa: ANN001
    url, _, _, _ = up
    sid = new_session(url)
    for turn in range(4):
        assert ask(url, f"turn {turn}", sid).status_code == 200
    home = next(r for r in replicas if r.requests)
    # the body is read to its end after [DONE]: the connection returns to the pool
    assert len(home.requests) == 4 and len(set(home.ports[-4:])) == 1, home.ports


def test_the_stream_interval_grows_with_the_relayed_rate_but_keeps_streams_smooth() -> None:
    auto = EngineConfig()
    cases = {(0, 0): 1, (200, 1): 1, (60, 32): 1, (1000, 2): 4, (1000, 32): 3, (1600, 32): 5}
    cases |= {(10_000, 10): 8, (10_000, 500): 2}
    assert {k: auto.stream_interval(*k) for k in cases} == cases
    assert EngineConfig(upstream_stream_interval=3).stream_interval(0, 1) == 3
    for bad in (-1, 9):
        with pytest.raises(InvalidRequest, match="--upstream-stream-interval"):
            EngineConfig(upstream_stream_interval=bad)


def test_the_token_rate_and_recent_itl_follow_their_windows() -> None:
    m = Metrics()
    assert m.tokens_per_s(0.0) == 0.0 and m.recent_itl() is None
    rng = random.Random(12)
    events = sorted((rng.uniform(0, 30), rng.randint(1, 4)) for _ in range(300))
    for t, n in events:
        m.record_tokens(t, n)
    for now in (30.0, 35.0, 39.9, 45.0):
        kept = [(t, n) for t, n in events if t >= now - WINDOW_S]
        with m.lock:
            rate = m.tokens_per_s(now)
        want = sum(n for _, n in kept) / min(WINDOW_S, now - kept[0][0]) if kept else 0.0
        assert rate == pytest.approx(want), now
    assert m.generated_tokens == sum(n for _, n in events)
    for gap in range(100):
        m.itl.append(float(gap))
    assert m.recent_itl(4) == pytest.approx(97.5)


def test_a_busy_relay_asks_the_upstream_for_fewer_bigger_chunks(
    replicas: list[FakeReplica], local: tuple, tmp_path: Path
) -> None:
    for r in replicas:
        r.fault, r.delay, r.words = None, 0.01, 20  # 100 tokens/s per stream, 16 per reply
        r.requests.clear()
    intervals: list[int] = []
    with (
        upstream_server(replicas, tmp_path, local, upstream_stream_interval=0) as (url, *_),
        ThreadPoolExecutor(32) as pool,
    ):
        while max(intervals, default=1) == 1:  # until the pace of the turns is known
            assert len(intervals) < 32 * 4, intervals
            replies = list(pool.map(lambda i: ask(url, "hi", key=f"crowd-{i}"), range(32)))
            assert all(r.status_code == 200 for r in replies)
            assert all(r.json()["usage"]["completion_tokens"] == 16 for r in replies)
            text = [r.json()["choices"][0]["message"]["content"] for r in replies]
            assert all(t.endswith(" w14 w15 ") for t in text), text
            intervals = [b.get("stream_interval", 1) for r in replicas for b in r.requests]
    assert intervals[0] == 1  # before any token's pace is known
    for r in replicas:
        r.delay, r.words = 0.0, 4


def test_a_fixed_stream_interval_relays_every_token_in_fewer_events(
    replicas: list[FakeReplica], local: tuple, tmp_path: Path
) -> None:
    for r in replicas:
        r.fault, r.delay, r.words = None, 0.05, 7  # paced: each chunk its own event
        r.requests.clear()
    with upstream_server(replicas, tmp_path, local, upstream_stream_interval=3) as served:
        url, backend, _, _ = served
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            headers={"authorization": "Bearer t1"},
        ) as resp:
            assert resp.status_code == 200
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line[6:7] == "{"]
        deltas = [c["delta"].get("content") for e in events for c in e["choices"]]
        text = "".join(d for d in deltas if d)
        assert text.endswith("] w1 w2 w3 w4 w5 w6 w7 "), text
        assert len([d for d in deltas if d]) == 4  # 1 + 3 + 3 + 1 tokens
        assert events[-1]["usage"]["completion_tokens"] == 8
        assert [b["stream_interval"] for r in replicas for b in r.requests] == [3]
        assert backend.stats().itl_p50_s is not None
    for r in replicas:
        r.words = 4
