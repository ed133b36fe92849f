"""A session's turns off the happy path, on the real model: concurrent requests, a full
queue, and replies that replace others."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from engine import SamplingParams, ServerBusy
from engine.model.loader import LoadedModel
from sessions.errors import SessionBusy
from tests.conftest import close_sessions, make_sessions

GREEDY = SamplingParams(temperature=0, max_new_tokens=8)
FORCED = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
Q1, Q2 = "Name a large animal.", "Where does it live?"


def test_a_request_that_reads_the_history_while_a_turn_ends_sees_its_reply(
    nf4_sessions: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, sm = nf4_sessions
    sid = sm.create_session("u")["id"]
    first = sm.chat("u", sid, Q1, FORCED)
    reading, go = threading.Event(), threading.Event()
    real = sm.store.messages

    def paused(session_id: str) -> list[dict]:  # the second request stops in its read
        if threading.current_thread().name == "second":
            reading.set()
            assert go.wait(60)
        return real(session_id)

    monkeypatch.setattr(sm.store, "messages", paused)
    outcome: dict[str, object] = {}

    def second() -> None:
        try:
            outcome["turn"] = sm.chat("u", sid, Q2, GREEDY)
        except SessionBusy as e:
            outcome["busy"] = e

    thread = threading.Thread(target=second, name="second")
    thread.start()
    deadline = time.monotonic() + 60
    while not reading.is_set() and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    first.result()  # the first turn ends: its reply is committed, the session is free
    go.set()
    thread.join(60)
    assert first.text.strip()
    if "turn" in outcome:  # it got the session: its prompt must hold the reply
        turn = outcome["turn"]
        assert first.text.strip() in sm.formatter.tokenizer.decode(turn.prompt)
        turn.result()
    else:
        assert isinstance(outcome.get("busy"), SessionBusy)
    later = sm.chat("u", sid, Q2, GREEDY)  # once it ended, the session is free again
    assert first.text.strip() in sm.formatter.tokenizer.decode(later.prompt)
    later.result()


def test_a_regenerate_or_edit_the_server_turns_away_leaves_the_conversation_as_it_was(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path, {"max_queue": 0})  # every submit: busy
    try:
        sid = sm.create_session("u")["id"]
        sm.store.add_message(sid, "user", Q1)
        sm.store.add_message(
            sid,
            "assistant",
            "An elephant.",
            token_count=4,
            finish_reason="stop",
            session_fields={"token_count": 30},
        )
        before = sm.messages("u", sid)
        for start in (
            lambda: sm.regenerate("u", sid, GREEDY),
            lambda: sm.edit_last("u", sid, "Name a small animal.", GREEDY),
        ):
            turn = start()
            with pytest.raises(ServerBusy):
                turn.result()
            assert sm.messages("u", sid) == before  # the old reply and message are still there
            assert not turn.accepted
            assert sm.get_session("u", sid)["token_count"] == 30
    finally:
        close_sessions(engine, sm)


def count_writes(sm: object, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of the store's write transactions (one writer job each)."""
    worker = sm.store.sql  # type: ignore[attr-defined]
    real, count = worker.write, [0]

    def counted(fn: object) -> object:
        count[0] += 1
        return real(fn)

    monkeypatch.setattr(worker, "write", counted)
    return count


def test_regenerate_and_edit_keep_the_old_turn_as_a_branch_with_one_write_before_streaming(
    nf4_sessions: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, sm = nf4_sessions
    sid = sm.create_session("u")["id"]
    first = sm.chat("u", sid, Q1, FORCED)
    first.result()
    count = count_writes(sm, monkeypatch)
    shown = [Q1, first.text]
    for start, user_text in (
        (lambda: sm.regenerate("u", sid, FORCED), Q1),
        (lambda: sm.edit_last("u", sid, "Say hello.", FORCED), "Say hello."),
    ):
        count[0] = 0
        turn = start()
        stream = iter(turn)
        assert next(stream)
        assert count[0] == 1  # at the first delta, one write: the session answers
        # a regenerate shows the old reply until the new one is written; an edit is
        # written (a sibling of the original message) before the reply streams
        expected = shown if user_text == Q1 else [user_text]
        assert [m["content"] for m in sm.messages("u", sid)] == expected
        for _delta in stream:
            pass
        assert turn.accepted and count[0] == 2  # plus the reply at its end
        msgs = sm.messages("u", sid)
        assert [m["content"] for m in msgs] == [user_text, turn.text]
        assert sm.get_session("u", sid)["state"] == "resident"
        shown = [user_text, turn.text]
    assert len(sm.store.message_tree(sid)) == 5  # the replaced turns are still there


def test_a_turn_is_charged_what_the_server_computed_also_a_recomputed_history(
    nf4_model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path, tokens_per_minute=10**6)
    try:
        held: list[int] = []  # what each turn reserved when it was admitted
        charges: list[int] = []  # what each turn was charged when it ended
        reserve, settle = sm.limiter.reserve, sm.limiter.settle
        monkeypatch.setattr(
            sm.limiter,
            "reserve",
            lambda owner, tokens: (held.append(tokens), reserve(owner, tokens))[1],
        )
        monkeypatch.setattr(
            sm.limiter, "settle", lambda r, cost: (charges.append(cost), settle(r, cost))
        )
        sid = sm.create_session("u")["id"]
        turns = []
        for text in (Q1, Q2, "And what does it eat?"):
            if len(turns) == 2:
                sm.drop_kv(sid)  # its KV is gone: the next turn recomputes the whole history
            before = sm.get_session("u", sid)["token_count"]
            turn = sm.chat("u", sid, text, FORCED)
            turn.result()
            turns.append(turn)
            h = turn.handle
            assert charges[-1] == h.num_prompt_tokens - h.num_cached_tokens + 8
            kept = 0 if len(turns) == 3 else before  # the KV the turn could reuse
            assert held[-1] == len(turn.prompt) - kept + 8
        assert len(charges) == 3
        assert turns[1].handle.num_cached_tokens > 0  # resident: only the new tokens
        assert charges[1] < len(turns[1].prompt) // 2 + 8
        # its KV was dropped: reserved as a full recompute, charged what was computed (blocks
        # still in the prefix cache, the user's own or the shared system prompt, are not)
        assert held[2] == len(turns[2].prompt) + 8
        assert charges[2] == len(turns[2].prompt) - turns[2].handle.num_cached_tokens + 8
        assert sm.limiter.used("u") == sum(charges) and sm.limiter.reserved("u") == 0
    finally:
        close_sessions(engine, sm)
