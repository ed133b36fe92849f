"""A step launched on the device whose sampled tokens the host has not read yet (run-ahead).

On CUDA the engine thread launches step N (graph replay and device sampling), starts a
non-blocking copy of its picks into pinned host memory with an event after it, launches step
N+1, whose rows take N's picks on the device (`StaticDecode.run`'s `fed`), and only then reads
N's picks (`tokens`: the event's wait, then one `tolist`). vLLM v1's async scheduling works
the same way (`AsyncGPUModelRunnerOutput`: a copy of the sampled ids on its own event, read
one step late). On the CPU a step's picks are ready when it returns: `tokens` just reads them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.model.plan import StepPlan
from engine.sequence import Sequence


class StepTokens(Protocol):
    """A launched step's next tokens: `sampled` (in order) and, when asked, their ids."""

    sampled: list[Sequence]

    def tokens(self) -> list[int]:
        """The sampled ids, one per `sampled` (waits for the device)."""
        ...


class RunsAhead(Protocol):
    """A step runner that launches steps without waiting for their tokens (engine.core.loop)."""

    runs_ahead: bool  # whether to launch steps ahead (CUDA); else every step runs with `run`

    def feed(self, plan: StepPlan, prev: StepTokens) -> object | None:
        """How `plan`, scheduled with placeholders for `prev`'s tokens, takes them on the
        device; None where it cannot (the loop then reads `prev`'s tokens first)."""
        ...

    def launch(self, plan: StepPlan, feed: object | None) -> StepTokens:
        """Start the step (with `feed`'s tokens where given); its tokens come later."""
        ...


class LaunchedStep:
    """A step's picks ([n] int64) on the device, on their way to pinned host memory."""

    def __init__(self, sampled: list[Sequence], picks: torch.Tensor | None) -> None:
        self.sampled = sampled
        self.picks = picks
        self._rows: dict[Sequence, int] | None = None
        self._copied: torch.cuda.Event | None = None
        self._host = picks
        if picks is not None and picks.is_cuda:
            self._host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=True)
            self._host.copy_(picks, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    @property
    def rows(self) -> dict[Sequence, int]:
        """Each sampled sequence's index among the picks."""
        if self._rows is None:
            self._rows = {s: i for i, s in enumerate(self.sampled)}
        return self._rows

    def tokens(self) -> list[int]:
        if self._host is None:
            return []
        if self._copied is not None:
            self._copied.synchronize()
        return self._host.tolist()
