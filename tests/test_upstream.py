"""crowdchat over upstream engines (--engine-url): the real app, session layer and SQLite in
front of two fake vLLM replicas (real HTTP servers, tests/fake_upstream.py)."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from app import AppConfig, build_app
from engine import (
    Backend,
    EngineConfig,
    EngineStopped,
    InvalidRequest,
    ModelLoadError,
    RequestFailed,
    SamplingParams,
)
from engine.metrics import WINDOW_S, Metrics
from engine.model.loader import local_tokenizer
from engine.upstream.backend import UpstreamBackend
from engine.upstream.routing import Router, parse_metrics, score
from engine.upstream.stream import completion_body, sse_lines
from sessions import SessionConfig, SessionManager
from tests.fake_model import fake_engine
from tests.fake_upstream import MODEL, FakeReplica
from tests.web import free_port
from ui.admin_page import replicas_table, totals

SESSION_HEADER = "x-session-id"


def wait_for(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not met in time"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def local(model_dir: Path) -> tuple:
    """The embedded model's tokenizer and facts, read without loading any weights."""
    return local_tokenizer(EngineConfig(data_dir=model_dir))


@contextmanager
def upstream_server(
    replicas: list[FakeReplica],
    data_dir: Path,
    local: tuple,
    app: dict | None = None,
    **overrides: object,
) -> Iterator[tuple[str, UpstreamBackend, SessionManager, object]]:
    """crowdchat with --engine-url over `replicas`: (base url, backend, sessions, monitor).
    `app`: AppConfig fields (e.g. the admin password); `overrides`: EngineConfig fields."""
    settings: dict[str, object] = {
        "data_dir": data_dir,
        "engine_url": ",".join(r.url for r in replicas),
        "health_interval_s": 0.2,
        "upstream_wait_s": 5.0,
        # a token per chunk: the fakes stream so fast that the automatic choice (0) would
        # gather their tokens; the stream-interval tests below set it
        "upstream_stream_interval": 1,
    }
    settings.update(overrides)
    backend = UpstreamBackend(EngineConfig(**settings), local=local)  # type: ignore[arg-type]
    sm = SessionManager(backend, SessionConfig(idle_seconds=3600.0), data_dir)
    app_settings = {"new_identities_per_minute": 10_000, **(app or {})}
    server_app, monitor = build_app(backend, sm, AppConfig(**app_settings), data_dir)  # type: ignore[arg-type]
    port = free_port()
    config = uvicorn.Config(server_app, host="127.0.0.1", port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30)
    try:
        yield f"http://127.0.0.1:{port}", backend, sm, monitor
    finally:
        server.should_exit = True
        thread.join(10)
        monitor.stop()
        sm.shutdown()
        backend.shutdown()


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[FakeReplica]]:
    reps = [FakeReplica("r0").start(), FakeReplica("r1").start()]
    yield reps
    for r in reps:
        r.stop()


@pytest.fixture(scope="module")
def served(
    replicas: list[FakeReplica], local: tuple, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, UpstreamBackend, SessionManager, object]]:
    with upstream_server(replicas, tmp_path_factory.mktemp("upstream"), local) as s:
        yield s


@pytest.fixture
def up(served, replicas):  # noqa: ANN001, ANN201
    """The shared server with both replicas alive, healthy, faultless and forgotten."""
    url, backend, sm, monitor = served
    for r in replicas:
        if r.server is None:
            r.start()
        r.fault, r.delay, r.words = None, 0.0, 4
        r.requests.clear()
        r.ports.clear()
        r.aborted = r.completed = 0
    for r in backend.router.replicas:
        backend.drain(r.url, draining=False)
    wait_for(lambda: all(r.healthy for r in backend.router.replicas))
    return served


def served_by(replicas: list[FakeReplica], n: int) -> list[str]:
    """Names of the replicas that got the requests, in order (each got `n` in all)."""
    return [r.name for r in replicas for _ in r.requests][:n]


def new_session(url: str) -> str:
    got = httpx.post(f"{url}/v1/sessions", json={}, headers={"authorization": "Bearer t1"})
    assert got.status_code == 200, got.text
    return got.json()["id"]


def ask(
    url: str, text: str, sid: str | None = None, key: str = "t1", **extra: object
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", **({SESSION_HEADER: sid} if sid else {})}
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 16, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)


# -- the seam -------------------------------------------------------------------------------
def test_both_backends_satisfy_the_protocol(served, tmp_path: Path) -> None:  # noqa: ANN001
    engine, _runner = fake_engine(32, data_dir=tmp_path)
    try:
        assert isinstance(engine, Backend) and engine.keeps_kv
        assert isinstance(served[1], Backend) and not served[1].keeps_kv
        for name in ("submit", "stats", "queue_position", "wait_estimate", "drain", "drop_kv"):
            assert callable(getattr(engine, name)) and callable(getattr(served[1], name))
    finally:
        engine.shutdown()


def test_rendezvous_is_sticky_spread_and_moves_only_a_lost_replicas_keys() -> None:
    urls = ["http://a:1", "http://b:1", "http://c:1"]
    router = Router(urls)
    keys = [f"session-{i}" for i in range(300)]
    first = {k: router.pick(k).url for k in keys}
    assert {k: router.pick(k).url for k in keys} == first  # sticky
    counts = {u: list(first.values()).count(u) for u in urls}
    assert min(counts.values()) > 60, counts  # spread (100 each on average)
    router.mark_down(router.replicas[1], "test")
    after = {k: router.pick(k).url for k in keys}
    moved = [k for k in keys if after[k] != first[k]]
    assert moved and all(first[k] == "http://b:1" for k in moved)
    assert max(urls, key=lambda u: score("session-0", u)) == first["session-0"]


def test_vllm_metrics_are_read_and_missing_ones_tolerated() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{model_name="m",engine="0"} 3.0\n'
        'vllm:num_requests_running{model_name="m",engine="1"} 2.0\n'
        "# TYPE vllm:prefix_cache_hits counter\n"
        'vllm:prefix_cache_hits_total{model_name="m"} 40.0\n'
        'vllm:prefix_cache_hits_created{model_name="m"} 1.7e9\n'
        "# TYPE llamacpp:tokens_predicted_total counter\n"
        "llamacpp:tokens_predicted_total 7\n"
    )
    assert parse_metrics(text) == {"num_requests_running": 5.0, "prefix_cache_hits": 40.0}


def test_the_request_body_maps_sampling_and_keeps_the_reply_inside_the_context() -> None:
    plain = completion_body("m", [5, 6, 7], SamplingParams(max_new_tokens=100), 50)
    assert plain["prompt"] == [5, 6, 7] and plain["max_tokens"] == 47
    assert not {"top_k", "min_tokens", "seed", "stop", "ignore_eos"} & set(plain)
    p = SamplingParams(top_k=5, min_new_tokens=2, seed=0, stop=("x",), ignore_eos=True)
    full = completion_body("m", [1], p, 4096)
    assert (full["top_k"], full["min_tokens"], full["seed"]) == (5, 2, 0)
    assert (full["stop"], full["ignore_eos"], full["max_tokens"]) == (["x"], True, 256)
    assert not {"presence_penalty", "frequency_penalty", "repetition_penalty"} & set(full)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=1, repetition_penalty=1.2)
    pen = completion_body("m", [1], p, 4096)
    assert (pen["presence_penalty"], pen["frequency_penalty"], pen["repetition_penalty"]) == (
        0.5,
        1,
        1.2,
    )


def test_sse_payloads_are_cut_at_whole_lines_even_inside_a_character() -> None:
    event = 'data: {"text": "é"}\r\n\n'.encode()
    cut = event.index("é".encode()) + 1  # between the two bytes of é
    first, rest = sse_lines(b": ping\n" + event[:cut])
    assert first == [] and rest == event[:cut]
    second, rest = sse_lines(rest + event[cut:] + b"data: [DONE]\n\ndata: {")
    assert second == ['{"text": "é"}'.encode(), b"[DONE]"] and rest == b"data: {"


def test_bad_urls_and_unreachable_upstreams_stop_start_up_with_a_message(
    local: tuple, tmp_path: Path
) -> None:
    with pytest.raises(InvalidRequest, match="--engine-url"):
        EngineConfig(engine_url="127.0.0.1:8000")
    with pytest.raises(InvalidRequest, match="--engine-url"):
        EngineConfig(engine_url=" , ")
    config = EngineConfig(
        data_dir=tmp_path, engine_url=f"http://127.0.0.1:{free_port()}", upstream_wait_s=0.3
    )
    with pytest.raises(ModelLoadError, match="no --engine-url server answered"):
        UpstreamBackend(config, local=local)


# -- chat over the API and the session layer -------------------------------------------------
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
    table = replicas_table(monitor)
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
    assert set(replicas_table(monitor)["state"]) == {"draining", "up"}
