"""The one relay from a Reply (which blocks on the engine) to its reader: typed events,
produced on a thread of their own, for the chat page (synchronous) and the API (asyncio)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)


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
