"""Counting events per key in a sliding minute: new anonymous identities per address, failed
sign-ins per name and per address (refused before PBKDF2 runs, so a guesser cannot burn the
shared cores)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from fastapi import HTTPException

# the client address of the /login request being served (set by the Doors middleware:
# Gradio calls the auth function with the user name and password only)
LOGIN_ADDRESS: ContextVar[str] = ContextVar("crowdchat_login_address", default="unknown")
KEY_CHARS = 200  # a key is at most this long: a megabyte of user name is not kept


class Window:
    """How many events each key had in the last `window_s` seconds; thread-safe. At most
    `max_keys` keys are kept, in least-recently-used order: when a new key comes and the map
    is full, the least recently used one is forgotten even if it has recent events (memory
    stays bounded whatever a flood of names or addresses does; the per-address window still
    rations how fast one address can push others out)."""

    def __init__(
        self,
        limit: int,
        window_s: float = 60.0,
        max_keys: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        assert limit >= 1 and max_keys >= 1
        self.limit, self.window_s, self.max_keys, self.clock = limit, window_s, max_keys, clock
        # never an empty deque: a key with no event left is removed at once
        self._events: OrderedDict[str, deque[float]] = OrderedDict()
        self._lock = threading.Lock()

    def _forget_before_adding(self, now: float) -> None:
        """Room for one more key: drop keys with nothing recent from the least recently used
        end, then, if still full, the least recently used keys themselves."""
        while self._events:
            oldest = next(iter(self._events.values()))
            if len(self._events) < self.max_keys and oldest and oldest[-1] > now - self.window_s:
                return
            self._events.popitem(last=False)

    def take(self, key: str) -> bool:
        """Count one event for `key` if it is under the limit; False (nothing counted) if not."""
        key = key[:KEY_CHARS]
        with self._lock:
            now = self.clock()
            events = self._events.get(key)
            if events is not None:
                self._events.move_to_end(key)
                while events and events[0] <= now - self.window_s:
                    events.popleft()
                if len(events) >= self.limit:
                    return False
                events.append(now)
                return True
            self._forget_before_adding(now)
            self._events[key] = deque([now])
            return True

    def give_back(self, key: str) -> None:
        """Uncount the latest event of `key` (a sign-in that succeeded)."""
        key = key[:KEY_CHARS]
        with self._lock:
            events = self._events.get(key)
            if events is not None:
                events.pop()
                if not events:
                    del self._events[key]


# the bound on one name's failures from all addresses together: this many times the
# per-(name, address) limit, over this many times the window (slower, and wide enough that a
# guesser on one address cannot reach it alone)
NAME_FACTOR, NAME_WINDOWS = 30, 10


class LoginThrottle:
    """Failed sign-ins per (user name, client address), per client address, and per user name
    from all addresses (a slower bound). An attempt counts as failed from the moment it starts
    (so parallel guesses count) and is forgiven if it succeeds. A guesser locks a name out
    for their own address only: the right password from another address still gets in, until
    failures from many addresses together pass the name's bound."""

    def __init__(
        self, per_name: int, per_address: int, window_s: float = 60.0, max_keys: int = 100_000
    ) -> None:
        self.by_pair = Window(per_name, window_s, max_keys)
        self.by_name = Window(per_name * NAME_FACTOR, window_s * NAME_WINDOWS, max_keys)
        self.by_address = Window(per_address, window_s, max_keys)
        self.hashes_run = 0  # password checks actually run (tests assert on it)
        self.refused = 0

    def guard(self, check: Callable[[str, str], bool]) -> Callable[[str, str], Awaitable[bool]]:
        """A Gradio `auth` coroutine: throttled `check`, run off the event loop."""

        async def guarded(username: str, password: str) -> bool:
            address = LOGIN_ADDRESS.get()
            pair = f"{address}\0{username}"
            if not self.by_address.take(address):
                self._refuse("from your address")
            if not self.by_pair.take(pair):
                self.by_address.give_back(address)
                self._refuse("for this user name from your address")
            if not self.by_name.take(username):
                self.by_address.give_back(address)
                self.by_pair.give_back(pair)
                self._refuse("for this user name")
            self.hashes_run += 1
            ok = await asyncio.to_thread(check, username, password)
            if ok:
                self.by_pair.give_back(pair)
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
