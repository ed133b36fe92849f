"""A restart reconciles snapshot files with the database: a deleted conversation leaves nothing."""

from __future__ import annotations

from pathlib import Path

from engine import SamplingParams
from engine.model.loader import LoadedModel
from tests.conftest import close_sessions, make_sessions

GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


def test_a_restart_deletes_snapshots_of_conversations_that_no_longer_exist(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path)
    try:
        kept, gone = sm.create_session("u"), sm.create_session("u")
        for s in (kept, gone):
            sm.chat("u", s["id"], "Hi", GREEDY).result()
            assert sm.persist_now(s["id"])
        # as if a delete raced the writer: the row is gone, its snapshot file is not
        orphan = sm.files.path(gone["id"])
        orphan_bytes = orphan.read_bytes()
        sm.delete_session("u", gone["id"])
    finally:
        close_sessions(engine, sm)
    orphan.write_bytes(orphan_bytes)
    stray = sm.files.path("f" * 32)
    stray.write_bytes(orphan_bytes)
    engine, sm = make_sessions(nf4_model, tmp_path)
    try:
        assert not orphan.exists() and not stray.exists()
        assert sm.files.path(kept["id"]).exists()
        assert {r["session_id"] for r in sm.store.snapshots()} == {kept["id"]}
        assert sm.get_session("u", kept["id"])["state"] == "persisted"
    finally:
        close_sessions(engine, sm)


def test_deleting_a_conversation_while_it_answers_leaves_no_kv_anywhere(
    nf4_sessions: tuple,
) -> None:
    engine, sm = nf4_sessions
    s = sm.create_session("u")
    turn = sm.chat(
        "u",
        s["id"],
        "Tell me a long story.",
        SamplingParams(temperature=0, max_new_tokens=400, ignore_eos=True),
    )
    stream = iter(turn)
    next(stream)  # the reply is streaming
    sm.delete_session("u", s["id"])
    list(stream)  # the turn ends (stopped) after the delete
    assert not sm.residency.offload.persist(s["id"], force=True)  # the sweeper's next try
    assert s["id"] not in engine.resident_kv()
    assert not sm.files.path(s["id"]).exists() and sm.store.get_snapshot(s["id"]) is None
    assert sm.store.get_session(s["id"]) is None and sm.store.messages(s["id"]) == []
