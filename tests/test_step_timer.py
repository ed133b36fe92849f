"""The latency-aware token budget: learned from step times, sized for the ITL target."""

from __future__ import annotations

from engine import SamplingParams
from engine.core.budget import FIT_EVERY, StepTimer, TokenBudget, prefill_ms
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


def test_budget_is_fixed_without_a_target() -> None:
    timer = StepTimer(None, default_budget=512, floor=16)
    for n, w in STEPS:
        timer.record(n, w, cost(n, w))
    assert timer.budget(8, 1000, 0) == 512


def test_budget_follows_the_fitted_step_cost_and_the_context() -> None:
    timer = StepTimer(100.0, default_budget=512, floor=16)
    assert timer.budget() == 512  # too few samples yet
    for n, w in STEPS:
        timer.record(n, w, cost(n, w))
    short = timer.budget(decodes=8, decode_work=8 * 200, prefill_context=0)
    long = timer.budget(decodes=8, decode_work=8 * 200, prefill_context=1500)
    assert long < short  # a chunk of a long prompt costs more per token
    for budget, ctx in ((short, 0), (long, 1500)):
        n = budget - 8
        predicted = cost(budget, 8 * 200 + n * (ctx + n / 2))
        assert 76 <= predicted <= 80.5  # as much as fits under 80% of the target, no more
    slow = StepTimer(20.0, default_budget=512, floor=16)
    for n, w in STEPS:
        slow.record(n, w, cost(n, w))
    assert slow.budget(8, 1600, 1500) == 16  # never below the floor: prefill progresses


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
