"""Per-identity caps on work in flight and on conversations, so one identity cannot fill the
batch, the queue or the database, and a bound on conversations being created at once, so a
flood of creations cannot queue fsync'd writes ahead of everyone's turns."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engine.errors import ServerBusy
from sessions.config import SessionConfig
from sessions.errors import RateLimited


@dataclass
class Slot:
    """One request in flight for `owner` (`turn`: a session's reply, counted for `who`: the
    owner or the end user it named) until `release`."""

    owner: str
    turn: bool
    who: str
    released: bool = False


class IdentityCaps:
    """Counts, per identity, the requests in flight (session turns and one-off completions)
    and the conversations being created; refuses beyond the caps of `SessionConfig` with
    RateLimited (HTTP 429) naming the cap, or ServerBusy when all users together create too
    many conversations at once. A cap of 0 is no cap. Thread-safe."""

    def __init__(self, config: SessionConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._requests: Counter[str] = Counter()
        self._turns: Counter[str] = Counter()
        self._creating: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()  # cap name -> refusals

    def admit(self, owner: str, turn: bool, who: str | None = None) -> Slot:
        """A slot for one request of `owner`, or RateLimited if a cap is reached. The turns
        cap counts `who` (an end user the owner named; default: the owner); the requests
        cap, the owner's requests of all its end users together."""
        c = self.config
        who = owner if who is None else who
        with self._lock:
            if turn and c.max_turns_per_user and self._turns[who] >= c.max_turns_per_user:
                self._refuse(
                    "turns",
                    f"you already have {self._turns[who]} conversations answering at once "
                    f"(the limit is {c.max_turns_per_user} per user); wait for one to finish "
                    "or press Stop",
                )
            if c.max_requests_per_user and self._requests[owner] >= c.max_requests_per_user:
                self._refuse(
                    "requests",
                    f"you already have {self._requests[owner]} requests queued or answering "
                    f"(the limit is {c.max_requests_per_user} per user); wait for one to finish",
                )
            self._requests[owner] += 1
            if turn:
                self._turns[who] += 1
        return Slot(owner, turn, who)

    def release(self, slot: Slot) -> None:
        """The request ended (idempotent)."""
        with self._lock:
            if slot.released:
                return
            slot.released = True
            _decrement(self._requests, slot.owner)
            if slot.turn:
                _decrement(self._turns, slot.who)

    def in_flight(self, owner: str) -> tuple[int, int]:
        """(requests, turns) of `owner` in flight."""
        with self._lock:
            return self._requests[owner], self._turns[owner]

    @contextmanager
    def creating(
        self, owner: str, count: Callable[[str], int], n: int = 1, what: str = ""
    ) -> Iterator[None]:
        """Hold pending-creation places while the block creates `n` conversations of `owner`
        (a new one, an import's, a share's copy: every path that creates conversations comes
        through here), whose committed conversations `count(owner)` says. The per-user cap on
        conversations counts those being created too, so concurrent creations cannot pass
        it. `what`: how the refusal names the request ("the file holds")."""
        c = self.config
        with self._lock:
            busy = sum(self._creating.values())
            if c.max_pending_creates and busy >= c.max_pending_creates:
                self.refused["creates"] += 1
                raise ServerBusy(
                    f"server busy: {busy} conversations are being created right now; "
                    "try again in a moment"
                )
            mine = self._creating[owner]
            if c.max_pending_creates_per_user and mine >= c.max_pending_creates_per_user:
                self._refuse(
                    "creates_per_user",
                    f"you are already creating {mine} conversations (the limit is "
                    f"{c.max_pending_creates_per_user} at once per user); wait for them",
                )
            if c.max_sessions_per_user:
                have = count(owner) + mine
                if have + n > c.max_sessions_per_user:
                    adds = f"{what} {n} conversation{'s' * (n != 1)} and " if what else ""
                    self._refuse(
                        "sessions",
                        f"{adds}you have {have} conversations (the limit is "
                        f"{c.max_sessions_per_user} per user); delete some first",
                    )
            self._creating[owner] += n
        try:
            yield
        finally:
            with self._lock:
                _decrement(self._creating, owner, n)

    def _refuse(self, cap: str, message: str) -> None:
        self.refused[cap] += 1
        raise RateLimited(message)


def _decrement(counter: Counter[str], key: str, n: int = 1) -> None:
    counter[key] -= n
    assert counter[key] >= 0, f"{key} released more than admitted"
    if not counter[key]:
        del counter[key]  # idle users cost nothing
