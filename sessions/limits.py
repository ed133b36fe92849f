"""Per-user token budgets, charged when work is admitted, so one user cannot monopolize the
shared batch by running many requests at once."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass

from sessions.errors import RateLimited

WINDOW_S = 60.0


@dataclass
class Reservation:
    """Tokens held for one admitted request until it ends and `settle` charges what it cost."""

    owner: str
    tokens: int
    settled: bool = False


class TokenRateLimiter:
    """A sliding one-minute window of tokens per owner, plus the tokens their requests in
    flight have reserved.

    `reserve` runs when a request is admitted: it holds the prompt tokens the server will
    compute (a history recomputed after its KV was dropped or cut counts; a prefix served from
    resident KV does not) and the whole reply budget (`max_tokens`), and refuses the request
    if the owner's last minute plus what is reserved plus this request would pass the limit.
    `settle` runs when the request ends (finished, stopped, failed): the reservation goes and
    what the request really cost is charged to the window, so what it did not generate comes
    back. An owner with nothing used or reserved may always run one request, however large
    (else a turn bigger than the whole budget could never run). A limit of 0 turns it off.
    """

    def __init__(
        self, tokens_per_minute: int, scope: str = "per user", subject: str = "you have"
    ) -> None:
        self.limit = tokens_per_minute
        self.scope = scope  # how a refusal names the limit and who used the tokens
        self.subject = subject
        self._used: dict[str, deque[tuple[float, int]]] = defaultdict(deque)
        self._reserved: dict[str, int] = defaultdict(int)
        self._lock = threading.Lock()
        self._swept = time.monotonic()
        self.refused = 0

    def __len__(self) -> int:
        """Owners with tokens in the window or reserved (what the limiter keeps in memory)."""
        with self._lock:
            return len(self._used.keys() | self._reserved.keys())

    def _sweep(self, now: float) -> None:
        """Forget every owner whose window is empty (lock held), at most once a window: an
        owner who never comes back (a new identity per request) would otherwise be kept
        forever."""
        if now - self._swept < WINDOW_S:
            return
        self._swept = now
        for owner in [o for o, w in self._used.items() if w[-1][0] <= now - WINDOW_S]:
            del self._used[owner]

    def _window(self, owner: str, now: float) -> int:
        """Tokens charged in the last minute (lock held)."""
        window = self._used.get(owner)
        if not window:
            return 0
        while window and window[0][0] <= now - WINDOW_S:
            window.popleft()
        if not window:
            del self._used[owner]  # idle users cost nothing
            return 0
        return sum(n for _, n in window)

    def used(self, owner: str, now: float | None = None) -> int:
        """Tokens charged to `owner` in the last minute (settled requests)."""
        with self._lock:
            return self._window(owner, time.monotonic() if now is None else now)

    def reserved(self, owner: str) -> int:
        """Tokens held by `owner`'s requests in flight."""
        with self._lock:
            return self._reserved.get(owner, 0)

    def standing(self, owner: str) -> tuple[int, int, float]:
        """(tokens charged in the last minute, tokens reserved in flight, seconds until the
        oldest charge leaves the window: 0 with none) for `owner`."""
        with self._lock:
            now = time.monotonic()
            used = self._window(owner, now)
            window = self._used.get(owner)
            frees = window[0][0] + WINDOW_S - now if window else 0.0
            return used, self._reserved.get(owner, 0), max(frees, 0.0)

    def reserve(self, owner: str, tokens: int) -> Reservation:
        """Hold `tokens` for a request of `owner`; RateLimited, saying when to come back, if
        that would pass the limit."""
        tokens = max(int(tokens), 0)
        with self._lock:
            if self.limit:
                now = time.monotonic()
                used = self._window(owner, now)
                held = self._reserved.get(owner, 0)
                if used + held and used + held + tokens > self.limit:
                    self.refused += 1
                    raise RateLimited(self._refusal(owner, used, held, tokens, now))
            self._reserved[owner] += tokens
        return Reservation(owner, tokens)

    def settle(self, reservation: Reservation, cost: int) -> None:
        """The request ended having cost `cost` tokens: release its reservation and charge
        that instead (idempotent: only the first call counts)."""
        with self._lock:
            if reservation.settled:
                return
            reservation.settled = True
            left = self._reserved[reservation.owner] - reservation.tokens
            assert left >= 0, "a reservation was released twice"
            if left:
                self._reserved[reservation.owner] = left
            else:
                del self._reserved[reservation.owner]
            if self.limit and cost > 0:
                now = time.monotonic()
                self._sweep(now)
                self._used[reservation.owner].append((now, int(cost)))

    def _refusal(self, owner: str, used: int, held: int, tokens: int, now: float) -> str:
        window = self._used.get(owner)
        wait = max(1, int(window[0][0] + WINDOW_S - now + 1)) if window else 1
        flight = f" and {held} are held by your replies in progress" if held else ""
        when = "when a reply ends or " if held else ""
        return (
            f"{self.subject} used {used} tokens in the last minute{flight}; this request needs "
            f"{tokens} more (the limit is {self.limit} {self.scope}); try again {when}in {wait} s"
        )
