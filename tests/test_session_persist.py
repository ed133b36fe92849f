"""A session's KV leaving the pool and coming back, on the real model, a real SQLite file and
real snapshot files: persist and restore change no reply (also across a restart), a turn or
an opened conversation starts the restore early, LRU eviction, the idle sweeper, the disk
budget."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from engine.model.kv_cache import bytes_per_token
from engine.model.loader import LoadedModel
from tests.conftest import close_sessions, make_sessions

GREEDY = SamplingParams(temperature=0, max_new_tokens=16)
Q1, Q2 = "Name a large animal.", "Where does it live?"


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("mode", ["nf4", "fp32"])
def test_persist_and_restore_change_nothing_also_across_restart(
    mode: str, nf4_model: LoadedModel, fp32_model: LoadedModel, tmp_path: Path
) -> None:
    """Twin conversations, one kept resident and one persisted and restored, reply alike.
    The twins must be computed alike: a prompt prefilled on cached blocks rounds its last
    tokens differently in nf4, and greedy decoding can then break a tie of bf16-rounded logits
    the other way (measured: EOS and " They" at 16.5 and 16.375, swapped). So the template's
    shared head is cached first, by a third user, and the twins belong to two users, so each
    prefills the same tail on that head and neither reads the other's own blocks."""
    loaded = nf4_model if mode == "nf4" else fp32_model
    engine, sm = make_sessions(loaded, tmp_path)
    try:
        sm.chat("w", sm.create_session("w")["id"], Q1, GREEDY).result()
        kept, moved = sm.create_session("u"), sm.create_session("v")
        first = [sm.chat(s["owner"], s["id"], Q1, GREEDY).result() for s in (kept, moved)]
        assert first[0] == first[1]
        before = engine.export_kv(moved["id"])
        assert sm.persist_now(moved["id"])
        assert moved["id"] not in engine.resident_kv()
        assert sm.get_session("v", moved["id"])["state"] == "persisted"
        assert sm.offload.restore(moved["id"]) == "disk"
        after = engine.export_kv(moved["id"])
        assert after.token_ids == before.token_ids
        assert same_bytes(after.k, before.k) and same_bytes(after.v, before.v)
        assert sm.persist_now(moved["id"])
        resident_reply = sm.chat("u", kept["id"], Q2, GREEDY).result()
        turn = sm.chat("v", moved["id"], Q2, GREEDY)
        assert turn.result() == resident_reply and turn.restored_from == "disk"
    finally:
        close_sessions(engine, sm)
    # restart: a new engine and manager on the same data dir
    engine, sm = make_sessions(loaded, tmp_path)
    try:
        assert [m["content"] for m in sm.messages("v", moved["id"])][:2] == [Q1, first[1]]
        assert sm.get_session("u", kept["id"])["state"] == "persisted"  # flushed at shutdown
        again = [sm.chat(s["owner"], s["id"], "Thanks!", GREEDY) for s in (kept, moved)]
        replies = [t.result() for t in again]
        assert all(t.restored_from == "disk" for t in again)
        assert replies[0] == replies[1]
        assert again[1].handle.num_cached_tokens > len(again[1].prompt) // 2
    finally:
        close_sessions(engine, sm)


def test_a_turn_starts_its_restore_before_the_reply_is_read(nf4_sessions: tuple) -> None:
    """The KV of a persisted session comes back while the turn's prompt is built: it is
    resident before anyone iterates the turn, and the turn still says it came from disk. A
    regenerate and an edit do the same."""
    engine, sm = nf4_sessions
    sid = sm.create_session("u")["id"]
    sm.chat("u", sid, Q1, GREEDY).result()
    starts = [
        lambda: sm.chat("u", sid, Q2, GREEDY),
        lambda: sm.regenerate("u", sid, GREEDY),
        lambda: sm.edit_last("u", sid, Q1, GREEDY),
    ]
    for start in starts:
        assert sm.persist_now(sid) and sid not in engine.resident_kv()
        turn = start()
        deadline = time.monotonic() + 30
        while sid not in engine.resident_kv() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sid in engine.resident_kv() and turn.status == "restoring"
        assert turn.result() and turn.restored_from == "disk"


def test_opening_a_persisted_conversation_prefetches_its_kv(nf4_sessions: tuple) -> None:
    """`prefetch` (the page opened the conversation) brings the KV back in the background
    and records it resident; the next turn then finds it resident."""
    engine, sm = nf4_sessions
    sid = sm.create_session("u")["id"]
    sm.chat("u", sid, Q1, GREEDY).result()
    assert sm.persist_now(sid) and sid not in engine.resident_kv()
    sm.prefetch("u", sid)
    deadline = time.monotonic() + 30
    while sm.get_session("u", sid)["state"] != "resident" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sm.get_session("u", sid)["state"] == "resident" and sid in engine.resident_kv()
    turn = sm.chat("u", sid, Q2, GREEDY)
    assert turn.result() and turn.restored_from == "resident"


def test_a_snapshot_is_read_unless_the_engine_recomputes_it_faster(nf4_sessions: tuple) -> None:
    """The engine measures both paces as it serves (its steps, its snapshot reads). Here, on
    a CPU, reading a conversation's KV is far faster than recomputing it, so the turn restores
    from disk. On a disk slower than the engine (a small model on a GPU: see
    docs/PERFORMANCE.md) the turn recomputes, counted as a chosen recompute, and the snapshot
    stays: no slow disk exists here, so its measured pace is set to one."""
    engine, sm = nf4_sessions
    sid = sm.create_session("u")["id"]
    sm.chat("u", sid, Q1, GREEDY).result()
    assert sm.persist_now(sid)
    turn = sm.chat("u", sid, Q2, GREEDY)
    assert turn.result() and turn.restored_from == "disk"
    tokens = sm.get_session("u", sid)["token_count"]
    recompute = engine.recompute_s(tokens)
    read = engine.read_s(tokens * engine.kv_bytes_per_token)
    assert recompute is not None and read is not None and 0 < 20 * read < recompute
    assert sm.stats().disk_read_mb_s > 0 and sm.stats().recomputes_chosen == 0

    engine.read_pace.s_per_byte = 1e-3  # a disk of 1 KB/s: far slower than this engine
    assert sm.persist_now(sid) and sid not in engine.resident_kv()
    engine.reset_prefix_cache()  # its freed blocks would serve the recompute otherwise
    turn = sm.chat("u", sid, "And what does it eat?", GREEDY)
    assert turn.result() and turn.restored_from == "cold"
    assert turn.handle.num_cached_tokens < tokens // 2  # recomputed, not read
    stats = sm.stats()
    assert stats.recomputes_chosen == 1 and stats.recomputes == 1 and stats.restores["disk"] == 1
    assert sm.offload.store.get_snapshot(sid) is not None  # the older snapshot stays
    assert sid in engine.resident_kv()


def test_five_users_share_a_pool_for_two_lru_first(nf4_model: LoadedModel, tmp_path: Path) -> None:
    blocks = 12  # a few of these conversations fit (3-7 blocks each), never five
    engine, sm = make_sessions(
        nf4_model,
        tmp_path,
        {"kv_budget_mb": blocks * 16 * engine_bytes(nf4_model) / 2**20, "max_model_len": 190},
    )
    try:
        users = [f"user{i}" for i in range(5)]
        # each its own system prompt (the template's default, with a full stop): nothing is
        # shared across users, so each conversation holds all its blocks
        own = "You are a helpful AI assistant named SmolLM, trained by Hugging Face."
        sids = {u: sm.create_session(u, system_prompt=own)["id"] for u in users}
        for rnd, q in enumerate([Q1, Q2]):
            for u in users:
                turn = sm.chat(u, sids[u], q, GREEDY)
                assert turn.result()
                if rnd == 1:
                    assert turn.restored_from in ("host", "disk")
            resident = list(engine.resident_kv())  # least recently used first
            # the pool holds a few, never all five (how many depends on the replies' lengths)
            assert 1 <= len(resident) < len(users)
            assert resident == [sids[u] for u in users[-len(resident) :]]  # the newest stay
        for u in users:
            assert len(sm.messages(u, sids[u])) == 4
        assert sm.offload.restores["disk"] + sm.offload.restores["host"] >= 5
    finally:
        close_sessions(engine, sm)


def engine_bytes(loaded: LoadedModel) -> int:
    from engine.model.kv_cache import bytes_per_token

    return bytes_per_token(loaded)


def test_idle_sessions_are_persisted_by_the_sweeper(nf4_model: LoadedModel, tmp_path: Path) -> None:
    """The sweeper writes an idle session's KV out and frees its blocks; once they are free
    the session reads 'persisted' (recorded before the blocks go, not after: a reader who saw
    the pool without it could read 'resident')."""
    engine, sm = make_sessions(nf4_model, tmp_path, idle_seconds=0.3, sweep_interval_s=0.1)
    states_at_drop: list[str] = []
    drop_kv = engine.drop_kv

    def drop_recording_state(sid: str) -> object:
        states_at_drop.append(sm.get_session("u", sid)["state"])
        return drop_kv(sid)

    engine.drop_kv = drop_recording_state  # type: ignore[method-assign]
    try:
        s = sm.create_session("u")
        sm.chat("u", s["id"], Q1, GREEDY).result()
        deadline = time.time() + 10
        while s["id"] in engine.resident_kv() and time.time() < deadline:
            time.sleep(0.1)
        assert s["id"] not in engine.resident_kv()
        assert states_at_drop == ["persisted"]
        assert sm.get_session("u", s["id"])["state"] == "persisted"
        assert sm.files.path(s["id"]).is_file()
        assert sm.chat("u", s["id"], Q2, GREEDY).result()
    finally:
        close_sessions(engine, sm)


def test_disk_budget_deletes_the_oldest_snapshots(nf4_model: LoadedModel, tmp_path: Path) -> None:
    budget_mb = 1.5 * bytes_per_token(nf4_model) / 23040  # ~one snapshot (1.5 MB in bf16)
    engine, sm = make_sessions(nf4_model, tmp_path, kv_disk_budget_mb=budget_mb)
    try:
        a, b = sm.create_session("u"), sm.create_session("u")
        for s in (a, b):
            sm.chat("u", s["id"], Q1, GREEDY).result()
        assert sm.persist_now(a["id"]) and sm.persist_now(b["id"])
        assert sm.files.total_bytes() <= budget_mb * 2**20
        assert sm.store.get_snapshot(a["id"]) is None and not sm.files.path(a["id"]).exists()
        assert sm.get_session("u", a["id"])["state"] == "cold"
        assert sm.store.get_snapshot(b["id"]) is not None
        assert sm.chat("u", a["id"], Q2, GREEDY).result()  # cold still chats
        sm.delete_session("u", b["id"])
        assert not sm.files.path(b["id"]).exists()  # deleted sessions lose their snapshot
    finally:
        close_sessions(engine, sm)
