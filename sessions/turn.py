"""One chat turn as the UI sees it: status, streamed deltas, and a durable ending."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from engine import CrowdchatError, RequestHandle, SamplingParams

if TYPE_CHECKING:
    from sessions.manager import SessionManager

log = logging.getLogger(__name__)


class ChatTurn:
    """Iterate for text deltas. `status` tells the UI what is happening: 'restoring' (KV
    coming back from disk), 'queued' (see `queue_position`), 'generating', then 'done'.

    The reply is committed to SQLite when the turn ends, also when it is stopped (with what
    was produced) or fails. Errors surface as CrowdchatError from the iteration.
    """

    def __init__(self, manager: SessionManager, sid: str, prompt: list[int],
                 params: SamplingParams, release: Callable[[], None]) -> None:
        self.manager = manager
        self.session_id = sid
        self.prompt = prompt
        self.params = params
        self.status = "restoring"
        self.restored_from: str | None = None  # resident / host / disk / cold
        self.handle: RequestHandle | None = None
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._cancelled = False
        self._release = release
        self._started = False
        self.owner = ""  # whose turn: the rate limiter charges them
        self.prior_tokens = 0  # the conversation's tokens before this turn
        self.had_kv = False  # the session had KV before this turn (cold means recompute)

    def queue_position(self) -> int | None:
        """Requests ahead of this one while it waits; None otherwise."""
        if self.handle is None:
            return None
        return self.manager.engine.queue_position(self.handle)

    def cancel(self) -> None:
        """Stop generating; what was produced so far is kept."""
        self._cancelled = True
        if self.handle is not None:
            self.handle.cancel()

    def __iter__(self) -> Iterator[str]:
        assert not self._started, "a turn streams once"
        self._started = True
        try:
            self.restored_from = self.manager.offload.restore(self.session_id)
            if self.restored_from == "cold" and self.had_kv:
                self.manager.recomputes += 1
            if self._cancelled:
                self.finish_reason = "cancelled"
                return
            self.status = "queued"
            self.handle = self.manager.engine.submit(self.prompt, self.params,
                                                     owner=self.session_id, retain=True)
            for delta in self.handle:
                self.status = "generating"
                self.text += delta
                yield delta
            self.finish_reason = str(self.handle.finish_reason)
        except CrowdchatError as e:
            self.error = str(e)
            self.finish_reason = "error"
            raise
        finally:
            if self.handle is not None and not self.handle.done:
                self.handle.cancel()  # the consumer went away mid-stream
                self.finish_reason = self.finish_reason or "cancelled"
            self.status = "done"
            try:
                self.manager._end_turn(self)
            except RuntimeError as e:  # the store closed under an abandoned stream
                log.warning("reply of session %s not saved: %s", self.session_id, e)
            finally:
                self._release()

    def close(self) -> None:
        """Give the session back without streaming (a turn the caller decided not to run)."""
        if not self._started:
            self._started = True
            self._release()

    def result(self) -> str:
        """Consume the whole turn and return the reply text."""
        for _ in self:
            pass
        return self.text
