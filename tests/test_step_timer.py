"""The latency-aware token budget: learned from step times, sized for the ITL target."""

from __future__ import annotations

from engine.metrics import Histogram, StepTimer


def test_budget_is_fixed_without_a_target() -> None:
    timer = StepTimer(None, default_budget=512, floor=80)
    for n in range(1, 50):
        timer.record(n * 10, 5 + n)
    assert timer.budget() == 512


def test_budget_follows_the_fitted_step_cost() -> None:
    timer = StepTimer(60.0, default_budget=512, floor=80)
    assert timer.budget() == 512  # too few samples yet
    for n in (16, 64, 128, 256, 300, 40, 200, 100, 500):
        timer.record(n, 10 + 0.5 * n)  # 10 ms fixed + 0.5 ms per token
    assert abs(timer.budget() - 100) <= 1  # (60 - 10) / 0.5
    slow = StepTimer(20.0, default_budget=512, floor=80)
    for n in (16, 64, 128, 256, 300, 40, 200, 100, 500):
        slow.record(n, 10 + 0.5 * n)
    assert slow.budget() == 80  # never below the floor: prefill always progresses


def test_histogram_is_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.5, 0.7, 3.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 1), ("1.0", 3), ("+Inf", 4)]
    assert abs(h.sum - 4.25) < 1e-9
