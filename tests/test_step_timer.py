"""The latency-aware token budget: learned from step times, sized for the ITL target."""

from __future__ import annotations

from engine import SamplingParams
from engine.core.block_pool import BlockPool
from engine.core.budget import (
    AUTO_ITL_RATIO,
    AUTO_MIN_CHUNK,
    FIT_EVERY,
    StepTimer,
    TokenBudget,
    prefill_ms,
)
from engine.core.scheduler import Scheduler
from engine.metrics import Histogram
from engine.model.plan import StepPlan
from engine.sequence import Sequence

# synthetic steps: 10 ms fixed, 0.5 ms per token, 0.001 ms per query-key pair
STEPS = [
    (16, 2000),
    (64, 9000),
    (128, 60000),
    (256, 150000),
    (300, 20000),
    (40, 300),
    (200, 90000),
    (100, 5000),
    (500, 400000),
    (8, 1200),
]


def cost(n: int, work: float) -> float:
    return 10 + 0.5 * n + 0.001 * work


def test_without_a_target_the_budget_is_whole_until_timed_or_while_nobody_decodes() -> None:
    timer = StepTimer(None, default_budget=512, floor=16)
    assert timer.budget(8, 1000, 0) == 512  # too few samples yet
    for n, w in STEPS:
        timer.record(n, w, cost(n, w))
    assert timer.budget(0, 0, 300) == 512  # prefill only: no running user's gap to keep short
    assert timer.budget(8, 1000, 300) < 512


def test_by_default_a_step_with_prefill_chunks_costs_at_most_1_5_decode_steps() -> None:
    """No --target-itl-ms: the chunk is sized so the step's predicted cost stays within
    AUTO_ITL_RATIO of the same decodes alone, never below AUTO_MIN_CHUNK tokens of prompt."""
    timer = StepTimer(None, default_budget=512, floor=16)
    for n, w in STEPS:
        timer.record(n, w, cost(n, w))
    for decodes, ctx, p in ((8, 200, 0), (32, 400, 300), (48, 700, 600)):
        budget = timer.budget(decodes, decodes * ctx, p)
        n = budget - decodes
        alone = cost(decodes, decodes * ctx)
        assert n >= AUTO_MIN_CHUNK
        with_chunk = cost(budget, decodes * ctx + n * (p + n / 2))
        assert with_chunk <= AUTO_ITL_RATIO * alone or n == AUTO_MIN_CHUNK
        assert with_chunk >= 1.4 * alone or n == AUTO_MIN_CHUNK  # as much as fits, no less
    assert timer.budget(1, 50, 0) - 1 == AUTO_MIN_CHUNK  # a cheap step: the floor


def test_default_budget_keeps_mixed_steps_near_decode_steps_while_a_prompt_progresses() -> None:
    """A scheduler and a fake model whose steps cost `heavy` (attention-bound, as on a CPU): 24
    users decode, then a 1,500-token prompt arrives. Every step that carries its chunks costs at
    most AUTO_ITL_RATIO times the decodes' own step (or carries only the minimum chunk), and
    the prompt progresses every step to its end."""

    def heavy(n: int, work: float) -> float:
        return 20 + 0.2 * n + 0.002 * work

    sched = Scheduler(BlockPool(1000, 16), max_num_seqs=32)
    budget = TokenBudget(512, None)
    users = [Sequence(list(range(1, 400 + i)), SamplingParams()) for i in range(24)]
    for s in users:
        sched.add(s)

    def step() -> StepPlan:
        plan = sched.schedule(budget.next(sched))
        work = sum(s.num_computed + 1 for s in plan.decodes)
        work += sum(n * (s.num_computed + n / 2) for s, n in plan.prefills)
        budget.record(plan, heavy(plan.num_tokens, work))
        for s in plan.decodes:
            s.num_computed += 1
            s.token_ids.append(7)
        for s, n in plan.prefills:
            s.num_computed += n
            if s.num_computed == s.num_tokens:
                s.token_ids.append(7)
        return plan

    while len(sched.running) < len(users) or any(s.num_uncomputed > 1 for s in users):
        step()
    for _ in range(8):
        step()  # decodes only
    long = Sequence(list(range(1, 1501)), SamplingParams())
    sched.add(long)
    chunks: list[int] = []
    while long.num_uncomputed > 1:
        assert len(chunks) < 100
        decode_work = sum(s.num_computed + 1 for s in users)
        before = long.num_computed
        plan = step()
        n = dict(plan.prefills)[long]  # progresses every step
        chunks.append(n)
        assert len(plan.decodes) == 24
        alone = heavy(24, decode_work)
        mixed = heavy(24 + n, decode_work + n * (before + n / 2))
        assert mixed <= AUTO_ITL_RATIO * alone + 1e-6 or n <= AUTO_MIN_CHUNK, (n, mixed, alone)
    assert len(chunks) >= 6 and max(chunks) > AUTO_MIN_CHUNK  # sized by the fit, not fixed
    assert min(chunks[:-1]) >= AUTO_MIN_CHUNK


def test_a_recompute_is_estimated_from_the_fitted_steps_in_chunks() -> None:
    """What a conversation's recompute would cost (the session layer weighs a disk read by
    it): the fitted steps summed over the chunks the token budget cuts it into, published for
    other threads every FIT_EVERY steps."""
    budget = TokenBudget(512, None)
    assert budget.recompute_s(1000) is None
    for i in range(FIT_EVERY):
        n, w = STEPS[i % len(STEPS)]
        seq = Sequence(list(range(1, w // n + n + 2)), SamplingParams())
        seq.num_computed = w // n
        plan = StepPlan(prefills=[(seq, n)])
        work = n * (seq.num_computed + n / 2)
        budget.record(plan, cost(n, work))
        assert (budget.recompute_s(1000) is None) == (i < FIT_EVERY - 1)
    # two chunks, 512 tokens from nothing, then 488 after those 512
    expected = 2 * 10 + 0.5 * 1000 + 0.001 * (512 * 256 + 488 * (512 + 244))
    assert prefill_ms((10, 0.5, 0.001), 1000, 512) == expected
    assert abs(budget.recompute_s(1000) * 1e3 - expected) < 1e-6 * expected
    assert budget.recompute_s(0) is None


def test_histogram_is_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.7, 3.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 1), ("1.0", 3), ("+Inf", 4)]
    assert abs(h.sum - 4.25) < 1e-9
