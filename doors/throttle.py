"""Counting events per key in a sliding minute: new anonymous identities per address, failed
sign-ins per name and per address (refused before PBKDF2 runs, so a guesser cannot burn the
shared cores)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from fastapi import HTTPException

# the client address of the /login request being served (set by the Doors middleware:
# Gradio calls the auth function with the user name and password only)
LOGIN_ADDRESS: ContextVar[str] = ContextVar("crowdchat_login_address", default="unknown")
KEY_CHARS = 200  # a key is at most this long: a megabyte of user name is not kept


class Window:
    """How many events each key had in the last `window_s` seconds; thread-safe."""

    def __init__(self, limit: int, window_s: float = 60.0, max_keys: int = 100_000) -> None:
        self.limit, self.window_s, self.max_keys = limit, window_s, max_keys
        self._events: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def _recent(self, key: str, now: float) -> deque[float]:
        events = self._events.get(key[:KEY_CHARS])
        if events is None:
            if len(self._events) >= self.max_keys:  # forget keys with nothing recent
                for k in [k for k, q in self._events.items() if q[-1] <= now - self.window_s]:
                    del self._events[k]
            events = self._events[key[:KEY_CHARS]] = deque()
        while events and events[0] <= now - self.window_s:
            events.popleft()
        return events

    def take(self, key: str) -> bool:
        """Count one event for `key` if it is under the limit; False (nothing counted) if not."""
        with self._lock:
            events = self._recent(key, time.monotonic())
            if len(events) >= self.limit:
                return False
            events.append(time.monotonic())
            return True

    def give_back(self, key: str) -> None:
        """Uncount the latest event of `key` (a sign-in that succeeded)."""
        with self._lock:
            events = self._events.get(key[:KEY_CHARS])
            if events:
                events.pop()


class LoginThrottle:
    """Failed sign-ins per user name and per client address. An attempt counts as failed
    from the moment it starts (so parallel guesses count) and is forgiven if it succeeds."""

    def __init__(self, per_name: int, per_address: int, window_s: float = 60.0) -> None:
        self.by_name = Window(per_name, window_s)
        self.by_address = Window(per_address, window_s)
        self.hashes_run = 0  # password checks actually run (tests assert on it)
        self.refused = 0

    def guard(self, check: Callable[[str, str], bool]) -> Callable[[str, str], Awaitable[bool]]:
        """A Gradio `auth` coroutine: throttled `check`, run off the event loop."""

        async def guarded(username: str, password: str) -> bool:
            address = LOGIN_ADDRESS.get()
            if not self.by_address.take(address):
                self._refuse("from your address")
            if not self.by_name.take(username):
                self.by_address.give_back(address)
                self._refuse("for this user name")
            self.hashes_run += 1
            ok = await asyncio.to_thread(check, username, password)
            if ok:
                self.by_name.give_back(username)
                self.by_address.give_back(address)
            return ok

        return guarded

    def _refuse(self, where: str) -> None:
        self.refused += 1
        raise HTTPException(
            status_code=429,
            detail=f"Too many failed sign-ins {where}: wait a minute, then try again.",
            headers={"Retry-After": "60"},
        )
