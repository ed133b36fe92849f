"""Turns that branch a conversation: regenerate and edit keep what they replace as a sibling
branch, and switching picks which branch the conversation shows and continues. A part of
`SessionManager` (it uses the manager's store, prompts, admission and `_start`)."""

from __future__ import annotations

import functools
import time

from engine import InvalidRequest, SamplingParams
from sessions.branches import siblings
from sessions.prompt import clean_text, conversation, user_says
from sessions.state import SessionState
from sessions.turn import ChatTurn, TurnPlan


class BranchTurns:
    """Regenerate, edit and switch branch (mixed into `SessionManager`)."""

    def regenerate(
        self, owner: str, sid: str, params: SamplingParams, message_id: int | None = None
    ) -> ChatTurn:
        """Answer the last message of the active path again, or, with `message_id`, the
        message that reply of the active path answered (what comes after it stays on its
        branch). The new reply becomes a sibling branch of the old one, which stays
        (`switch_branch` shows it again)."""
        self.get_session(owner, sid)

        def plan(session: dict, history: list[dict]) -> TurnPlan:
            if message_id is not None:
                at = next((i for i, m in enumerate(history) if m["id"] == message_id), None)
                if at is None or history[at]["role"] != "assistant":
                    raise InvalidRequest("only a reply in the conversation shown can be redone")
                del history[at:]
            elif history and history[-1]["role"] == "assistant":
                history.pop()
            if not history or history[-1]["role"] != "user":
                raise InvalidRequest("there is no message to answer again")
            return TurnPlan(
                conversation(session, history, self.default_system),
                on_accept=self._mark_active,
                reply_parent=history[-1]["id"],
            )

        return self._turn(owner, sid, params, plan)

    def edit(
        self, owner: str, sid: str, message_id: int, text: str, params: SamplingParams
    ) -> ChatTurn:
        """Answer an edited version of one of the user's messages on the active path. The
        edit is a sibling branch of the original (which stays, with everything after it),
        written once the engine accepted the new request."""
        self.get_session(owner, sid)
        text = clean_text(text, self.config.max_message_chars)

        def plan(session: dict, history: list[dict]) -> TurnPlan:
            at = next((i for i, m in enumerate(history) if m["id"] == message_id), None)
            if at is None or history[at]["role"] != "user":
                raise InvalidRequest(
                    "only your own messages in the conversation shown can be edited"
                )
            return TurnPlan(
                [*conversation(session, history[:at], self.default_system), user_says(text)],
                on_accept=functools.partial(
                    self._add_edit, parent=history[at]["parent_id"], text=text
                ),
            )

        return self._turn(owner, sid, params, plan)

    def edit_last(self, owner: str, sid: str, text: str, params: SamplingParams) -> ChatTurn:
        """`edit` the last user message of the active path."""
        users = [m for m in self.messages(owner, sid) if m["role"] == "user"]
        if not users:
            raise InvalidRequest("there is no message to edit")
        return self.edit(owner, sid, users[-1]["id"], text, params)

    def switch_branch(self, owner: str, sid: str, message_id: int, step: int) -> int:
        """Show the sibling `step` places from `message_id` (clamped to the first and last
        branch) and return its id: the active path, the next turn and the API's view then
        follow it. SessionBusy while the conversation answers; nothing is deleted."""
        self.get_session(owner, sid)
        with self._claimed(sid):
            try:
                group = siblings(self.store.message_tree(sid), message_id)
                if not group:
                    raise InvalidRequest("no such message in this conversation")
                at = next(i for i, m in enumerate(group) if m["id"] == message_id)
                target = group[max(0, min(len(group) - 1, at + step))]["id"]
                self.store.select_message(sid, target, {"last_active": time.time()})
            finally:
                self._release(sid)
        return target

    def show_message(self, owner: str, sid: str, message_id: int) -> None:
        """Make the active path run through `message_id` (a search hit on another branch):
        each of its ancestors becomes the selected branch of its group. SessionBusy while the
        conversation answers; nothing is deleted."""
        self.get_session(owner, sid)
        with self._claimed(sid):
            try:
                rows = {m["id"]: m for m in self.store.message_tree(sid)}
                if message_id not in rows:
                    raise InvalidRequest("no such message in this conversation")
                at: int | None = message_id
                while at is not None:
                    if not rows[at]["selected"]:
                        self.store.select_message(sid, at, {"last_active": time.time()})
                    at = rows[at]["parent_id"]
            finally:
                self._release(sid)

    def _mark_active(self, turn: ChatTurn) -> None:
        """The engine took a regenerate: the session answers (the old reply stays)."""
        self.store.update_session(
            turn.session_id, state=SessionState.ACTIVE, last_active=time.time()
        )

    def _add_edit(self, turn: ChatTurn, parent: int | None, text: str) -> None:
        """The engine took an edit: the new message is written as a sibling branch of the
        old one (now the active path) before the reply streams; the reply follows it."""
        turn.reply_parent = self.store.add_message(
            turn.session_id,
            "user",
            text,
            parent_id=parent,
            session_fields={"state": SessionState.ACTIVE, "last_active": time.time()},
        )
