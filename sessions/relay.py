"""The one relay from a Reply to its reader, as typed events: for a synchronous reader (the
chat page) produced on a thread of its own; for an asyncio reader (the API) awaited on its
loop with no thread per reply (AsyncRelay). Either way a wake-up carries every delta that
arrived since the last one (the handle batches them), not one token."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from engine import CrowdchatError, RequestHandle
from sessions.reply import Reply

log = logging.getLogger(__name__)
# A reply's blocking steps (a KV restore and the submit; the commit at its end) run here:
# short, but one may wait on the engine or the SQLite writer, so not on an event loop.
# Threads are reused across replies, and idle ones cost nothing but their stacks.
_BLOCKING = ThreadPoolExecutor(max_workers=32, thread_name_prefix="crowdchat-reply")


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class End:
    """The reply ended normally (its finish reason lives on the reply)."""


@dataclass(frozen=True)
class Failed:
    error: BaseException


Event = Delta | End | Failed


def relay(
    reply: Iterable[str], put: Callable[[Event], None], stopped: Callable[[], bool] = lambda: False
) -> None:
    """Run `reply` to its end on this thread, handing `put` a Delta per text delta, then one
    End or Failed. `stopped()` true: the reader left, stop handing it deltas."""
    deltas = iter(reply)
    try:
        for text in deltas:
            if stopped():
                break
            put(Delta(text))
        put(End())
    except Exception as e:  # noqa: BLE001 - handed to the reader, who reports it
        put(Failed(e))
    finally:
        close = getattr(deltas, "close", None)
        if close is not None:
            try:
                close()  # a generator's cleanup (a session turn commits its reply) runs now
            except Exception:  # noqa: BLE001 - the reply is already on its way
                log.exception("closing a reply stream failed")


class RelayThread:
    """A blocking reader's end of the relay: `get` waits a while for the next event."""

    def __init__(self, reply: Iterable[str], name: str) -> None:
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        threading.Thread(
            target=relay, args=(reply, self._events.put), name=name, daemon=True
        ).start()

    def get(self, timeout: float) -> Event | None:
        """The next event, or None if none came within `timeout` seconds."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None


class AsyncRelay:
    """An asyncio reader's end of a reply: `await next()` for events, `cancel()` when the
    reader leaves. Opening and closing the reply run on a worker thread; deltas are awaited
    on the loop straight from the engine's handle. `close` (the commit) runs exactly once,
    also when the reader leaves mid-stream, and a finished reply's End or Failed comes only
    after it, so a client that saw the end finds the reply in its session."""

    def __init__(self, reply: Reply) -> None:
        self._reply = reply
        self._opening: Future[RequestHandle | None] = _BLOCKING.submit(reply.open)
        self._handle: RequestHandle | None = None
        self._closing: Future[None] | None = None
        self._last: Event | None = None  # End or Failed, handed out after the commit

    async def next(self) -> Event:
        """The next event; after End or Failed there are no more. Safe to cancel (a timeout
        around it): nothing is lost, the next call goes on where this one was."""
        if self._closing is not None:
            await asyncio.shield(asyncio.wrap_future(self._closing))
            return self._last or End()  # after cancel(): nothing more to read
        try:
            if self._handle is None:
                self._handle = await asyncio.shield(asyncio.wrap_future(self._opening))
                if self._handle is None:  # cancelled before it reached the engine
                    return await self._end(End())
            text = await self._handle.next_batch()
        except Exception as e:  # noqa: BLE001 - handed to the reader, who reports it
            if isinstance(e, CrowdchatError):
                self._reply.fail(e)
            return await self._end(Failed(e))
        if not text:
            return await self._end(End())
        self._reply.record(text)
        return Delta(text)

    def cancel(self) -> None:
        """The reader left (or stopped): stop generating; the reply is still committed."""
        if self._closing is None:
            self._reply.cancel()
            self._closing = _BLOCKING.submit(self._close)

    async def _end(self, event: Event) -> Event:
        self._last, self._closing = event, _BLOCKING.submit(self._close)
        return await self.next()

    def _close(self) -> None:
        try:
            self._opening.result()  # close comes after open, whatever open did
        except Exception:  # noqa: BLE001 - open's error was the reader's to see
            pass
        try:
            self._reply.close()
        except Exception:  # noqa: BLE001 - nobody is left to hand it to
            log.exception("closing a reply failed")
