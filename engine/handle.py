"""What `Engine.submit` returns: a thread-safe stream of text deltas with a finish reason."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine.errors import CrowdchatError
from engine.sequence import FinishReason


class RequestFailed(CrowdchatError):
    """The engine failed this request (a step crashed, or the engine stopped)."""


@dataclass(frozen=True)
class _Finished:
    reason: FinishReason
    error: str | None
    kind: type[CrowdchatError] = RequestFailed


class RequestHandle:
    """Iterate it for text deltas; `cancel()` from any thread; read the result after it ends."""

    def __init__(self, seq_id: int, num_prompt_tokens: int, cancel: Callable[[int], None]) -> None:
        self.seq_id = seq_id
        self.num_prompt_tokens = num_prompt_tokens
        self.token_ids: list[int] = []  # generated so far (written by the engine thread)
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.num_cached_tokens = 0  # prompt tokens whose KV was already in the pool
        self.num_hit_tokens = 0  # of them, found by the prefix cache (not the owner's own KV)
        self.admitted = False  # reached the running batch (else its prompt was never computed)
        self._cancel = cancel
        self._events: queue.SimpleQueue[str | _Finished] = queue.SimpleQueue()
        self._done = threading.Event()

    # -- engine side ----------------------------------------------------------------------
    def _push(self, delta: str) -> None:
        if delta:
            self._events.put(delta)

    def _finish(
        self,
        reason: FinishReason,
        error: str | None = None,
        kind: type[CrowdchatError] = RequestFailed,
    ) -> None:
        """End the stream; an ERROR finish raises `kind(error)` to the reader (an upstream's
        400 is an InvalidRequest, an unreachable one EngineStopped, like the engine's own)."""
        if self._done.is_set():
            return
        self.finish_reason, self.error = reason, error
        self._done.set()
        self._events.put(_Finished(reason, error, kind))

    # -- caller side ----------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids)

    def cancel(self) -> None:
        """Stop generating; the blocks are freed at the engine's next step."""
        if not self._done.is_set():
            self._cancel(self.seq_id)

    def __iter__(self) -> Iterator[str]:
        """Yield text deltas until the request ends. Raises RequestFailed on an error finish."""
        while True:
            event = self._events.get()
            if isinstance(event, _Finished):
                if event.reason is FinishReason.ERROR:
                    raise event.kind(event.error or "request failed")
                return
            self.text += event
            yield event

    def result(self) -> str:
        """Consume the stream and return the whole reply text."""
        for _ in self:
            pass
        return self.text
