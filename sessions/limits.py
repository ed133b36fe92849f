"""Per-user token budgets, so one user cannot monopolize the shared batch."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque

from sessions.errors import RateLimited

WINDOW_S = 60.0


class TokenRateLimiter:
    """A sliding one-minute window of tokens per owner: what their turns cost the server,
    the prompt tokens it computed (a history recomputed after its KV was dropped or cut
    counts; a prefix served from resident KV does not) and the reply.

    `check` refuses a new turn while the owner's last minute is at or over the limit;
    `record` adds what a turn cost once it is known. A limit of 0 turns it off.
    """

    def __init__(self, tokens_per_minute: int) -> None:
        self.limit = tokens_per_minute
        self._used: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self._lock = threading.Lock()
        self.refused = 0

    def used(self, owner: str, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        with self._lock:
            window = self._used.get(owner)
            if not window:
                return 0
            while window and window[0][0] <= now - WINDOW_S:
                window.popleft()
            if not window:
                del self._used[owner]  # idle users cost nothing
                return 0
            return sum(n for _, n in window)

    def check(self, owner: str) -> None:
        """Raise RateLimited, saying when to come back, if the owner is over the limit."""
        if not self.limit:
            return
        now = time.monotonic()
        used = self.used(owner, now)
        if used >= self.limit:
            with self._lock:
                self.refused += 1
                oldest = self._used[owner][0][0]
            wait = max(1, int(oldest + WINDOW_S - now + 1))
            raise RateLimited(
                f"you have used {used} tokens in the last minute (the limit is "
                f"{self.limit} per user); try again in {wait} s"
            )

    def record(self, owner: str, tokens: int) -> None:
        if self.limit and tokens > 0:
            with self._lock:
                self._used[owner].append((time.monotonic(), tokens))
