"""The step budget: how many tokens the next step may take, fixed or sized for an ITL target."""

from __future__ import annotations

from collections import deque
from operator import attrgetter

import numpy as np

from engine.core.scheduler import MIN_PREFILL_CHUNK, Scheduler
from engine.model.plan import StepPlan


def attention_work(plan: StepPlan) -> float:
    """Query-key pairs the step's attention computes (see StepTimer)."""
    work = sum(map(attrgetter("num_computed"), plan.decodes)) + len(plan.decodes)  # C loop
    return work + sum(n * (s.num_computed + n / 2) for s, n in plan.prefills)


TARGET_MARGIN = 0.8
FIT_EVERY = 16  # steps between the fits TokenBudget publishes to other threads


class StepTimer:
    """Learns what a step costs and sizes the token budget for an inter-token latency target.

    Model: `ms = a + b * tokens + c * work`, where `work` counts query-key pairs of attention
    (a decode attends its whole context; a prefill chunk of n tokens after p cached ones
    about n * (p + n / 2)). Attention is what makes a 512-token chunk of a long prompt cost
    far more than one of a short prompt, so a tokens-only fit misses the target there.
    """

    def __init__(self, target_ms: float | None, default_budget: int, floor: int) -> None:
        self.target_ms = target_ms
        self.default_budget = default_budget
        self.floor = floor
        self.samples: deque[tuple[int, float, float]] = deque(maxlen=256)
        self._fit: tuple[float, float, float] | None = None

    def record(self, tokens: int, work: float, ms: float) -> None:
        self.samples.append((tokens, work, ms))
        self._fit = None

    def fit(self) -> tuple[float, float, float] | None:
        """(a, b, c) from recent steps, or None while there is too little variety."""
        if self._fit is None and len(self.samples) >= 8:
            x = np.array([(1.0, n, w) for n, w, _ in self.samples])
            t = np.array([ms for _, _, ms in self.samples])
            if np.ptp(x[:, 1]) >= 1:
                coef, *_ = np.linalg.lstsq(x, t, rcond=None)
                self._fit = (float(coef[0]), max(float(coef[1]), 1e-6), max(float(coef[2]), 0.0))
        return self._fit

    def budget(self, decodes: int = 0, decode_work: float = 0.0, prefill_context: int = 0) -> int:
        """Tokens for the next step (decodes included) that keep it under the target, given
        the decodes it must run and the context the next prefill chunk starts from."""
        fit = self.fit() if self.target_ms is not None else None
        if fit is None:
            return self.default_budget
        a, b, c = fit
        # a + b (d + n) + c (w_d + n (p + n / 2)) <= aim, solved for the chunk size n; the
        # aim leaves room for step-to-step noise so most steps, not the average, fit
        rest = self.target_ms * TARGET_MARGIN - a - b * decodes - c * decode_work
        lin = b + c * prefill_context
        if c > 0:
            n = (-lin + np.sqrt(max(lin * lin + 2 * c * rest, 0.0))) / c
        else:
            n = rest / lin
        return int(max(self.floor, min(decodes + n, self.default_budget * 4)))


def prefill_ms(fit: tuple[float, float, float], tokens: int, chunk: int) -> float:
    """Milliseconds the fitted steps take to prefill `tokens` from nothing, `chunk` tokens a
    step (a conversation recomputed: what its user waits before the first new token)."""
    a, b, c = fit
    ms, done = 0.0, 0
    while done < tokens:
        n = min(chunk, tokens - done)
        ms += a + b * n + c * n * (done + n / 2)
        done += n
    return ms


class TokenBudget:
    """The token budget of each step: `--max-num-batched-tokens`, or with `--target-itl-ms`
    what the step timer predicts keeps running users' inter-token latency under the target."""

    def __init__(self, max_num_batched_tokens: int, target_itl_ms: float | None) -> None:
        self.fixed = max_num_batched_tokens
        self.timer = StepTimer(target_itl_ms, max_num_batched_tokens, MIN_PREFILL_CHUNK)
        self.last = max_num_batched_tokens  # for the admin page
        # the step timer's fit, refreshed by the engine thread every FIT_EVERY steps and read
        # from any thread (one tuple, replaced whole): what a recompute would cost
        self.fitted: tuple[float, float, float] | None = None
        self._since_fit = 0

    def next(self, scheduler: Scheduler) -> int:
        """The budget for the step the scheduler is about to plan."""
        if self.timer.target_ms is None:
            self.last = self.fixed
            return self.last
        running = scheduler.running
        decodes = [s for s in running if s.num_uncomputed == 1]
        pending = [s for s in running if s.num_uncomputed > 1] or list(scheduler.waiting)
        self.last = self.timer.budget(
            len(decodes),
            sum(s.num_computed + 1 for s in decodes),
            pending[0].num_computed if pending else 0,
        )
        return self.last

    def record(self, plan: StepPlan, ms: float) -> None:
        """What the step that ran `plan` cost, so the next budget fits the target."""
        self.timer.record(plan.num_tokens, attention_work(plan), ms)
        self._since_fit += 1
        if self._since_fit >= FIT_EVERY:
            self._since_fit = 0
            self.fitted = self.timer.fit() or self.fitted

    def recompute_s(self, tokens: int) -> float | None:
        """Seconds a prefill of `tokens` from nothing would take at the pace of recent steps
        (None until enough steps were timed). Any thread."""
        fit = self.fitted
        if fit is None or tokens <= 0:
            return None
        ms = prefill_ms(fit, tokens, self.fixed)
        return ms / 1e3 if ms > 0 else None
