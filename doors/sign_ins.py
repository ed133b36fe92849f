"""Gradio's sign-in tokens, with an end.

Gradio's `/login` hands the browser a random token and keeps `app.tokens[token] = name`
forever (until the server restarts): a copied cookie kept working for good, and changing a
leaked password did not end the sessions signed in with it. `SignIns` takes the place of that
dict (the same mapping, so Gradio's login, logout and user lookups use it unchanged, and so
does the Doors middleware): a token is valid for `max_age_s` after its sign-in, and only while
its user's credential is the one they signed in with (`credential_of`: the users file's
credential epoch, which a reset, a disable and a re-enable each move on). The credential is
the one the password was checked against, read before the check (`bind`): a reset that lands
while the check runs leaves a token that is dead from the start, never one bound to the new
password. An expired or stale token is dropped when it is next looked up, and every sign-in
drops the expired ones, so the map holds one entry per live sign-in.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass

# (name, credential) a sign-in was checked against, set by `bind` in the /login request's
# context: Gradio awaits the auth coroutine, then stores the token in the same context
CHECKED: ContextVar[tuple[str, object] | None] = ContextVar("crowdchat_checked", default=None)


@dataclass(frozen=True)
class SignIn:
    name: str
    at: float  # `clock()` when it was made
    credential: object  # `credential_of(name)` when the password was checked


class SignIns(MutableMapping[str, str]):
    """token -> user name, for as long as the sign-in is valid."""

    def __init__(
        self,
        max_age_s: float,
        credential_of: Callable[[str], object] = lambda _name: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_age_s = max_age_s
        self.credential_of = credential_of
        self.clock = clock
        self._lock = threading.Lock()  # the event loop and worker threads both look up
        self._tokens: dict[str, SignIn] = {}

    def _expired(self, s: SignIn, now: float) -> bool:
        return now - s.at > self.max_age_s

    def _valid(self, s: SignIn) -> bool:
        return not self._expired(s, self.clock()) and self.credential_of(s.name) == s.credential

    def __getitem__(self, token: str) -> str:
        with self._lock:
            s = self._tokens[token]
        if not self._valid(s):
            with self._lock:
                self._tokens.pop(token, None)
            raise KeyError(token)
        return s.name

    def __setitem__(self, token: str, name: str) -> None:
        checked = CHECKED.get()
        if checked is not None and checked[0] == name:
            credential = checked[1]
        else:  # not through `bind` (tests of the map alone)
            credential = self.credential_of(name)
        sign_in = SignIn(name, self.clock(), credential)
        with self._lock:
            now = self.clock()
            self._tokens = {t: s for t, s in self._tokens.items() if not self._expired(s, now)}
            self._tokens[token] = sign_in

    def __delitem__(self, token: str) -> None:
        with self._lock:
            del self._tokens[token]

    def __iter__(self) -> Iterator[str]:
        """The valid tokens only: Gradio's logout reads `tokens[t]` for each of them."""
        with self._lock:
            items = list(self._tokens.items())
        return iter([t for t, s in items if self._valid(s)])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def bind(
        self, auth: Callable[[str, str], Awaitable[bool]]
    ) -> Callable[[str, str], Awaitable[bool]]:
        """Gradio's `auth` coroutine `auth`, with the credential it checks read first and kept
        for the token Gradio stores next (`CHECKED`)."""

        async def bound(username: str, password: str) -> bool:
            credential = await asyncio.to_thread(self.credential_of, username)
            ok = await auth(username, password)
            CHECKED.set((username, credential) if ok else None)
            return ok

        return bound
