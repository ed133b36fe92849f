"""Sessions on the real model, a real SQLite file and real snapshot files: turns, owners, bad
messages, Stop, stats, and snapshots that go wrong (damaged, or over the whole disk budget).
KV leaving the pool and coming back is tests/test_session_persist.py's."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from engine import InvalidRequest, SamplingParams
from engine.model.loader import LoadedModel
from sessions import SessionState
from sessions.errors import SessionBusy, SessionNotFound
from tests.conftest import close_sessions, make_sessions

GREEDY = SamplingParams(temperature=0, max_new_tokens=16)
Q1, Q2 = "Name a large animal.", "Where does it live?"


def test_second_turn_prefills_only_its_new_tokens(nf4_sessions: tuple) -> None:
    engine, sm = nf4_sessions
    s = sm.create_session("alice")
    t1 = sm.chat("alice", s["id"], Q1, GREEDY)
    t1.result()
    t2 = sm.chat("alice", s["id"], Q2, GREEDY)
    t2.result()
    assert t2.restored_from == "resident"
    covered = len(t1.prompt) + t1.handle.num_generated_tokens - 1
    assert t2.handle.num_cached_tokens >= covered - 2  # at most a retokenized tail
    msgs = sm.messages("alice", s["id"])
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
    assert msgs[1]["content"] == t1.text and msgs[3]["content"] == t2.text
    row = sm.get_session("alice", s["id"])
    assert row["state"] == "resident" and row["title"] == Q1


def test_owners_are_isolated_and_ids_are_checked(nf4_sessions: tuple) -> None:
    engine, sm = nf4_sessions
    s = sm.create_session("alice")
    assert len(s["id"]) == 32 and int(s["id"], 16) >= 0  # 128 random bits
    sm.chat("alice", s["id"], Q1, GREEDY).result()
    for call in (
        lambda: sm.messages("mallory", s["id"]),
        lambda: sm.chat("mallory", s["id"], "hi", GREEDY),
        lambda: sm.rename_session("mallory", s["id"], "mine"),
        lambda: sm.delete_session("mallory", s["id"]),
        lambda: sm.messages("alice", "../../etc/passwd"),
        lambda: sm.messages("alice", "0" * 32),
    ):
        with pytest.raises(SessionNotFound):
            call()
    assert sm.list_sessions("mallory") == []
    assert len(sm.messages("alice", s["id"])) == 2


def test_bad_messages_and_concurrent_turns(nf4_model: LoadedModel, tmp_path: Path) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path, max_message_chars=1000)
    try:
        sid = sm.create_session("u")["id"]
        for bad, match in (
            ("", "empty"),
            ("  \n\t", "empty"),
            ("x" * 1001, "limit"),
            ("bad \ud800 surrogate", "UTF-8"),
            (None, "text"),
        ):
            with pytest.raises(InvalidRequest, match=match):
                sm.chat("u", sid, bad, GREEDY)  # type: ignore[arg-type]
        assert sm.messages("u", sid) == []  # rejected messages are not half-stored
        turn = sm.chat("u", sid, "Tell me a story\x00\x07 about <|im_start|>system", GREEDY)
        with pytest.raises(SessionBusy):
            sm.chat("u", sid, "again", GREEDY)
        turn.result()
        assert sm.messages("u", sid)[0]["content"] == "Tell me a story about <|im_start|>system"
        regen = sm.regenerate("u", sid, SamplingParams(temperature=1.0, seed=5, max_new_tokens=8))
        regen.result()
        msgs = sm.messages("u", sid)
        assert len(msgs) == 2 and msgs[1]["content"] == regen.text
        edit = sm.edit_last("u", sid, "Say hello.", GREEDY)
        edit.result()
        msgs = sm.messages("u", sid)
        assert [m["content"] for m in msgs] == ["Say hello.", edit.text]
    finally:
        close_sessions(engine, sm)


def test_stop_keeps_the_partial_reply(nf4_sessions: tuple) -> None:
    engine, sm = nf4_sessions
    sid = sm.create_session("u")["id"]
    turn = sm.chat(
        "u",
        sid,
        "Write a very long story.",
        SamplingParams(temperature=0, max_new_tokens=500, ignore_eos=True),
    )
    got = ""
    for delta in turn:
        got += delta
        if len(got) > 20:
            sm.stop("u", sid)
    assert turn.finish_reason == "cancelled"
    msgs = sm.messages("u", sid)
    assert msgs[-1]["role"] == "assistant" and msgs[-1]["content"] == turn.text
    assert msgs[-1]["finish_reason"] == "cancelled" and len(turn.text) >= 20
    assert sm.chat("u", sid, "Go on.", GREEDY).result()  # the session is free again


def test_stop_after_the_engine_finished_but_before_the_reader_did_is_a_stop(
    nf4_sessions: tuple,
) -> None:
    """A fast engine (an upstream vLLM) can finish generating while the page still shows the
    reply streaming; Stop pressed then is still a stop: "cancelled", the reply kept (a
    test_vllm page run saw the status stay empty after Stop)."""
    engine, sm = nf4_sessions
    sid = sm.create_session("u")["id"]
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    turn = sm.chat("u", sid, "Say hello.", params)
    deltas = iter(turn)
    got = next(deltas)
    deadline = time.monotonic() + 60
    while not turn.handle.done and time.monotonic() < deadline:
        time.sleep(0.01)  # the engine finishes; the reader has not read it all
    assert turn.handle.done
    sm.stop("u", sid)
    got += "".join(deltas)
    assert turn.finish_reason == "cancelled" and got == turn.text
    assert len(turn.handle.token_ids) == 8  # the whole reply was generated, and kept
    msgs = sm.messages("u", sid)
    assert msgs[-1]["content"] == turn.text and msgs[-1]["finish_reason"] == "cancelled"


def test_stats_count_states_and_the_recompute_of_lost_kv(nf4_sessions: tuple) -> None:
    engine, sm = nf4_sessions
    sid = sm.create_session("u")["id"]
    sm.chat("u", sid, Q1, GREEDY).result()
    before = sm.stats()
    assert before.states == {"resident": 1} and before.recomputes == 0
    sm.drop_kv(sid)
    assert sm.stats().states == {SessionState.COLD: 1}
    turn = sm.chat("u", sid, Q2, GREEDY)
    assert turn.result() and turn.restored_from == "cold"
    after = sm.stats()
    assert after.recomputes == 1 and after.states == {"resident": 1}
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.recomputes = 0  # type: ignore[misc]


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["corrupted", "truncated", "missing", "wrong_model"])
def test_bad_snapshots_fall_back_to_recompute(
    damage: str, fp32_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(fp32_model, tmp_path)
    try:
        cold, bad = sm.create_session("u"), sm.create_session("u")
        for s in (cold, bad):
            sm.chat("u", s["id"], Q1, GREEDY).result()
        sm.drop_kv(cold["id"])  # the reference: a plain recompute
        assert sm.persist_now(bad["id"])
        path = sm.files.path(bad["id"])
        if damage == "corrupted":
            corrupt(path)
        elif damage == "truncated":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
        elif damage == "missing":
            path.unlink()
        else:
            sm.offload.fingerprint = {**sm.offload.fingerprint, "weights_hash": "another"}
        reference = sm.chat("u", cold["id"], Q2, GREEDY).result()
        turn = sm.chat("u", bad["id"], Q2, GREEDY)
        assert turn.result() == reference
        assert turn.restored_from == "cold"
        # nothing came from the bad file: what was reused, the prefix cache found (the first
        # turn's blocks, which this server computed)
        assert turn.handle.num_cached_tokens == turn.handle.num_hit_tokens
        assert sm.store.get_snapshot(bad["id"]) is None  # the bad file is forgotten
    finally:
        close_sessions(engine, sm)


def test_a_snapshot_larger_than_the_whole_disk_budget_leaves_the_kv_resident(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path, kv_disk_budget_mb=0.01)
    try:
        s = sm.create_session("u")
        sm.chat("u", s["id"], Q1, GREEDY).result()
        assert not sm.persist_now(s["id"])
        assert s["id"] in engine.resident_kv()  # not dropped: nothing else holds it
        assert sm.get_session("u", s["id"])["state"] == "resident"
        assert not sm.files.path(s["id"]).exists()
        assert "exceeds" in (sm.stats().last_snapshot_error or "")
    finally:
        close_sessions(engine, sm)
