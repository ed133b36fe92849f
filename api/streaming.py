"""The asyncio end of the reply relay: events produced on a thread, awaited on the loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable

from sessions.relay import Event, relay


class DeltaStream:
    """Runs `reply` (which blocks on the engine) in a dedicated thread, one per request, so
    no event-loop or executor thread ever waits on the engine; `cancel` stops it.

    A dedicated thread rather than `asyncio.to_thread` per item: the default executor has a
    handful of workers, and a crowd of slow streams would otherwise queue behind each other.
    """

    def __init__(self, reply: Iterable[str], cancel: Callable[[], None], name: str) -> None:
        self._cancel_fn = cancel
        self._cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._thread = threading.Thread(
            target=relay, args=(reply, self._put, self._cancelled.is_set), name=name, daemon=True
        )
        self._thread.start()

    async def next(self) -> Event:
        """The next event; after End or Failed there are no more."""
        return await self._queue.get()

    def ready(self) -> Event | None:
        """The next event if one is already waiting, else None (never blocks)."""
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def cancel(self) -> None:
        """Stop generating (the engine frees the request's blocks at its next step)."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._cancel_fn()

    def _put(self, event: Event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)
        except RuntimeError:  # the loop closed (server shutdown): nobody is listening
            self.cancel()
