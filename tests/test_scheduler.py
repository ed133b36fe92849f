"""Scheduler decisions without a model: admission, chunking, preemption, resident reuse."""

from __future__ import annotations

from engine.core.block_pool import BlockPool
from engine.core.resident import ResidentKV
from engine.core.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, SequenceStatus


def seq(n: int, owner: str | None = None, retain: bool = False) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(), owner=owner, retain=retain)


def advance(sched: Scheduler, budget: int = 64) -> None:
    """Pretend the model ran the plan: compute the tokens, append one to finished prefills.
    Checks what the model runner relies on: a decode is a sequence's last uncomputed token."""
    plan = sched.schedule(budget)
    for s in plan.decodes:
        assert s.num_uncomputed == 1, "a prompt token would be sampled as a reply token"
        s.num_computed += 1
        s.token_ids.append(7)
    for s, n in plan.prefills:
        s.num_computed += n
        if s.num_computed == s.num_tokens:
            s.token_ids.append(7)


def test_long_prompt_is_chunked_under_the_budget_while_others_decode() -> None:
    sched = Scheduler(BlockPool(100, 16), max_num_seqs=8)
    short, long = seq(10), seq(200)
    sched.add(short)
    advance(sched)  # short prefilled, now decoding
    sched.add(long)
    plan = sched.schedule(64)
    assert plan.decodes == [short]
    assert plan.prefills == [(long, 63)]  # budget minus the one decode
    sched.check_integrity()


def test_admission_waits_when_blocks_do_not_fit_and_is_fifo() -> None:
    sched = Scheduler(BlockPool(4, 16), max_num_seqs=8)
    a, b, c = seq(40), seq(40), seq(5)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule(256)
    assert [s for s, _ in plan.prefills] == [a]  # b needs 3 blocks, only 1 left; c waits too
    assert list(sched.waiting) == [b, c]
    sched.check_integrity()


def test_max_num_seqs_caps_the_running_batch() -> None:
    sched = Scheduler(BlockPool(100, 16), max_num_seqs=2)
    for _ in range(5):
        sched.add(seq(4))
    sched.schedule(256)
    assert len(sched.running) == 2 and len(sched.waiting) == 3


def test_youngest_is_preempted_when_a_decode_needs_a_block() -> None:
    sched = Scheduler(BlockPool(2, 4), max_num_seqs=8)
    old, young = seq(4), seq(3)
    sched.add(old)
    sched.add(young)
    advance(sched)  # old: 5 tokens (needs 2nd block next step); young: 4 tokens, 1 block
    plan = sched.schedule(64)
    assert plan.preempted == [young]
    assert young.status is SequenceStatus.WAITING and young.num_computed == 0
    assert sched.waiting[0] is young and plan.decodes == [old]
    sched.check_integrity()


def test_resident_kv_is_reused_for_the_owner_and_dropped_lru_under_pressure() -> None:
    pool = BlockPool(6, 4)
    sched = Scheduler(pool, max_num_seqs=8)
    sched.resident.put("alice", ResidentKV(list(range(1, 9)), pool.allocate(2)))
    sched.resident.put("bob", ResidentKV(list(range(1, 9)), pool.allocate(2)))
    # alice continues her conversation: 8 cached tokens + 4 new ones
    turn = seq(12, owner="alice")
    sched.add(turn)
    plan = sched.schedule(64)
    assert plan.prefills == [(turn, 4)] and turn.num_computed == 8
    assert "alice" not in sched.resident
    sched.check_integrity()
    # a stranger needs 2 blocks; only 1 is free, so bob's idle KV is dropped
    sched.add(seq(8))
    sched.schedule(64)
    assert "bob" not in sched.resident and sched.num_resident_dropped == 1
    sched.check_integrity()


def test_memory_pressure_hook_is_asked_before_dropping() -> None:
    pool = BlockPool(2, 4)
    sched = Scheduler(pool, max_num_seqs=8)
    sched.resident.put("idle", ResidentKV([1, 2, 3, 4], pool.allocate(2)))
    asked: list[int] = []

    def hook(short: int, protected: str | None) -> None:
        asked.append(short)
        sched.resident.drop("idle")  # the session layer persists it, then frees it

    sched.memory_pressure = hook
    sched.add(seq(6))
    sched.schedule(64)
    assert asked == [2] and sched.num_resident_dropped == 0
    sched.check_integrity()


def test_finished_retained_sequence_becomes_resident() -> None:
    pool = BlockPool(8, 4)
    sched = Scheduler(pool, max_num_seqs=8)
    s = seq(6, owner="carol", retain=True)
    sched.add(s)
    advance(sched)
    sched.remove(s)
    entry = sched.resident.get("carol")
    assert entry.token_ids == list(range(1, 7)) and len(entry.block_table) == 2
    sched.check_integrity()


def test_a_prompt_admitted_with_one_token_of_budget_left_is_prefilled_not_sampled() -> None:
    sched = Scheduler(BlockPool(100, 16), max_num_seqs=8)
    first, second = seq(31), seq(20)
    sched.add(first)
    sched.add(second)
    plan = sched.schedule(32)
    assert plan.decodes == []
    assert plan.prefills == [(first, 31), (second, 1)]
    advance(sched, 32)  # the helper's own check: no decode with prompt tokens left
    sched.check_integrity()


def test_a_changed_prefix_is_admitted_although_its_owner_holds_stale_kv() -> None:
    pool = BlockPool(6, 16)
    sched = Scheduler(pool, max_num_seqs=8)
    sched.resident.put("alice", ResidentKV(list(range(1, 81)), pool.allocate(5)))
    edited = Sequence([1, 2, 3] + list(range(500, 577)), SamplingParams(), owner="alice")
    bystander = seq(10)
    sched.add(edited)
    sched.add(bystander)
    plan = sched.schedule(512)
    assert [s for s, _ in plan.prefills] == [edited, bystander]
    assert edited.num_computed == 3  # the shared prefix is still reused
    sched.check_integrity()


def test_a_load_in_flight_holds_its_blocks_until_finished_and_a_drop_meanwhile_wins() -> None:
    """A restore reserves blocks on the engine thread and fills them elsewhere: meanwhile the
    accounting counts them, eviction cannot take them, and dropping the owner's KV (the admin,
    a deletion) makes the load let them go when it finishes instead of becoming resident."""
    sched = Scheduler(BlockPool(6, 16), max_num_seqs=4)
    cache = sched.resident
    cache.put("old", ResidentKV(list(range(32)), sched.pool.allocate(2)))
    reclaim = lambda need: sched.reclaim(need, keep_owner="a")  # noqa: E731
    res = cache.reserve("a", list(range(1, 65)), reclaim)  # 4 blocks: fits beside "old"
    assert res is not None and res.start == 0 and len(res.block_table) == 4
    sched.check_integrity()
    assert cache.reserve("b", list(range(1, 33)), lambda n: sched.reclaim(n, "b")) is not None
    assert "old" not in cache and "a" not in cache  # "old" evicted for b; a's load untouched
    sched.check_integrity()
    assert cache.finish(res, loaded=True) and cache.get("a").block_table == res.block_table
    sched.check_integrity()
    res = cache.reserve("a", list(range(1, 17)), reclaim)  # the owner's old KV goes first
    assert res is not None and cache.get("a") is None
    cache.drop("a")
    sched.check_integrity()
    assert not cache.finish(res, loaded=True) and "a" not in cache
    assert sched.pool.num_free == 6 - 2  # only b's blocks, still reserved, are used
    sched.check_integrity()
