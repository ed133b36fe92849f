"""Per-user limits: a token budget per minute and a cap on each reply."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from engine import InvalidRequest, SamplingParams
from engine.loader import LoadedModel
from sessions import Reply
from sessions.errors import RateLimited
from sessions.limits import TokenRateLimiter
from tests.conftest import close_sessions, make_sessions
from tests.web import running_server


def test_limiter_window(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr("sessions.limits.time.monotonic", lambda: clock[0])
    lim = TokenRateLimiter(100)
    lim.check("a")
    lim.record("a", 60)
    lim.check("a")
    lim.record("a", 50)
    with pytest.raises(RateLimited, match="110 tokens in the last minute.*try again in 61 s"):
        lim.check("a")
    lim.check("b")  # others are not affected
    clock[0] += 61
    lim.check("a")  # the window moved on
    assert TokenRateLimiter(0).check("x") is None  # off


def test_a_heavy_user_is_limited_with_a_clear_message(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path, tokens_per_minute=60, max_tokens_per_turn=40)
    try:
        sid = sm.create_session("heavy")["id"]
        turn = sm.chat(
            "heavy",
            sid,
            "Tell me everything.",
            SamplingParams(temperature=0, max_new_tokens=5000, ignore_eos=True),
        )
        turn.result()
        assert turn.handle.num_generated_tokens == 40  # clamped to the per-turn cap
        with pytest.raises(RateLimited, match="limit is 60 per user"):
            sm.chat("heavy", sid, "More!", SamplingParams(max_new_tokens=8))
        assert len(sm.messages("heavy", sid)) == 2  # the refused message was not stored
        other = sm.create_session("light")["id"]
        assert sm.chat("light", other, "Hi", SamplingParams(max_new_tokens=4)).result()
    finally:
        close_sessions(engine, sm)


def test_the_api_answers_429_when_a_key_is_over_its_budget(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    with running_server(nf4_model, tmp_path) as (url, _, sm):
        sm.limiter.limit = 100
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 80}
        auth = {"Authorization": "Bearer greedy"}
        first = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert first.status_code == 200
        second = httpx.post(f"{url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert second.status_code == 429
        assert "per user" in second.json()["error"]["message"]
        other = httpx.post(
            f"{url}/v1/chat/completions",
            json=body,
            timeout=60,
            headers={"Authorization": "Bearer modest"},
        )
        assert other.status_code == 200


def test_a_one_off_reply_goes_through_the_session_layer_and_its_limits(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path, tokens_per_minute=10, max_tokens_per_turn=6)
    try:
        msgs = [{"role": "user", "content": "Count to twenty.\x00"}]
        reply = sm.complete("api:k", msgs, SamplingParams(max_new_tokens=500, ignore_eos=True))
        assert isinstance(reply, Reply) and reply.restored_from is None
        assert "".join(reply) and reply.num_generated_tokens == 6  # capped per turn
        # charged up front: its prompt and its (capped) reply budget
        assert sm.limiter.used("api:k") == reply.num_prompt_tokens + 6
        assert reply.num_prompt_tokens == len(
            sm.formatter.encode([{"role": "user", "content": "Count to twenty."}])
        )  # cleaned before encoding
        with pytest.raises(RateLimited, match="limit is 10 per user"):
            sm.complete("api:k", msgs, SamplingParams(max_new_tokens=4))
        with pytest.raises(InvalidRequest, match="empty"):
            sm.complete("api:other", [{"role": "user", "content": " "}], SamplingParams())
        assert sm.list_sessions("api:k") == []  # nothing kept
    finally:
        close_sessions(engine, sm)
