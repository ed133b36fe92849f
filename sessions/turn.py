"""One chat turn as the UI sees it: status, streamed deltas, and a durable ending."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from engine import CrowdchatError, RequestHandle, SamplingParams
from sessions.prompt import Message
from sessions.reply import stream

log = logging.getLogger(__name__)


@dataclass
class TurnPlan:
    """What a chat, regenerate or edit makes of the session and its history (as they are once
    claimed): the conversation to answer; what the turn writes before it starts (`commit`,
    returning the message the reply follows) or else the message the reply follows
    (`reply_parent`); and what it writes once the engine took it (`on_accept`)."""

    convo: list[Message]
    commit: Callable[[], int] | None = None
    reply_parent: int | None = None
    on_accept: Callable[[ChatTurn], None] | None = None


class ChatTurn:
    """Iterate for text deltas. `status` tells the UI what is happening: 'restoring' (KV
    coming back from disk), 'queued' (see `queue_position`), 'generating', then 'done'.

    Everything it needs comes in at construction: `restore()` brings the session's KV back
    and says from where, `submit(prompt, params)` starts the engine request, `on_accept(turn)`
    runs once the engine took it and before any delta streams (a regenerate or an edit
    replaces the old turn then, so a refused request leaves the conversation as it was), and
    `on_end(turn)` commits the reply (also a stopped or failed one) and frees the session.
    `accepted` says whether the request got that far. Errors surface as CrowdchatError from
    the iteration.
    """

    def __init__(
        self,
        sid: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        restore: Callable[[], str],
        submit: Callable[[list[int], SamplingParams], RequestHandle],
        queue_position: Callable[[RequestHandle], int | None],
        on_end: Callable[[ChatTurn], None],
        on_accept: Callable[[ChatTurn], None] | None = None,
    ) -> None:
        self.session_id = sid
        self.prompt = prompt
        self.params = params
        self.status = "restoring"
        self.restored_from: str | None = None  # resident / host / disk / cold
        self.handle: RequestHandle | None = None
        self.text = ""
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.accepted = False
        self.reply_parent: int | None = None  # the message the reply follows (set by the owner)
        self._restore = restore
        self._submit = submit
        self._queue_position = queue_position
        self._on_end = on_end
        self._on_accept = on_accept
        self._cancelled = False
        self._started = False

    @property
    def num_prompt_tokens(self) -> int:
        return self.handle.num_prompt_tokens if self.handle else 0

    @property
    def num_prefilled_tokens(self) -> int:
        """Prompt tokens the engine computed: all but the prefix served from resident KV
        (none when the request never left the queue)."""
        if self.handle is None or not self.handle.admitted:
            return 0
        return max(self.handle.num_prompt_tokens - self.handle.num_cached_tokens, 0)

    @property
    def num_generated_tokens(self) -> int:
        return self.handle.num_generated_tokens if self.handle else 0

    @property
    def num_hit_tokens(self) -> int:
        """Prompt tokens found in the prefix cache (not this session's own resident KV)."""
        return self.handle.num_hit_tokens if self.handle else 0

    def queue_position(self) -> int | None:
        """Requests ahead of this one while it waits; None otherwise."""
        if self.handle is None:
            return None
        return self._queue_position(self.handle)

    def cancel(self) -> None:
        """Stop generating; what was produced so far is kept."""
        self._cancelled = True
        if self.handle is not None:
            self.handle.cancel()

    def open(self) -> RequestHandle | None:
        """Restore the KV, submit, accept (blocks); None if cancelled before the submit."""
        assert not self._started, "a turn streams once"
        self._started = True
        self.restored_from = self._restore()
        if self._cancelled:
            self.finish_reason = "cancelled"
            return None
        self.status = "queued"
        self.handle = self._submit(self.prompt, self.params)
        if self._on_accept is not None:
            self._on_accept(self)
        self.accepted = True
        return self.handle

    def abandon(self) -> None:
        """End a turn its reader will never iterate (the page failed between starting it and
        streaming it): the session, its turn slot and reserved tokens are freed, and nothing
        is submitted or committed."""
        assert not self._started, "abandon a turn before it streams"
        self._started = self._cancelled = True
        self.close()

    def record(self, text: str) -> None:
        self.status = "generating"
        self.text += text

    def fail(self, error: CrowdchatError) -> None:
        self.error = str(error)
        self.finish_reason = "error"

    def close(self) -> None:
        """Commit the reply (also a stopped or failed one) and free the session."""
        if self.handle is not None and not self.handle.done:
            self.handle.cancel()  # the consumer went away mid-stream
            self.finish_reason = self.finish_reason or "cancelled"
        elif self._cancelled and self.finish_reason is None:
            # stopped while its reader was still reading: the engine (a fast upstream) may
            # have finished generating, but the user stopped a reply they saw unfinished
            self.finish_reason = "cancelled"
        elif self.handle is not None and self.finish_reason is None:
            self.finish_reason = str(self.handle.finish_reason)
        self.status = "done"
        try:
            self._on_end(self)
        except RuntimeError as e:  # the store closed under an abandoned stream
            log.warning("reply of session %s not saved: %s", self.session_id, e)

    def __iter__(self) -> Iterator[str]:
        return stream(self)

    def result(self) -> str:
        """Consume the whole turn and return the reply text."""
        for _ in self:
            pass
        return self.text
