"""The chat page: one independent, persistent conversation list per browser (or signed-in user),
streamed replies, Stop / Regenerate / Edit, and a status line that says what is happening.

Who is who: a signed-in user by Gradio's login; an anonymous browser by the signed, HttpOnly
`crowdchat_id` cookie that the Doors middleware minted (read here from `gr.Request`)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import gradio as gr

from doors.browser_id import COOKIE, BrowserIds
from engine import CrowdchatError
from sessions import SessionManager
from sessions.chat_settings import ChatSettings
from ui.reply_stream import ReplyStream, Screen, to_chatbot


class ChatPage(ReplyStream):
    """Builds the Blocks and holds the handlers (plain methods, so they are easy to test); a
    turn's reply streams onto the page through `ReplyStream._stream`."""

    def __init__(
        self,
        sessions: SessionManager,
        auth_enabled: bool = False,
        browser_ids: BrowserIds | None = None,
    ) -> None:
        self.sm = sessions
        self.auth_enabled = auth_enabled
        self.browser_ids = browser_ids or BrowserIds(secrets.token_hex(32), per_minute=1000)

    # -- identity and lists -------------------------------------------------------------
    def owner(self, request: gr.Request | None) -> str:
        if self.auth_enabled:
            if request is not None and request.username:
                return f"user:{request.username}"
            raise gr.Error("You are not signed in; reload the page and sign in.")
        cookies = getattr(request, "cookies", None) if request is not None else None
        browser_id = self.browser_ids.verify(cookies.get(COOKIE) if cookies else None)
        if browser_id is None:
            raise gr.Error("Your browser identity is missing; reload the page (with cookies on).")
        return f"browser:{browser_id}"

    def choices(self, owner: str) -> list[tuple[str, str]]:
        return [(s["title"] or "New chat", s["id"]) for s in self.sm.list_sessions(owner)]

    def on_load(self, screen: Screen, request: gr.Request):  # noqa: ANN201
        """Return the latest conversation, if any, and start restoring its KV in the
        background. Who the caller is comes from the signed cookie (or the sign-in) alone:
        no value the client sends names an owner (an older version moved the conversations of
        a localStorage id the client sent, which let anyone who knew an id take them)."""
        owner = self.owner(request)
        choices = self.choices(owner)
        sid = choices[0][1] if choices else None
        screen.sid = sid
        history, system = self.opened(owner, sid) if sid else ([], "")
        return gr.update(choices=choices, value=sid), sid, history, system

    def on_select(self, sid: str | None, screen: Screen, request: gr.Request):  # noqa: ANN201
        """Outputs: sid, chatbot, status, system prompt box, the list's selection. A reply
        still streaming in the conversation comes back on screen at its next delta (see
        _stream). The list is set to what is shown: a reply that ended in the conversation
        the user just left selects that one in the list as it ends, and its answer can reach
        the browser after the click; a list left on it would then not let the user click
        back to it (a click on the selected item changes nothing)."""
        owner = self.owner(request)
        if not sid:
            screen.sid = None
            return None, [], "", "", gr.update(value=None)
        try:
            history, system = self.opened(owner, sid)
        except CrowdchatError as e:
            screen.sid = None
            return None, [], f"Error: {e}", "", gr.update(value=None)
        # from here a reply streaming elsewhere stops painting, and repaints this conversation
        # once in case its last delta reaches the browser after this (see _stream)
        screen.sid = sid
        return sid, history, "", system, gr.update(value=sid)

    def on_new(self, screen: Screen):  # noqa: ANN201
        """A new conversation starts with an empty system prompt, not the last one's."""
        screen.sid = None
        return None, [], "", gr.update(value=None), ""

    def opened(self, owner: str, sid: str) -> tuple[list[dict], str]:
        """The conversation's messages and its own system prompt, which the settings box
        shows (every Send saves the box: an empty box would erase the stored prompt); its
        KV starts coming back while the user reads."""
        system = self.sm.get_session(owner, sid)["system_prompt"]
        history = to_chatbot(self.sm.messages(owner, sid))
        self.sm.prefetch(owner, sid)
        return history, system

    def on_rename(self, sid: str | None, title: str, request: gr.Request):  # noqa: ANN201
        owner = self.owner(request)
        if sid and title.strip():
            try:
                self.sm.rename_session(owner, sid, title.strip())
            except CrowdchatError as e:
                raise gr.Error(str(e)) from e
        return gr.update(choices=self.choices(owner), value=sid), ""

    def on_delete(self, sid: str | None, screen: Screen, request: gr.Request):  # noqa: ANN201
        owner = self.owner(request)
        screen.sid = None
        if sid:
            try:
                self.sm.delete_session(owner, sid)
            except CrowdchatError as e:
                raise gr.Error(str(e)) from e
        return None, [], gr.update(choices=self.choices(owner), value=None), ""

    def on_stop(self, sid: str | None, request: gr.Request) -> None:
        if sid:
            try:
                self.sm.stop(self.owner(request), sid)
            except CrowdchatError:
                pass

    def on_edit(self, sid: str | None, request: gr.Request):  # noqa: ANN201
        """Put the last user message back in the box; the next send replaces it."""
        if not sid:
            return gr.update(), False, ""
        msgs = [m for m in self.sm.messages(self.owner(request), sid) if m["role"] == "user"]
        if not msgs:
            return gr.update(), False, ""
        return msgs[-1]["content"], True, "Editing your last message: change it and press Send."

    # -- turns --------------------------------------------------------------------------
    def settings(
        self, temperature: float, top_p: float, max_tokens: float, repetition: float = 1.0
    ) -> ChatSettings:
        """The settings sliders' values (InvalidRequest for values out of range)."""
        return ChatSettings(
            temperature=temperature,
            top_p=top_p,
            max_tokens=max_tokens,
            repetition_penalty=repetition,
        )

    def on_send(
        self,
        message: str,
        sid: str | None,
        editing: bool,
        system_prompt: str,
        temperature: float,
        top_p: float,
        max_tokens: float,
        repetition: float,
        screen: Screen,
        request: gr.Request,
    ) -> Iterator[tuple]:
        """Outputs: chatbot, status, textbox, sid, conversation list, editing."""
        owner = self.owner(request)
        try:
            settings = self.settings(temperature, top_p, max_tokens, repetition)
            params = settings.params()
            if not sid:
                if not (message or "").strip():
                    raise CrowdchatError("Please type a message first.")
                sid = self.sm.create_session(owner, "", system_prompt or "", settings)["id"]
            else:  # the box and the sliders are the conversation's: kept with it
                self.sm.set_system_prompt(owner, sid, system_prompt or "")
                self.sm.set_settings(owner, sid, settings)
            if editing:
                turn = self.sm.edit_last(owner, sid, message, params)
            else:
                turn = self.sm.chat(owner, sid, message, params)
        except CrowdchatError as e:  # the message stays in the box: nothing is lost
            history = to_chatbot(self.sm.messages(owner, sid)) if sid else []
            yield history, f"Error: {e}", gr.update(), sid, gr.update(), editing
            return
        try:  # the turn holds the session, a turn slot and tokens until it is iterated
            shown = to_chatbot(self.sm.messages(owner, sid))
        except BaseException as e:
            turn.abandon()
            if not isinstance(e, CrowdchatError):
                raise
            yield [], f"Error: {e}", gr.update(), None, gr.update(), editing
            return
        if editing:  # the edit is written once the engine takes it
            while shown and shown.pop()["role"] != "user":
                pass  # the edited message and its replies give way on screen
            shown.append({"role": "user", "content": message})
        typed = (message, editing) if editing else None
        yield from self._stream(owner, sid, turn, screen, shown, clear_box=True, typed=typed)

    def on_regenerate(
        self,
        sid: str | None,
        temperature: float,
        top_p: float,
        max_tokens: float,
        repetition: float,
        screen: Screen,
        request: gr.Request,
    ) -> Iterator[tuple]:
        owner = self.owner(request)
        if not sid:
            yield [], "", gr.update(), sid, gr.update(), False
            return
        try:
            shown = to_chatbot(self.sm.messages(owner, sid))
            settings = self.settings(temperature, top_p, max_tokens, repetition)
            self.sm.set_settings(owner, sid, settings)
            turn = self.sm.regenerate(owner, sid, settings.params())
            if shown and shown[-1]["role"] == "assistant":
                shown.pop()  # the new reply streams in its place; the old one stays a branch
        except CrowdchatError as e:
            yield (
                to_chatbot(self.sm.messages(owner, sid)),
                f"Error: {e}",
                gr.update(),
                sid,
                gr.update(),
                False,
            )
            return
        yield from self._stream(owner, sid, turn, screen, shown, clear_box=False)
