"""The real engine loop, scheduler and pool driven by a fake model in milliseconds: seeded random
crowds (arrivals, cancels, owners coming back, edited prefixes, tiny pools, small budgets)
checked on every step and at the end. See tests/fake_model.py for what each step asserts."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import pytest

from engine import Engine, FinishReason, RequestHandle, SamplingParams, ServerBusy
from engine.core.resident import common_prefix
from engine.sequence import PLACEHOLDER
from tests.fake_model import VOCAB, expected_reply, fake_engine

WAIT_S = 30.0  # far above what any request here needs: hitting it means something hangs
SYSTEM = list(range(500, 541))  # an operator-shared system prompt: 41 tokens, any user shares
USERS = ["u0", "u1", "u2"]  # prefix-cache namespaces; sessions of one user share theirs


@dataclass
class Sent:
    handle: RequestHandle
    prompt: list[int]
    params: SamplingParams
    owner: str | None
    user: str | None = None


@dataclass
class Crowd:
    """The requests one simulation sent, and each owner's conversation so far."""

    rng: random.Random
    engine: Engine
    sent: list[Sent] = field(default_factory=list)
    conversations: dict[str, list[int]] = field(default_factory=dict)
    busy_owners: set[str] = field(default_factory=set)
    rejected: int = 0

    def prompt_for(self, owner: str | None) -> list[int]:
        rng, limit = self.rng, self.engine.max_model_len - 1
        fresh = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, min(160, limit)))]
        if rng.random() < 0.4:  # a new conversation under the shared system prompt
            fresh = SYSTEM + fresh
        elif rng.random() < 0.3 and self.sent:  # someone's earlier prompt, sent again
            fresh = list(rng.choice(self.sent[-30:]).prompt)
        history = self.conversations.get(owner or "", [])
        roll = rng.random()
        if history and roll < 0.6:  # the owner's next turn: history + a new message
            prompt = history + fresh[: rng.randint(1, 24)]
        elif history and roll < 0.8:  # an edit early in the conversation
            cut = rng.randint(0, min(len(history), 8))
            prompt = history[:cut] + fresh
        else:
            prompt = fresh
        return prompt[-limit:]

    def submit_one(self) -> None:
        rng = self.rng
        owners = [f"o{i}" for i in range(8)]
        owner = rng.choice([None, *owners])
        if owner in self.busy_owners:
            owner = None
        prompt = self.prompt_for(owner)
        params = SamplingParams(
            temperature=0, max_new_tokens=rng.randint(1, 48), ignore_eos=rng.random() < 0.2
        )
        user = USERS[int(owner[1:]) % len(USERS)] if owner else rng.choice([None, *USERS])
        shared = len(SYSTEM) if prompt[: len(SYSTEM)] == SYSTEM else 0
        try:
            handle = self.engine.submit(
                prompt,
                params,
                owner=owner,
                retain=owner is not None,
                cache_ns=user,
                shareable_prefix=shared,
            )
        except ServerBusy:
            self.rejected += 1
            return
        if owner is not None:
            self.busy_owners.add(owner)
        self.sent.append(Sent(handle, prompt, params, owner, user))

    def settle_owners(self) -> None:
        """Owners whose turn ended may come back with the conversation extended."""
        for s in self.sent:
            if s.owner in self.busy_owners and s.handle.done:
                self.busy_owners.discard(s.owner)
                if s.handle.finish_reason is not FinishReason.ERROR:
                    self.conversations[s.owner] = s.prompt + s.handle.token_ids


def simulate(seed: int, requests: int, num_blocks: int, **settings: object) -> Crowd:
    rng = random.Random(seed)
    engine, runner = fake_engine(num_blocks, **settings)
    crowd = Crowd(rng, engine)
    try:
        while len(crowd.sent) + crowd.rejected < requests:
            crowd.settle_owners()
            roll = rng.random()
            if roll < 0.7:
                crowd.submit_one()
            elif roll < 0.8 and crowd.sent:
                rng.choice(crowd.sent[-20:]).handle.cancel()
            elif roll < 0.85:
                # the session layer, under pressure, persisting somebody's idle KV
                owners = list(engine.resident_kv())
                if owners:
                    engine.drop_kv(rng.choice(owners))
            else:
                time.sleep(rng.random() * 0.002)
        for s in crowd.sent:
            assert s.handle._done.wait(WAIT_S), f"request {s.handle.seq_id} waits forever"
        check_replies(crowd)
        check_isolation(crowd)
        engine.check_integrity()
        stats = engine.stats()
        assert stats.running == 0 and stats.waiting == 0
        assert stats.blocks_used == stats.resident_blocks
        assert runner.steps > 0
    finally:
        engine.shutdown()
    return crowd


def check_replies(crowd: Crowd) -> None:
    """Every request ended with a reason, and its tokens are exactly its solo reply."""
    max_len = crowd.engine.max_model_len
    for s in crowd.sent:
        h = s.handle
        assert h.finish_reason is not None
        assert h.finish_reason is not FinishReason.ERROR, h.error
        want = expected_reply(s.prompt, s.params.max_new_tokens, max_len, s.params.ignore_eos)
        if h.finish_reason is FinishReason.CANCELLED:
            assert h.token_ids == want[: len(h.token_ids)]
        else:
            assert h.token_ids == want, f"request {h.seq_id} differs from its solo reply"


def check_isolation(crowd: Crowd) -> None:
    """No request found more in the prefix cache than what an earlier request of its own
    user wrote, or the shared system prompt's full blocks; and the cache did find things."""
    bs = crowd.engine.config.block_size
    shared_blocks = len(SYSTEM) // bs * bs
    for i, s in enumerate(crowd.sent):
        allowed = shared_blocks if s.prompt[: len(SYSTEM)] == SYSTEM else 0
        for t in crowd.sent[: i + 1]:
            if s.user is not None and t.user == s.user:
                allowed = max(allowed, common_prefix(t.prompt + t.handle.token_ids, s.prompt))
        assert s.handle.num_hit_tokens <= allowed, (i, s.handle.num_hit_tokens, allowed)
    assert sum(s.handle.num_hit_tokens for s in crowd.sent) > 0


SCENARIOS = [  # (seed, requests, blocks, engine settings)
    (1, 400, 64, {"max_num_batched_tokens": 512}),
    (2, 400, 24, {"max_num_batched_tokens": 32}),  # a tiny budget: admissions at 1 token left
    (3, 400, 12, {"max_num_batched_tokens": 16, "max_num_seqs": 4}),  # a tiny pool
    (4, 400, 40, {"max_num_batched_tokens": 48, "block_size": 8}),
    (
        5,
        300,
        32,
        {"max_num_batched_tokens": 512, "target_itl_ms": 5.0, "step_s_per_token": 2e-5},
    ),  # budgets sized by the ITL target
    (6, 400, 16, {"max_num_batched_tokens": 64, "max_queue": 8}),  # a full queue rejects
    (7, 400, 12, {"max_num_batched_tokens": 16, "max_num_seqs": 4, "schedule": "fcfs"}),
]


@pytest.mark.parametrize(("seed", "requests", "blocks", "settings"), SCENARIOS)
def test_random_crowds_get_exact_replies_and_exact_accounting(
    seed: int, requests: int, blocks: int, settings: dict
) -> None:
    crowd = simulate(seed, requests, blocks, **settings)
    assert len(crowd.sent) >= requests // 10 and len(crowd.sent) + crowd.rejected == requests
    reasons = {s.handle.finish_reason for s in crowd.sent}
    assert FinishReason.CANCELLED in reasons and FinishReason.LENGTH in reasons


@pytest.mark.parametrize(("seed", "requests", "blocks", "settings"), SCENARIOS)
def test_random_crowds_running_a_step_ahead_get_the_same_exact_replies(
    seed: int, requests: int, blocks: int, settings: dict
) -> None:
    """The loop as it runs on CUDA: each step launched before the last one's tokens are read,
    its decodes fed them on the "device" (RunAheadFakeRunner), the host's ids holding
    placeholders meanwhile. Every reply is still its solo reply token for token (stop tokens,
    lengths, cancels mid-reply, preemptions in tiny pools, owners coming back to their KV),
    no placeholder ever reaches the model, and the accounting is exact at every step."""
    crowd = simulate(seed, requests, blocks, run_ahead=True, **settings)
    runner = crowd.engine.runner
    # steps ran ahead, and others (prefills, refused feeds) read the last step's tokens first
    assert 50 <= runner.fed_steps < runner.steps
    reasons = {s.handle.finish_reason for s in crowd.sent}
    assert {FinishReason.CANCELLED, FinishReason.LENGTH, FinishReason.STOP} <= reasons
    for s in crowd.sent:
        assert PLACEHOLDER not in s.handle.token_ids


def test_the_resident_prefix_is_reused_by_the_owner_only() -> None:
    engine, _ = fake_engine(32)
    try:
        prompt = list(range(3, 60))
        first = engine.submit(
            prompt, SamplingParams(temperature=0, max_new_tokens=4), owner="alice", retain=True
        )
        first.result()
        again = prompt + first.token_ids + [7, 8, 9]
        stranger = engine.submit(
            again, SamplingParams(temperature=0, max_new_tokens=4), owner="bob", retain=True
        )
        stranger.result()
        assert stranger.num_cached_tokens == 0
        mine = engine.submit(
            again, SamplingParams(temperature=0, max_new_tokens=4), owner="alice", retain=True
        )
        mine.result()
        assert mine.num_cached_tokens == len(prompt) + len(first.token_ids) - 1
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_a_step_ahead_leaves_the_same_resident_kv_as_a_step_at_a_time() -> None:
    """A reply that ends (by its length, by a stop token) while the step after its last token
    already runs: the owner's resident KV is what a step at a time leaves (all but the last
    token), not the step launched past the end, and no placeholder stays in it."""
    prompts = [list(range(3, 40)), list(range(50, 71))]
    kept = []
    for run_ahead in (False, True):
        engine, runner = fake_engine(32, run_ahead=run_ahead)
        try:
            for i, prompt in enumerate(prompts):
                # a long one ends on its first stop token, a short one on its length
                params = SamplingParams(temperature=0, max_new_tokens=200 if i else 5)
                handle = engine.submit(prompt, params, owner=f"o{i}", retain=True)
                handle.result()
                want = expected_reply(prompt, params.max_new_tokens, engine.max_model_len)
                assert handle.token_ids == want
            kept.append({o: kv[:2] for o, kv in engine.resident_kv().items()})
            engine.check_integrity()
            assert engine.stats().runs_ahead is run_ahead  # said in the stats and the benches
        finally:
            engine.shutdown()
        assert getattr(runner, "fed_steps", 0) > 0 or not run_ahead
    assert kept[0] == kept[1]
    assert kept[0]["o0"][0] == len(prompts[0]) + 5 - 1
