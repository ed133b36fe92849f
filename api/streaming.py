"""A blocking stream of text deltas, run in its own thread and consumed from the event loop."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class End:
    """The reply ended normally (its finish reason lives on the handle or turn)."""


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = Delta | End | Failed


class DeltaStream:
    """Iterates `deltas` (which block on the engine) in a dedicated thread, one per request,
    so no event-loop or executor thread ever waits on the engine; `cancel` stops it.

    A dedicated thread rather than `asyncio.to_thread` per item: the default executor has a
    handful of workers, and a crowd of slow streams would otherwise queue behind each other.
    """

    def __init__(self, deltas: Iterator[str], cancel: Callable[[], None], name: str) -> None:
        self._deltas = deltas
        self._cancel_fn = cancel
        self._cancelled = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
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

    def _run(self) -> None:
        try:
            for text in self._deltas:
                if self._cancelled.is_set():
                    break
                self._put(Delta(text))
            self._put(End())
        except Exception as e:  # noqa: BLE001 - handed to the request's coroutine
            self._put(Failed(e))
        finally:
            close = getattr(self._deltas, "close", None)
            if close is not None:
                try:
                    close()  # a generator's cleanup (a session turn commits its reply) runs now
                except Exception:  # noqa: BLE001 - the reply is already on its way
                    log.exception("closing a reply stream failed")
