"""Fair share inside the engine (engine/core/fair_share.py), without a model: the virtual token
counter's admissions, prefill order, counter lifts, preemption victims, queue positions."""

from __future__ import annotations

import random
import time

from engine.core.block_pool import BlockPool
from engine.core.fair_share import FcfsPolicy, SchedulePolicy, VirtualTokenCounter
from engine.core.scheduler import Scheduler
from engine.sequence import SamplingParams, Sequence, SequenceStatus
from engine.served import owner_label
from tests.fake_model import fake_engine


def req(n: int, user: str, new: int = 16) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(max_new_tokens=new), user=user)


def sched(policy: SchedulePolicy, blocks: int = 400, seqs: int = 8) -> Scheduler:
    return Scheduler(BlockPool(blocks, 16), max_num_seqs=seqs, policy=policy)


def step(s: Scheduler, budget: int = 512) -> list[Sequence]:
    """Run one planned step as the model would; returns the sequences admitted by it."""
    before = set(s.running)
    plan = s.schedule(budget)
    for seq in plan.decodes:
        seq.num_computed += 1
        seq.token_ids.append(7)
    for seq, n in plan.prefills:
        seq.num_computed += n
        if seq.num_computed == seq.num_tokens:
            seq.token_ids.append(7)
    s.check_integrity()
    return [q for q in s.running if q not in before]


def test_a_light_user_arriving_behind_a_heavy_backlog_is_admitted_next() -> None:
    for policy, want_light in ((VirtualTokenCounter(), True), (FcfsPolicy(), False)):
        s = sched(policy, seqs=2)
        heavy = [req(100, "heavy") for _ in range(20)]
        for q in heavy:
            s.add(q)
        step(s)
        light = req(100, "light")
        s.add(light)
        step(s)
        s.remove(s.running[0])  # a slot frees
        admitted = step(s)
        assert admitted == ([light] if want_light else [heavy[2]]), policy.name


def test_prefill_budget_goes_to_the_least_served_user_first() -> None:
    for policy in (VirtualTokenCounter(), FcfsPolicy()):
        s = sched(policy)
        long = req(1500, "heavy")
        s.add(long)
        step(s, 256)  # admitted: its prompt is charged, 256 of it computed
        light = req(100, "light")
        s.add(light)
        plan = s.schedule(256)
        if policy.name == "fair":
            assert plan.prefills == [(light, 100), (long, 156)]
        else:
            assert plan.prefills == [(long, 256)]  # the light user waits for a whole prompt


def test_a_user_alone_gets_everything_whatever_its_counter() -> None:
    vtc = VirtualTokenCounter()
    s = sched(vtc, seqs=4)
    vtc.counters["heavy"] = 1e9
    for _ in range(6):
        s.add(req(300, "heavy"))
    plan = s.schedule(512)
    assert plan.num_tokens == 512 and len(s.running) == 2  # 300 + 212: the budget is full
    for _ in range(3):
        step(s)
    assert len(s.running) == 4  # every slot filled by the only user asking


def test_counters_are_lifted_when_a_user_becomes_backlogged_and_idle_time_is_not_banked() -> None:
    vtc = VirtualTokenCounter()
    s = sched(vtc, seqs=1)
    for _ in range(3):
        s.add(req(50, "heavy"))
    step(s)  # one admitted (50 prompt + 2 for its first token); two wait
    assert vtc.counter("heavy") == 52
    # a newcomer starts at the least backlogged counter, not at zero
    s.add(req(50, "late"))
    assert vtc.counter("late") == vtc.counter("heavy") == 52
    # a user who was served long ago and went idle is lifted too, never lowered
    vtc.counters["old"] = 10.0
    vtc.counters["rich"] = 1000.0
    s.add(req(10, "old"))
    s.add(req(10, "rich"))
    assert vtc.counter("old") == 52 and vtc.counter("rich") == 1000.0
    # with nobody backlogged, a newcomer starts where the last user to leave the queue was
    for q in list(s.waiting):
        s.remove(q)
    assert vtc.last_left in (vtc.counter(u) for u in ("heavy", "late", "old", "rich"))
    s.add(req(10, "new"))
    assert vtc.counter("new") == vtc.last_left


def test_preemption_takes_the_heaviest_users_youngest_sequence() -> None:
    vtc = VirtualTokenCounter()
    s = Scheduler(BlockPool(4, 4), max_num_seqs=8, policy=vtc)
    heavy_old, heavy_young, light = req(4, "heavy"), req(4, "heavy"), req(3, "light")
    for q in (heavy_old, heavy_young, light):
        s.add(q)
    step(s)  # all admitted, a block each; each heavy one needs a 2nd block next, 1 is free
    vtc.counters["heavy"] += 100
    plan = s.schedule(64)
    # FCFS would preempt `light`, the globally youngest
    assert plan.preempted == [heavy_young] and light.status is SequenceStatus.RUNNING
    assert heavy_young.status is SequenceStatus.WAITING and s.waiting[0] is heavy_young
    s.check_integrity()
    assert FcfsPolicy().victim([heavy_old, heavy_young, light]) is light


def test_predicted_admission_order_is_the_order_admitted_in_a_random_crowd() -> None:
    """Without reply charges between admissions the whole predicted order comes true; with
    them, every step admits exactly the head of the order predicted before it (sequences
    preempted meanwhile aside)."""
    for w_gen in (0.0, 2.0):
        rng = random.Random(11)
        vtc = VirtualTokenCounter(w_gen=w_gen)
        s = sched(vtc, blocks=200, seqs=3)
        users = [f"u{i}" for i in range(5)]
        predicted_whole: list[Sequence] = []
        admitted_all: list[Sequence] = []
        for t in range(1000):
            for _ in range(rng.randint(0, 2) if t < 120 else 0):
                s.add(req(rng.randint(2, 120), rng.choice(users[: rng.randint(1, 5)])))
            if w_gen == 0.0 and t == 120:
                predicted_whole = vtc.admission_order(s.waiting)
                admitted_all = []
            order = vtc.admission_order(s.waiting)
            # a sequence swapped out for a user below its share cannot be foreseen; it takes a
            # place in the order, the others keep theirs
            admitted = [q for q in step(s, rng.choice([32, 128, 512])) if q in order]
            assert admitted == order[: len(admitted)], t
            admitted_all += [q for q in admitted if q in predicted_whole and q not in admitted_all]
            for q in list(s.running):  # replies end at random
                if q.num_generated and rng.random() < 0.2:
                    s.remove(q)
        assert not s.waiting
        if w_gen == 0.0:
            assert len(predicted_whole) > 20 and admitted_all == predicted_whole


def test_engine_queue_position_follows_the_fair_order_and_has_a_wait_estimate() -> None:
    engine, _ = fake_engine(64, max_num_seqs=1, step_s_per_token=0.002)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
        heavy = [engine.submit(list(range(3, 40)), params, user="heavy") for _ in range(5)]
        time.sleep(0.1)
        light = engine.submit(list(range(3, 40)), params, user="light")
        deadline = time.time() + 10
        while engine.queue_position(light) != 0:  # ahead of heavy's four queued requests
            assert time.time() < deadline, engine.queue_position(light)
            time.sleep(0.01)
        assert sorted(engine.queue_position(h) or 0 for h in heavy[1:]) == [1, 2, 3, 4]
        heavy[0].result()
        light.result()
        assert engine.wait_estimate(2) is not None and engine.wait_estimate(2) > 0
        for h in heavy:
            h.cancel()
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_served_tokens_show_the_top_users_by_hash_and_the_rest_as_other() -> None:
    vtc = VirtualTokenCounter()
    s = sched(vtc, seqs=16)
    for i in range(12):
        s.add(req(10 * (i + 1), f"api:secret-key-{i}"))
    for _ in range(3):
        step(s, 2048)
    top = vtc.served_top(10)
    assert len(top) == 11 and top[-1][0] == "other"
    assert top[0] == (owner_label("api:secret-key-11"), 120, 3)
    assert top[-1][1:] == (10 + 20, 3 + 3)  # the two least served users
    assert all("secret" not in label for label, _, _ in top)


def test_a_user_a_whole_slot_below_its_fair_share_takes_one_from_the_user_most_above() -> None:
    vtc = VirtualTokenCounter()
    s = sched(vtc, seqs=8)
    a = [req(20, "A") for _ in range(9)]
    b = [req(20, "B") for _ in range(3)]
    for q in a[:5] + b:
        s.add(q)
    for q in a[5:]:
        s.add(q)
    step(s)
    assert sorted(q.user for q in s.running) == ["A"] * 5 + ["B"] * 3
    c = req(20, "C")
    s.add(c)  # max-min fair shares of 8 slots: A 3.5, B 3.5, C 1
    assert step(s) == [] and vtc.counter("C") == vtc.floor()  # lifted: level with A, no swap
    plan = s.schedule(512)  # A's replies were charged: C is below A now
    assert plan.preempted == [a[4]] and c.status is SequenceStatus.RUNNING
    assert sorted(q.user for q in s.running) == ["A"] * 4 + ["B"] * 3 + ["C"]
    s.check_integrity()
    # half a slot below its share (B: 3 of 3.5) is not enough: no swap back and forth
    s.add(req(20, "B"))
    assert vtc.slot_victim(s.running, s.waiting, 8) is None
    assert FcfsPolicy().slot_victim(s.running, s.waiting, 8) is None


def test_a_user_still_being_served_keeps_at_most_one_requests_deficit() -> None:
    vtc = VirtualTokenCounter()
    s = sched(vtc, seqs=2)
    for _ in range(4):
        s.add(req(100, "A"))
    s.add(req(10, "B", new=20))
    step(s)  # B and one A run; A keeps three waiting
    vtc.counters["A"] = 10_000.0
    s.add(req(10, "B", new=20))  # B has a request running: not idle, keeps a bounded deficit
    assert vtc.counter("B") == 10_000.0 - (10 + 2 * 20)
    s.add(req(10, "D", new=20))  # D was idle: lifted to the least backlogged counter (B's)
    assert vtc.counter("D") == vtc.counter("B") == 9950.0
