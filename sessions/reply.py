"""What every reply looks like to its reader (the chat page, the API): a session's ChatTurn
and a one-off request alike."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

from engine import CrowdchatError, RequestHandle


@runtime_checkable
class Reply(Protocol):
    """Iterate for text deltas (errors surface as CrowdchatError); `cancel()` from any thread;
    read the outcome once the iteration ended.

    Iteration is `stream(reply)`: `open()` (blocking: a session's KV restore, the submit),
    the handle's deltas each handed to `record`, an error to `fail`, then `close()` (blocking:
    the commit), exactly once. An asyncio reader (sessions.relay.AsyncRelay) runs the same
    steps, the blocking ones on a worker thread and the deltas on its loop."""

    @property
    def finish_reason(self) -> str | None: ...  # stop / length / cancelled / error

    @property
    def error(self) -> str | None: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_generated_tokens(self) -> int: ...

    @property
    def restored_from(self) -> str | None:
        """Where a session's KV came from (resident / host / disk / cold); None for a
        one-off request, which has no session."""

    @property
    def num_hit_tokens(self) -> int:
        """Prompt tokens whose KV the prefix cache held (shared blocks, not the session's own
        resident KV)."""

    def queue_position(self) -> int | None:
        """Requests ahead of this one while it waits; None otherwise."""

    def cancel(self) -> None: ...

    def open(self) -> RequestHandle | None:
        """Start the reply (blocks): the engine's handle, or None if cancelled before that."""

    def record(self, text: str) -> None:
        """Text the reader took (on the reader's thread or loop)."""

    def fail(self, error: CrowdchatError) -> None:
        """The reply failed with `error` (before `close`)."""

    def close(self) -> None:
        """End the reply (blocks): cancel an unfinished handle, commit; once, after `open`."""

    def __iter__(self) -> Iterator[str]: ...


def stream(reply: Reply) -> Iterator[str]:
    """A reply's deltas for a reader on a thread: open, each batch of text, fail, close."""
    try:
        handle = reply.open()
        if handle is None:
            return
        for text in handle:
            reply.record(text)
            yield text
    except CrowdchatError as e:
        reply.fail(e)
        raise
    finally:
        reply.close()


def kv_source(reply: Reply) -> str | None:
    """Where the reply's prompt KV came from, for the X-Crowdchat-KV header: the session's own
    (resident / host / disk), `cached` when it started from shared prefix-cache blocks
    instead of a recompute, `cold` when it was all computed; None for a one-off request that
    found nothing cached."""
    if reply.restored_from in (None, "cold") and reply.num_hit_tokens > 0:
        return "cached"
    return reply.restored_from


class OneOffReply:
    """A one-off request's engine handle, seen as a Reply. `on_end(reply)` runs once, when
    the iteration ends (also when it fails or its reader leaves)."""

    restored_from: str | None = None

    def __init__(
        self,
        handle: RequestHandle,
        queue_position: Callable[[RequestHandle], int | None],
        on_end: Callable[[OneOffReply], None] | None = None,
    ) -> None:
        self.handle = handle
        self._queue_position = queue_position
        self._on_end = on_end

    @property
    def finish_reason(self) -> str | None:
        return self.handle.finish_reason

    @property
    def error(self) -> str | None:
        return self.handle.error

    @property
    def num_prompt_tokens(self) -> int:
        return self.handle.num_prompt_tokens

    @property
    def num_generated_tokens(self) -> int:
        return self.handle.num_generated_tokens

    @property
    def num_hit_tokens(self) -> int:
        return self.handle.num_hit_tokens

    def queue_position(self) -> int | None:
        return self._queue_position(self.handle)

    def cancel(self) -> None:
        self.handle.cancel()

    def open(self) -> RequestHandle:
        return self.handle  # submitted already

    def record(self, text: str) -> None:
        pass  # the handle keeps its text

    def fail(self, error: CrowdchatError) -> None:
        pass  # the handle keeps its error

    def close(self) -> None:
        if not self.handle.done:
            self.handle.cancel()  # the reader went away mid-stream
        if self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            on_end(self)

    def __iter__(self) -> Iterator[str]:
        return stream(self)
