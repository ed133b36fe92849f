"""The engine thread's per-step shortcuts (issue 58) agree with the per-row work they replace:
bulk fair-share charges, bulk latency buckets, what the scheduler keeps between steps, and the
replies the output path hands to live readers."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from bench.throughput import TEXT
from engine import Engine, EngineConfig
from engine.core.block_pool import BlockPool
from engine.core.detokenizer import IncrementalDetokenizer
from engine.core.fair_share import VirtualTokenCounter
from engine.core.scheduler import Scheduler
from engine.metrics import ITL_BUCKETS, Histogram
from engine.model.loader import LoadedModel
from engine.model.plan import StepPlan
from engine.sequence import FinishReason, SamplingParams, Sequence
from engine.served import user_of
from tests.fake_model import FakeTokens


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


class ScriptedRunner:
    """An instant model stand-in: each sampled row's next token is the next one of its
    request's script (by prompt), so replies are known in advance."""

    def __init__(self, scripts: dict[tuple[int, ...], list[int]], stop_ids: list[int]) -> None:
        self.scripts = scripts
        self.stop_ids = stop_ids

    def run(self, plan: StepPlan) -> dict[Sequence, int]:
        sampled = plan.decodes + [s for s, n in plan.prefills if s.num_computed + n == s.num_tokens]
        return {
            s: self.scripts[tuple(s.token_ids[: s.num_prompt_tokens])][s.num_generated]
            for s in sampled
        }


class RunAheadScriptedRunner(ScriptedRunner):
    """ScriptedRunner behind the run-ahead protocol: a step's tokens are read by the loop one
    step later (its rows' scripts are indexed by `num_generated`, placeholders included)."""

    runs_ahead = True

    def feed(self, plan: StepPlan, prev: FakeTokens) -> dict | None:
        return None if plan.prefills else {}

    def launch(self, plan: StepPlan, feed: dict | None) -> FakeTokens:
        return FakeTokens(self.run(plan))


@pytest.mark.parametrize("run_ahead", [False, True])
@pytest.mark.parametrize("seed", [1, 58])
def test_replies_through_the_engine_with_live_readers_are_what_the_tokens_say(
    local: tuple, seed: int, run_ahead: bool
) -> None:
    """The real engine loop (step by step, or a step ahead), scheduler and output path over a
    scripted stand-in, a crowd of replies read live by threads and an asyncio loop while they
    are generated: each reader gets its reply's text once, in order (the text a per-token
    decoder gives for the tokens before the end, the stop token never shown), with the finish
    reason and token ids the script says (a stop token ends and is counted; max_new_tokens; a
    stop string)."""
    tokenizer, _, _, vocab = local
    eos = tokenizer.eos_token_id
    rng = random.Random(seed)
    words = tokenizer.encode(TEXT, add_special_tokens=False)
    n = 40
    prompts, scripts, params = [], {}, []
    for i in range(n):
        prompt = [*words[i : i + 6], i + 1000]  # distinct prompts
        script = [rng.choice(words) for _ in range(80)]
        if rng.random() < 0.4:
            script[rng.randint(0, 30)] = eos
        stop = ("the",) if rng.random() < 0.25 else ()
        prompts.append(prompt)
        scripts[tuple(prompt)] = script
        params.append(SamplingParams(max_new_tokens=rng.randint(1, 50), stop=stop))
    loaded = LoadedModel.stand_in(tokenizer, vocab, 4096, "instant")
    config = EngineConfig(block_size=8, kv_budget_mb=60 * 64 / 2**20, max_num_seqs=16, max_queue=n)
    kind = RunAheadScriptedRunner if run_ahead else ScriptedRunner
    engine = Engine(config, loaded, runner=lambda *a, **k: kind(scripts, [eos]))
    texts: dict[int, str] = {}
    try:
        handles = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]

        def read(i: int) -> None:
            texts[i] = "".join(handles[i])

        async def read_async(ids: list[int]) -> None:
            async def one(i: int) -> None:
                parts = []
                while part := await handles[i].next_batch():
                    parts.append(part)
                texts[i] = "".join(parts)

            await asyncio.gather(*(one(i) for i in ids))

        threads = [threading.Thread(target=read, args=(i,)) for i in range(n) if i % 2]
        threads.append(
            threading.Thread(target=lambda: asyncio.run(read_async(list(range(0, n, 2)))))
        )
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        finished = engine.metrics.finished
    finally:
        engine.shutdown()
    assert finished == n
    for i, h in enumerate(handles):
        script, sp = scripts[tuple(prompts[i])], params[i]
        detok = IncrementalDetokenizer(tokenizer, prompts[i], sp.stop)
        want_ids, want_text, reason = [], "", FinishReason.LENGTH
        for token in script[: sp.max_new_tokens]:
            want_ids.append(token)
            if token == eos:
                reason = FinishReason.STOP
                break
            want_text += detok.push(token)
            if detok.stopped:
                reason = FinishReason.STOP
                break
        want_text += detok.flush()
        assert h.token_ids == want_ids, i
        assert h.finish_reason is reason, i
        assert texts[i] == h.text == want_text, i
