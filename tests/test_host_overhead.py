"""The engine thread's per-step shortcuts (issue 58) agree with the per-row work they replace:
bulk fair-share charges, bulk latency buckets, and what the scheduler keeps between steps."""

from __future__ import annotations

import random

from engine.core.block_pool import BlockPool
from engine.core.fair_share import VirtualTokenCounter
from engine.core.scheduler import Scheduler
from engine.metrics import ITL_BUCKETS, Histogram
from engine.sequence import SamplingParams, Sequence
from engine.served import user_of


def charge_row_by_row(vtc: VirtualTokenCounter, decodes: list, prefills: list) -> None:
    """What `charge` did before: one token a row, counted and charged in row order."""
    rows = vtc.served.rows
    for seq in decodes:
        rows.setdefault(user_of(seq), [0, 0])[1] += 1
        vtc.counters[user_of(seq)] = vtc.counter(user_of(seq)) + vtc.w_gen
    for seq, n in prefills:
        row = rows.setdefault(user_of(seq), [0, 0])
        row[0] += n
        if seq.num_computed + n == seq.num_tokens:
            row[1] += 1
            vtc.counters[user_of(seq)] = vtc.counter(user_of(seq)) + vtc.w_gen


def test_a_steps_bulk_charge_equals_charging_row_by_row() -> None:
    rng = random.Random(58)
    for w_gen in (2.0, 0.1, 1 / 3):  # the last two are not exact in binary: same sums anyway
        bulk, rows = VirtualTokenCounter(w_gen=w_gen), VirtualTokenCounter(w_gen=w_gen)
        users = [f"u{i}" for i in range(7)] + [None]
        for _ in range(200):
            seqs = []
            for _ in range(rng.randint(0, 40)):
                user = rng.choice(users)
                s = Sequence([1] * rng.randint(2, 30), SamplingParams(), user=user, owner="o")
                s.num_computed = rng.randint(0, s.num_tokens - 1)
                seqs.append(s)
            decodes = [s for s in seqs if rng.random() < 0.7]
            prefills = [(s, s.num_tokens - s.num_computed - rng.randint(0, 1)) for s in seqs]
            prefills = [(s, n) for s, n in prefills if s not in decodes and n > 0]
            bulk.charge(decodes, prefills)
            charge_row_by_row(rows, decodes, prefills)
        assert bulk.counters == rows.counters
        assert list(bulk.counters) == list(rows.counters)  # same users, met in the same order
        assert list(bulk.served.rows.items()) == list(rows.served.rows.items())


def test_observing_a_steps_latencies_at_once_equals_one_at_a_time() -> None:
    rng = random.Random(3)
    values = [rng.choice([*ITL_BUCKETS, 0.0, 7.0]) for _ in range(100)]  # bounds themselves too
    values += [rng.uniform(0, 3) for _ in range(400)]
    one, all_ = Histogram(ITL_BUCKETS), Histogram(ITL_BUCKETS)
    rng.shuffle(values)
    for v in values:
        one.observe(v)
    i = 0
    while i < len(values):  # steps of a few rows and of many
        n = rng.choice([0, 1, 3, 15, 16, 64, 200])
        all_.observe_all(values[i : i + n])
        i += n
    assert all_.counts == one.counts and all_.sum == one.sum


def test_what_the_scheduler_keeps_between_steps_matches_a_recount_in_a_random_crowd() -> None:
    """A tight pool (preemptions, dropped resident KV), few slots (fair-share slot swaps),
    retained owners: after every step the blocks a running sequence needs are there, the
    just-admitted list is who newly runs, membership changes are counted, and the resident
    block count equals a recount (`check_integrity`)."""
    rng = random.Random(2026)
    vtc = VirtualTokenCounter()
    sched = Scheduler(BlockPool(24, 4), max_num_seqs=5, policy=vtc)
    live: list[Sequence] = []
    swaps = 0
    for _ in range(600):
        if rng.random() < 0.5:
            user = rng.choice("abc")
            owner = rng.choice([None, f"{user}1", f"{user}2"])
            prompt = [rng.randint(1, 9) for _ in range(rng.randint(2, 30))]
            s = Sequence(prompt, SamplingParams(max_new_tokens=16), owner=owner, user=user)
            s.retain = owner is not None
            sched.add(s)
            live.append(s)
        before, changes = list(sched.running), sched.running_changes
        plan = sched.schedule(rng.choice([8, 16, 64]))
        swaps += bool(plan.preempted)
        assert sched.just_admitted == [s for s in sched.running if s not in before]
        if set(sched.running) != set(before):
            assert sched.running_changes != changes
        for s in sched.running:
            assert len(s.block_table) * 4 >= s.num_tokens
        for s in plan.decodes:
            s.num_computed += 1
            s.token_ids.append(rng.randint(1, 9))
        for s, n in plan.prefills:
            s.num_computed += n
            if s.num_computed == s.num_tokens:
                s.token_ids.append(rng.randint(1, 9))
        for s in list(sched.running):
            if s.num_generated >= 16 or rng.random() < 0.02:
                sched.remove(s)
                live.remove(s)
        sched.check_integrity()
    assert swaps > 10 and sched.num_resident_dropped > 0  # the crowd reached the hard cases
