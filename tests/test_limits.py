"""Per-user limits: a token budget charged when work is admitted and settled when it ends,
caps on work in flight and on conversations, and a cap on each reply."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from engine import InvalidRequest, SamplingParams, ServerBusy
from engine.model.loader import LoadedModel
from sessions import Reply, SessionConfig
from sessions.caps import IdentityCaps
from sessions.errors import RateLimited
from sessions.limits import TokenRateLimiter
from tests.conftest import close_sessions, make_sessions

FORCED = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)


def test_reservations_hold_tokens_until_settled_to_the_exact_cost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr("sessions.limits.time.monotonic", lambda: clock[0])
    lim = TokenRateLimiter(100)
    a = lim.reserve("u", 60)
    b = lim.reserve("u", 30)  # in flight at once: both count before either ends
    assert (lim.used("u"), lim.reserved("u")) == (0, 90)
    with pytest.raises(RateLimited, match="90 are held by your replies in progress.*needs 20"):
        lim.reserve("u", 20)
    lim.reserve("v", 100).settled = True  # others are not affected (and never settle here)
    lim.settle(a, 25)  # it used 25 of its 60: 35 come back
    assert (lim.used("u"), lim.reserved("u")) == (25, 30)
    c = lim.reserve("u", 45)  # 25 + 30 + 45 = 100: exactly the limit
    lim.settle(a, 25)  # settling twice counts once
    lim.settle(b, 30)
    lim.settle(c, 0)  # stopped before the engine did anything: all of it comes back
    assert (lim.used("u"), lim.reserved("u")) == (55, 0)
    with pytest.raises(RateLimited, match="used 55 tokens.*needs 50.*try again in 61 s"):
        lim.reserve("u", 50)
    clock[0] += 61  # the window moved on
    assert lim.used("u") == 0 and lim.refused == 2
    lim.settle(lim.reserve("u", 500), 500)  # an idle user may run one request over the limit
    with pytest.raises(RateLimited):
        lim.reserve("u", 1)
    off = TokenRateLimiter(0)
    off.settle(off.reserve("x", 10**9), 10**9)
    assert off.used("x") == 0 and off.reserved("x") == 0


def test_caps_count_work_in_flight_and_conversations_per_identity() -> None:
    config = SessionConfig(
        max_turns_per_user=1,
        max_requests_per_user=2,
        max_sessions_per_user=3,
        max_pending_creates=2,
        max_pending_creates_per_user=1,
    )
    caps = IdentityCaps(config)
    turn = caps.admit("a", turn=True)
    with pytest.raises(RateLimited, match="1 conversations answering at once.*limit is 1"):
        caps.admit("a", turn=True)
    one_off = caps.admit("a", turn=False)
    with pytest.raises(RateLimited, match="2 requests queued or answering.*limit is 2"):
        caps.admit("a", turn=False)
    caps.admit("b", turn=True)  # another identity is not affected
    caps.release(turn)
    caps.release(turn)  # idempotent
    assert caps.in_flight("a") == (1, 0)
    caps.release(one_off)
    caps.admit("a", turn=True)
    with caps.creating("a", lambda _owner: 2):
        with pytest.raises(RateLimited, match="already creating 1"):
            with caps.creating("a", lambda _owner: 2):
                pass
        with pytest.raises(RateLimited, match="you have 3 conversations.*limit is 3"):
            with caps.creating("c", lambda _owner: 3):
                pass
        with caps.creating("b", lambda _owner: 0):
            with pytest.raises(ServerBusy, match="2 conversations are being created"):
                with caps.creating("d", lambda _owner: 0):
                    pass
    with caps.creating("d", lambda _owner: 0):  # the places came back
        pass
    assert dict(caps.refused) == {
        "turns": 1,
        "requests": 1,
        "creates_per_user": 1,
        "sessions": 1,
        "creates": 1,
    }
    free = IdentityCaps(replace(config, max_turns_per_user=0, max_requests_per_user=0))
    for _ in range(100):
        free.admit("a", turn=True)  # 0: no cap


def test_parallel_turns_are_charged_when_admitted_and_a_stopped_one_refunds_the_rest(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path, tokens_per_minute=300, max_turns_per_user=0)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=100, ignore_eos=True)
        turns = []
        with pytest.raises(RateLimited, match="held by your replies in progress"):
            for i in range(10):  # none ends: before, none of them was ever checked
                sid = sm.create_session("u")["id"]
                turns.append(sm.chat("u", sid, f"Count to {i + 3}.", params))
        assert 1 < len(turns) < 4  # each holds its prompt + 100 of the 300
        held = sum(len(t.prompt) + 100 for t in turns)  # new sessions: every prompt token
        assert sm.limiter.reserved("u") == held and sm.limiter.used("u") == 0
        other = sm.create_session("v")["id"]
        assert sm.chat("v", other, "Hi", FORCED).result()  # nobody else notices
        first = turns[0]
        stream = iter(first)
        for _ in range(3):
            next(stream)
        first.cancel()  # Stop: what it did not generate comes back
        for _ in stream:
            pass
        assert first.finish_reason == "cancelled" and first.num_generated_tokens < 100
        h = first.handle
        cost = h.num_prompt_tokens - h.num_cached_tokens + h.num_generated_tokens
        assert sm.limiter.used("u") == cost
        assert sm.limiter.reserved("u") == held - len(first.prompt) - 100
        for turn in turns[1:]:
            turn.cancel()
            turn.result()
        assert sm.limiter.reserved("u") == 0 and sm.admission.caps.in_flight("u") == (0, 0)
    finally:
        close_sessions(engine, sm)


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
        assert sm.admission.caps.in_flight("heavy") == (0, 0)  # a refusal holds nothing
        other = sm.create_session("light")["id"]
        assert sm.chat("light", other, "Hi", SamplingParams(max_new_tokens=4)).result()
    finally:
        close_sessions(engine, sm)


def test_a_one_off_reply_reserves_its_prompt_and_budget_and_settles_to_its_cost(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path, tokens_per_minute=10, max_tokens_per_turn=6)
    try:
        msgs = [{"role": "user", "content": "Count to twenty.\x00"}]
        reply = sm.complete("api:k", msgs, SamplingParams(max_new_tokens=500, ignore_eos=True))
        assert isinstance(reply, Reply) and reply.restored_from is None
        held = reply.num_prompt_tokens + 6  # its whole prompt and its (capped) reply budget
        assert sm.limiter.reserved("api:k") == held and sm.limiter.used("api:k") == 0
        assert "".join(reply) and reply.num_generated_tokens == 6  # capped per turn
        assert sm.limiter.reserved("api:k") == 0 and sm.limiter.used("api:k") == held
        assert reply.num_prompt_tokens == len(
            sm.formatter.encode([{"role": "user", "content": "Count to twenty."}])
        )  # cleaned before encoding
        with pytest.raises(RateLimited, match="limit is 10 per user"):
            sm.complete("api:k", msgs, SamplingParams(max_new_tokens=4))
        with pytest.raises(InvalidRequest, match="empty"):
            sm.complete("api:other", [{"role": "user", "content": " "}], SamplingParams())
        assert sm.list_sessions("api:k") == []  # nothing kept
        assert sm.admission.caps.in_flight("api:other") == (0, 0)
    finally:
        close_sessions(engine, sm)


def test_owners_who_never_come_back_are_forgotten_once_their_window_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new identity per request (random bearer strings) kept a window per owner forever."""
    clock = [1000.0]
    monkeypatch.setattr("sessions.limits.time.monotonic", lambda: clock[0])
    lim = TokenRateLimiter(100)
    for i in range(5000):
        lim.settle(lim.reserve(f"drive-by-{i}", 10), 10)
        clock[0] += 0.001
    assert len(lim) == 5000  # all within the minute: each still counts
    clock[0] += 61
    lim.settle(lim.reserve("regular", 10), 10)
    assert len(lim) == 1 and lim.used("regular") == 10
    held = lim.reserve("holder", 10)  # one with a reply in flight stays while it runs
    clock[0] += 61
    lim.settle(lim.reserve("regular", 10), 10)
    assert len(lim) == 2
    lim.settle(held, 0)
    assert len(lim) == 1
