"""What one step computes: the contract between the scheduler (engine.core), which makes it,
and the model runner, which runs it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sequence import Sequence


@dataclass
class StepPlan:
    """One step's work: decodes (one token each) first, then prefill chunks."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    @property
    def sequences(self) -> list[Sequence]:
        return self.decodes + [s for s, _ in self.prefills]

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)
