"""Tokens computed per user, for `/metrics` and the admin page: the most served ones by name."""

from __future__ import annotations

import hashlib
import heapq
import threading
from collections import Counter

from engine.sequence import Sequence

SERVED_CAP = 10_000  # users whose served tokens are kept one by one; the rest fold into "other"


def user_of(seq: Sequence) -> str:
    """The fairness unit: the identity behind the request (else its KV owner)."""
    return seq.user or seq.owner or ""


def owner_label(user: str) -> str:
    """What `/metrics` and the admin page show for a user: a short hash, never the raw id
    (a browser id or an API key is a bearer credential)."""
    return hashlib.sha256(user.encode()).hexdigest()[:12]


def step_tokens(
    decodes: list[Sequence], prefills: list[tuple[Sequence, int]]
) -> dict[str, list[int]]:
    """user -> [prompt tokens, generated tokens] of a planned step, users in the order they
    first appear: each decode and each prompt-finishing chunk yields a token; chunks are prompt.
    One pass a step, not one call a row (at 256 rows the per-row calls were ~0.1 ms a step)."""
    made = Counter([s.user or s.owner or "" for s in decodes])  # user_of, inlined
    step = {user: [0, n] for user, n in made.items()}
    for seq, n in prefills:
        row = step.setdefault(user_of(seq), [0, 0])
        row[0] += n
        row[1] += seq.num_computed + n == seq.num_tokens
    return step


class ServedTokens:
    """Prompt and generated tokens computed per user. The engine thread records each planned
    step; any thread may read `top`. Bounded: beyond SERVED_CAP users the least served half
    folds into "other"."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rows: dict[str, list[int]] = {}  # user -> [prompt tokens, generated tokens]
        self.other = [0, 0]

    def record(self, step: dict[str, list[int]]) -> None:
        """A planned step's tokens: user -> [prompt tokens, generated tokens] (`step_tokens`)."""
        with self._lock:
            for user, (prompt, generated) in step.items():
                row = self._row(user)
                row[0] += prompt
                row[1] += generated
            if len(self.rows) > SERVED_CAP:
                self._fold()

    def add(self, user: str, prompt: int, generated: int) -> None:
        """One request's tokens at once (a backend without steps: an upstream's reply)."""
        with self._lock:
            row = self._row(user)
            row[0] += prompt
            row[1] += generated
            if len(self.rows) > SERVED_CAP:
                self._fold()

    def top(self, n: int) -> list[tuple[str, int, int]]:
        """[(label, prompt tokens, generated tokens)] of the `n` users served most, then
        ("other", ...) for everyone else."""
        with self._lock:
            rows = [(u, p, g) for u, (p, g) in self.rows.items()]
            other = list(self.other)
        top = heapq.nlargest(n, rows, key=lambda r: r[1] + r[2])
        shown = {u for u, _, _ in top}
        for u, p, g in rows:
            if u not in shown:
                other[0] += p
                other[1] += g
        out = [(owner_label(u), p, g) for u, p, g in top]
        return [*out, ("other", *other)] if any(other) else out

    def _row(self, user: str) -> list[int]:
        row = self.rows.get(user)
        if row is None:
            row = self.rows[user] = [0, 0]
        return row

    def _fold(self) -> None:
        by_use = sorted(self.rows.items(), key=lambda kv: kv[1][0] + kv[1][1])
        for user, (p, g) in by_use[: len(by_use) // 2]:
            self.other[0] += p
            self.other[1] += g
            del self.rows[user]
