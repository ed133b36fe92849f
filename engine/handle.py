"""What `Engine.submit` returns: a thread-safe stream of text deltas with a finish reason.

Deltas are handed over in batches, and a reader that is slower than the tokens wakes once for
everything that arrived meanwhile. Two producers' ways in: text (the upstream's asyncio loop, or
the engine thread for replies with stop strings) is appended to a list under the handle's lock,
waking the reader when the list was empty; token ids whose text the reader decodes (the engine
thread's, `_detok` set) are appended to `token_ids` with no lock at all (`list.append` is atomic
under the GIL), and the producer wakes the reader only where `reader_waiting` says it waits
(`wake_reader`, once a step): no lock a token on the engine thread. A
thread reads with `for delta in handle`; an asyncio reader awaits `next_batch()`, with no
thread of its own: the handles read on one loop share one `call_soon_threadsafe` for all
that became ready while the loop was busy (an engine step's tokens for 32 streams: one).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from engine.errors import CrowdchatError
from engine.sequence import FinishReason


class TextDecoder(Protocol):
    """A request's token ids to text (engine.core.detokenizer.IncrementalDetokenizer)."""

    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class RequestFailed(CrowdchatError):
    """The engine failed this request (a step crashed, or the engine stopped)."""


@dataclass(frozen=True)
class _Finished:
    reason: FinishReason
    error: str | None
    kind: type[CrowdchatError] = RequestFailed


class _LoopWaker:
    """Sets the events of an asyncio loop's ready readers, from any thread, with one
    `call_soon_threadsafe` for every event that became ready before the loop got to it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._ready: list[asyncio.Event] = []

    def wake(self, event: asyncio.Event) -> None:
        if asyncio._get_running_loop() is self._loop:
            event.set()  # a producer on the reader's own loop (the upstream's): no hop
            return
        with self._lock:
            self._ready.append(event)
            if len(self._ready) > 1:
                return  # a flush is on its way
        try:
            self._loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the reader's loop closed (server shutdown): nobody listens
            with self._lock:
                self._ready.clear()

    def _flush(self) -> None:
        with self._lock:
            ready, self._ready = self._ready, []
        for event in ready:
            event.set()


_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker] = (
    weakref.WeakKeyDictionary()
)
_wakers_lock = threading.Lock()


def _waker_of(loop: asyncio.AbstractEventLoop) -> _LoopWaker:
    with _wakers_lock:
        waker = _wakers.get(loop)
        if waker is None:
            waker = _wakers[loop] = _LoopWaker(loop)
        return waker


class RequestHandle:
    """Iterate it (or await `next_batch`) for text deltas; `cancel()` from any thread; read
    the result after it ends."""

    def __init__(self, seq_id: int, num_prompt_tokens: int, cancel: Callable[[int], None]) -> None:
        self.seq_id = seq_id
        self.num_prompt_tokens = num_prompt_tokens
        # generated so far; the producer appends (with no lock where the reader decodes them)
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.num_cached_tokens = 0  # prompt tokens whose KV was already in the pool
        self.num_hit_tokens = 0  # of them, found by the prefix cache (not the owner's own KV)
        self.admitted = False  # reached the running batch (else its prompt was never computed)
        self._cancel = cancel
        # guards the fields below (not `token_ids`, which the producer appends to freely)
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._pending: list[str] = []  # deltas the reader has not taken yet
        # decodes `token_ids` on the reader's thread (None: the producer sends text): off the
        # engine thread, whose every microsecond a step is a GPU step waiting
        self._detok: TextDecoder | None = None
        self._read = 0  # `token_ids` decoded so far
        self._shown = -1  # with a stop token at the end: the ids before it (-1: all ids)
        # set (under the lock) by a reader about to wait, after it found nothing: a producer
        # that appended reads it after its append, so either it wakes the reader or the reader,
        # looking again after setting it, finds the token (each step is atomic under the GIL)
        self.reader_waiting = False
        self._end: _Finished | None = None
        self._waker: _LoopWaker | None = None  # an asyncio reader's loop's
        self._woken: asyncio.Event | None = None  # set (on that loop) when a batch is ready
        self._done = threading.Event()

    # -- producer side --------------------------------------------------------------------
    def _push(self, delta: str) -> None:
        if not delta:
            return
        with self._ready:
            self._pending.append(delta)
            if len(self._pending) > 1:
                return  # the reader was told when the batch began
            self._wake()

    def wake_reader(self) -> None:
        """After appending to `token_ids` and finding `reader_waiting` set: wake the reader
        (once a step for all the step's tokens, not once a token)."""
        with self._lock:
            if self.reader_waiting:
                self._wake()

    def _finish(
        self,
        reason: FinishReason,
        error: str | None = None,
        kind: type[CrowdchatError] = RequestFailed,
        last_token: int | None = None,
    ) -> None:
        """End the stream; an ERROR finish raises `kind(error)` to the reader (an upstream's
        400 is an InvalidRequest, an unreachable one EngineStopped, like the engine's own).
        `last_token`, the stop token that ended it, joins `token_ids` with no text."""
        with self._ready:
            if self._done.is_set():
                return
            if last_token is not None:
                self._shown = len(self.token_ids)
                self.token_ids.append(last_token)
            self.finish_reason, self.error = reason, error
            self._end = _Finished(reason, error, kind)
            self._done.set()
            self._wake()

    def _wake(self) -> None:
        """Under the lock: tell the reader (a waiting thread, or an asyncio loop)."""
        self.reader_waiting = False
        self._ready.notify()
        if self._waker is not None and self._woken is not None:
            self._waker.wake(self._woken)

    # -- reader side ----------------------------------------------------------------------
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

    def _take(self) -> str | None:
        """Under the lock: every pending delta joined, or None if there is none; at the end
        (nothing pending) raises the error finish or returns ''."""
        detok = self._detok
        if detok is not None:  # the tokens' text, decoded here on the reader's thread
            ids = self.token_ids
            end = len(ids) if self._shown < 0 else self._shown
            text = "".join([detok.push(t) for t in ids[self._read : end]])
            self._read = end
            if self._end is not None and self._end.reason is not FinishReason.ERROR:
                text += detok.flush()
                self._detok = None  # flushed once
            if text:
                self._pending.append(text)
        if self._pending:
            text = "".join(self._pending)
            self._pending.clear()
            self.text += text
            return text
        if self._end is None:
            return None
        if self._end.reason is FinishReason.ERROR:
            raise self._end.kind(self._end.error or "request failed")
        return ""

    def __iter__(self) -> Iterator[str]:
        """Yield text (each time everything that arrived since the last) until the request
        ends. Raises RequestFailed (or the finish's kind) on an error finish."""
        while True:
            with self._ready:
                text = self._take()
                while text is None:
                    self.reader_waiting = True  # then look once more (see `reader_waiting`)
                    text = self._take()
                    if text is None:
                        self._ready.wait()
                        text = self._take()
                self.reader_waiting = False
            if not text:
                return
            yield text

    async def next_batch(self) -> str:
        """Everything that arrived since the last call, joined (waits for at least one delta);
        '' once the request ended. Raises like iteration. Safe to cancel: nothing is lost."""
        while True:
            with self._ready:
                if self._waker is None:
                    self._waker, self._woken = (
                        _waker_of(asyncio.get_running_loop()),
                        asyncio.Event(),
                    )
                text = self._take()
                if text is None:
                    self._woken.clear()  # the next delta sets it (from the producer's thread)
                    self.reader_waiting = True  # then look once more (see `reader_waiting`)
                    text = self._take()
                    if text is not None:
                        self.reader_waiting = False
            if text is not None:
                return text
            await self._woken.wait()

    def result(self) -> str:
        """Consume the stream and return the whole reply text."""
        for _ in self:
            pass
        return self.text
