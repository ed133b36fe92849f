"""Per-session backoff for failed snapshot writes, so a full or unwritable disk costs one
export and one write per session per backoff period, not one per sweep."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class RetryPolicy:
    """The wait after a session's n-th failure in a row: first_s * 2**(n-1), at most max_s."""

    first_s: float = 5.0
    max_s: float = 300.0

    def __post_init__(self) -> None:
        assert 0 < self.first_s <= self.max_s, (self.first_s, self.max_s)

    def delay(self, failures: int) -> float:
        return min(self.first_s * 2 ** min(failures - 1, 30), self.max_s)


@dataclass(frozen=True)
class PersistStatus:
    """Why a session's KV is not on disk: failures in a row, the last error, and when (wall
    clock, `time.time()`) the sweeper tries again."""

    failures: int
    last_error: str
    retry_at: float


class PersistRetry:
    """The failing sessions' PersistStatus; a success or a discard forgets the session."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self._lock = threading.Lock()
        self._failing: dict[str, PersistStatus] = {}

    def failed(self, sid: str, error: str) -> PersistStatus:
        with self._lock:
            n = self._failing[sid].failures + 1 if sid in self._failing else 1
            status = PersistStatus(n, error, time.time() + self.policy.delay(n))
            self._failing[sid] = status
            return status

    def forget(self, sid: str) -> None:
        with self._lock:
            self._failing.pop(sid, None)

    def waiting(self, sid: str) -> bool:
        """Whether the session is still backing off from its last failure."""
        with self._lock:
            status = self._failing.get(sid)
        return status is not None and time.time() < status.retry_at

    def status(self, sid: str) -> PersistStatus | None:
        with self._lock:
            return self._failing.get(sid)

    def failing(self) -> dict[str, PersistStatus]:
        with self._lock:
            return dict(self._failing)
