"""Every turn's life in a session: claim the session, set the turn up, start it, commit its
end. A part of `SessionManager` (sessions.manager), which sets the attributes declared here;
chat, regenerate and edit all start through `_turn`."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from sqlite_utils.db import NotFoundError

from engine import Backend, SamplingParams
from sessions.admission import Admission, Ticket, cost, prompt_to_compute
from sessions.errors import SessionBusy, SessionNotFound
from sessions.offload import KVOffloader
from sessions.prompt import PromptEncoder
from sessions.quota import StorageQuota
from sessions.reply import OneOffReply
from sessions.residency import Residency
from sessions.state import SessionState
from sessions.store import Store
from sessions.turn import ChatTurn, TurnPlan

log = logging.getLogger("sessions.manager")


class TurnLife:
    """Claim, start and end of a session's turns (mixed into `SessionManager`)."""

    engine: Backend
    store: Store
    prompts: PromptEncoder
    admission: Admission
    residency: Residency
    offload: KVOffloader
    _active: dict[str, ChatTurn | None]  # session id -> its running turn
    _active_lock: threading.Lock
    _one_offs: dict[str, set]  # owner -> the engine handles of their one-off requests
    quota: StorageQuota

    @contextmanager
    def _claimed(self, sid: str) -> Iterator[dict]:
        """Mark the session as answering for the block (SessionBusy if it already is) and
        give it the session row as it is now: read after the claim, like the history, so a
        turn that just ended has committed everything the block reads. If the block raises,
        the session is free again; otherwise the turn the block started holds it until the
        turn ends."""
        with self._active_lock:
            if sid in self._active:
                raise SessionBusy("this conversation is still answering; wait or press Stop")
            self._active[sid] = None
        try:
            session = self.store.get_session(sid)
            if session is None:  # deleted since the owner check
                raise SessionNotFound("no such conversation")
            yield session
        except BaseException:
            self._release(sid)
            raise

    def _release(self, sid: str) -> None:
        with self._active_lock:
            self._active.pop(sid, None)

    def _begin_restore(self, sid: str, session: dict) -> Callable[[], str]:
        """Start bringing a claimed session's KV back for its turn; the turn waits for it."""
        return self.residency.begin_restore(sid, had_kv=session["token_count"] > 0)

    def _turn(
        self,
        owner: str,
        sid: str,
        params: SamplingParams,
        plan: Callable[[dict, list[dict]], TurnPlan],
        end_user: str | None = None,
    ) -> ChatTurn:
        """The one setup of every turn (chat, regenerate, edit): claim the session, hold a turn
        slot, start its KV restore, plan the turn from the session and its history as they
        are now, encode, reserve its tokens, write what it commits up front, start it."""
        params = self.admission.clamp(params)
        self.quota.check(owner, 0, "a new message")  # its reply may end a little past it
        with (
            self._claimed(sid) as session,
            self.admission.holding(owner, turn=True, end_user=end_user) as ticket,
        ):
            restore = self._begin_restore(sid, session)
            turn = plan(session, self.store.messages(sid))
            prompt = self.prompts.encode_fitting(turn.convo, params)
            self.admission.reserve(ticket, prompt_to_compute(session, prompt), params)
            reply_parent = turn.commit() if turn.commit else turn.reply_parent
            return self._start(
                sid,
                prompt,
                params,
                session,
                ticket,
                restore=restore,
                on_accept=turn.on_accept,
                reply_parent=reply_parent,
            )

    def _start(
        self,
        sid: str,
        prompt: list[int],
        params: SamplingParams,
        session: dict,
        ticket: Ticket,
        *,
        restore: Callable[[], str],
        on_accept: Callable[[ChatTurn], None] | None = None,
        reply_parent: int | None = None,
    ) -> ChatTurn:
        turn = ChatTurn(
            sid,
            prompt,
            params,
            restore=restore,
            # the KV belongs to the session; the fair share and the prefix cache to its user
            submit=functools.partial(
                self.engine.submit,
                owner=sid,
                retain=True,
                user=session["owner"],
                cache_ns=session["owner"],
                shareable_prefix=self.prompts.shareable(prompt),
            ),
            queue_position=self.engine.queue_position,
            on_end=functools.partial(
                self._end_turn, ticket=ticket, restore=restore, before=session["state"]
            ),
            on_accept=on_accept,
        )
        turn.reply_parent = reply_parent
        self._active[sid] = turn
        return turn

    def _end_one_off(self, reply: OneOffReply, ticket: Ticket) -> None:
        with self._active_lock:
            running = self._one_offs.get(ticket.owner, set())
            running.discard(reply.handle)
            if not running:
                self._one_offs.pop(ticket.owner, None)
        self.admission.end(ticket, cost(reply.handle))

    def stop_owner(self, owner: str) -> None:
        """Stop every reply of `owner` now: their conversations' and their one-off requests'
        (a disabled user's)."""
        with self._active_lock:
            one_offs = list(self._one_offs.get(owner, ()))
        for handle in one_offs:
            handle.cancel()
        for row in self.store.list_sessions(owner):
            turn = self._active.get(row["id"])
            if turn is not None:
                turn.cancel()

    def _end_turn(
        self, turn: ChatTurn, ticket: Ticket, restore: Callable[[], str], before: str
    ) -> None:
        """Commit the reply (also a partial or failed one) and the session's new state, then
        free the session for its next turn. A turn the engine never took leaves the
        conversation as it was, and its state where the turn's restore left the KV (`before`,
        the state it had, when the backend keeps KV itself). The owner's reservation is settled
        to what the turn cost the server: the prompt tokens it computed (a dropped history's
        recompute too) and the reply; what it did not generate comes back."""
        sid = turn.session_id
        self.admission.end(ticket, cost(turn.handle))
        try:
            if not turn.accepted:
                # a cold restore left no KV, a disk one left it resident: the admin page,
                # prefetch and the next reservation read which (an abandoned turn's may still run)
                with contextlib.suppress(Exception):  # its error already failed the turn
                    restore()
                self.residency.record_where(
                    sid,
                    lambda state: self.store.update_session(
                        sid, state=state, last_active=time.time()
                    ),
                    before,
                )
                return
            generated = turn.num_generated_tokens
            update = {
                "state": SessionState.RESIDENT,
                "token_count": len(turn.prompt) + generated,
                "last_active": time.time(),
                "fingerprint": self.offload.fingerprint,
            }
            if turn.text or turn.finish_reason != "error":
                self.store.add_message(
                    sid,
                    "assistant",
                    turn.text,
                    token_count=generated,
                    finish_reason=turn.finish_reason,
                    session_fields=update,
                    parent_id=turn.reply_parent,
                )
            else:
                self.store.update_session(sid, **update)
        except NotFoundError:  # the conversation was deleted while it answered
            log.info("session %s was deleted during its turn; its reply is dropped", sid)
        finally:
            self._release(sid)
