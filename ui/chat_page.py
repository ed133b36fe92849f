"""The chat page's handlers: one independent, persistent conversation list per browser (or
signed-in user), streamed replies, edit and regenerate at any message, Stop.

Who is who: a signed-in user by Gradio's login; an anonymous browser by the signed, HttpOnly
`crowdchat_id` cookie that the Doors middleware minted (read here from `gr.Request`). The
components of ui/ (sidebar, conversation list, message actions, composer, settings dialog)
build their blocks and call these plain methods, which are easy to test."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator

import gradio as gr

from doors.browser_id import COOKIE, BrowserIds
from engine import CrowdchatError
from sessions import SessionManager
from sessions.chat_settings import ChatSettings
from ui.message_meta import StatsMemory, meta_of
from ui.reply_stream import PAGE, ReplyStream, Screen, Streaming, buttons, to_chatbot

__all__ = ["PAGE", "ChatPage", "Screen", "to_chatbot"]


class ChatPage(ReplyStream):
    """The handlers every component of the page shares; a turn's reply streams onto the page
    through `ReplyStream._stream`."""

    def __init__(
        self,
        sessions: SessionManager,
        auth_enabled: bool = False,
        browser_ids: BrowserIds | None = None,
    ) -> None:
        self.sm = sessions
        self.auth_enabled = auth_enabled
        self.browser_ids = browser_ids or BrowserIds(secrets.token_hex(32), per_minute=1000)
        self.reply_stats = StatsMemory()
        self.streaming = Streaming()

    # -- identity and the list ----------------------------------------------------------
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

    def listing(self, owner: str, sid: str | None, screen: Screen) -> dict:
        """The conversation list's value: the first `screen.shown` conversations, most
        recently active first, each with its last activity (the browser groups them by its
        own calendar: Today, Yesterday...), which one is open, and whether more follow."""
        rows = self.sm.list_sessions(owner)
        items = [{"id": r["id"], "title": r["title"], "t": r["last_active"]} for r in rows]
        return {"items": items[: screen.shown], "open": sid, "more": len(rows) > screen.shown}

    # -- what the page shows ------------------------------------------------------------
    def show(self, owner: str, sid: str | None, screen: Screen, status: str = "") -> tuple:
        """The page with conversation `sid` (None: a new one) on screen. Outputs: sid,
        chatbot, status, system prompt, list, Send, Stop, editing, the messages' meta."""
        screen.sid = sid
        path, system = self.opened(owner, sid) if sid else ([], "")
        busy = sid is not None and self.sm.answering(sid)
        listing = self.listing(owner, sid, screen)
        meta = meta_of(path, self.reply_stats)
        return (sid, to_chatbot(path), status, system, listing, *buttons(busy), None, meta)

    def opened(self, owner: str, sid: str) -> tuple[list[dict], str]:
        """The conversation's stored messages and its own system prompt, which the settings
        show (every Send saves them: an empty box would erase the stored prompt); its KV
        starts coming back while the user reads."""
        system = self.sm.get_session(owner, sid)["system_prompt"]
        path = self.sm.messages(owner, sid)
        self.sm.prefetch(owner, sid)
        return path, system

    def on_load(self, screen: Screen, request: gr.Request) -> tuple:
        """The latest conversation, if any (its KV starts coming back). Who the caller is
        comes from the signed cookie (or the sign-in) alone: no value the client sends names
        an owner (an older version moved the conversations of a localStorage id the client
        sent, which let anyone who knew an id take them)."""
        owner = self.owner(request)
        rows = self.sm.list_sessions(owner)
        return self.show(owner, rows[0]["id"] if rows else None, screen)

    def on_select(self, sid: str | None, screen: Screen, request: gr.Request) -> tuple:
        """Open `sid` (None or gone: a new chat, saying why). A reply still streaming in it
        comes back on screen at its next delta (see _stream)."""
        owner = self.owner(request)
        if not sid:
            return self.show(owner, None, screen)
        try:
            self.sm.get_session(owner, sid)
        except CrowdchatError as e:
            return self.show(owner, None, screen, f"Error: {e}")
        return self.show(owner, sid, screen)

    def on_new(self, screen: Screen, request: gr.Request) -> tuple:
        """A new conversation starts with an empty system prompt, not the last one's."""
        return self.show(self.owner(request), None, screen)

    def on_rename(self, sid: str, title: str, screen: Screen, request: gr.Request) -> tuple:
        """Outputs: the list, the status line."""
        owner = self.owner(request)
        status = ""
        if title.strip():
            try:
                self.sm.rename_session(owner, sid, title.strip())
            except CrowdchatError as e:
                status = f"Error: {e}"
        return self.listing(owner, screen.sid, screen), status

    def on_delete(self, sid: str, screen: Screen, request: gr.Request) -> tuple:
        """Delete `sid` for good (its messages, branches, KV and share links). If it was on
        screen, the page shows a new chat; else what it showed stays. Outputs as `show`."""
        owner = self.owner(request)
        status = ""
        try:
            self.sm.delete_session(owner, sid)
        except CrowdchatError as e:
            status = f"Error: {e}"
        if screen.sid == sid:
            return self.show(owner, None, screen, status)
        listing = self.listing(owner, screen.sid, screen)
        return (gr.skip(), gr.skip(), status, gr.skip(), listing, *(gr.skip(),) * 4)

    def on_clear(self, screen: Screen, request: gr.Request) -> tuple:
        """Gradio's own clear of the chat: the conversation on screen is deleted for real,
        never just hidden (a hidden one came back, and its next reply was answered with the
        hidden history). Outputs as `show`."""
        if screen.sid:
            return self.on_delete(screen.sid, screen, request)
        return self.show(self.owner(request), None, screen)

    def on_stop(self, sid: str | None, request: gr.Request) -> None:
        if sid:
            try:
                self.sm.stop(self.owner(request), sid)
            except CrowdchatError:
                pass

    # -- turns --------------------------------------------------------------------------
    def refused(
        self,
        owner: str,
        sid: str | None,
        error: CrowdchatError,
        screen: Screen,
        typed: tuple[str, int | None] | None = None,
    ) -> tuple:
        """A turn that could not start: the conversation as stored and the reason; `typed`
        (the text sent, the message it edits) goes back into the box: nothing is lost.
        Outputs as _stream's."""
        try:
            history = to_chatbot(self.sm.messages(owner, sid)) if sid else []
        except CrowdchatError:
            history, sid = [], None
        screen.back = typed
        skip = gr.skip()
        return (history, f"Error: {error}", sid, skip, *buttons(False), skip)

    def on_given_back(self, screen: Screen) -> tuple:
        """After a turn: the text of one the engine never took back into the message box (the
        browser emptied it as it sent), and the message it edits. Outputs: box, editing."""
        back, screen.back = screen.back, None
        return (back[0], back[1]) if back is not None else (gr.skip(), None)

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
        editing: int | None,
        system_prompt: str,
        temperature: float,
        top_p: float,
        max_tokens: float,
        repetition: float,
        screen: Screen,
        request: gr.Request,
    ) -> Iterator[tuple]:
        """Outputs as _stream's. `editing`: the id of a message whose edit the engine
        refused; Send then tries that edit again."""
        started = time.monotonic()
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
            if editing is not None:
                turn = self.sm.edit(owner, sid, editing, message, params)
            else:
                turn = self.sm.chat(owner, sid, message, params)
        except CrowdchatError as e:  # the message stays in the box: nothing is lost
            yield self.refused(owner, sid, e, screen, (message, editing))
            return
        try:  # the turn holds the session, a turn slot and tokens until it is iterated
            path = self.sm.messages(owner, sid)
        except BaseException as e:
            turn.abandon()
            if not isinstance(e, CrowdchatError):
                raise
            yield self.refused(owner, None, e, screen, (message, editing))
            return
        shown = to_chatbot(path)
        if editing is not None:  # the edit is written once the engine takes it
            at = next((i for i, m in enumerate(path) if m["id"] == editing), len(path))
            shown[at:] = [{"role": "user", "content": message}]
        typed = (message, editing) if editing is not None else None
        kept = path[: len(shown) - 1]
        yield from self._stream(owner, sid, turn, screen, shown, typed, started, kept)

    def on_edit(
        self,
        index: int,
        text: str,
        sid: str | None,
        temperature: float,
        top_p: float,
        max_tokens: float,
        repetition: float,
        screen: Screen,
        request: gr.Request,
    ) -> Iterator[tuple]:
        """The user edited their message at `index` of the chat in place: it is answered as
        a new branch beside the original (‹ n/m › on the message switches back). Outputs as
        _stream's."""
        started = time.monotonic()
        owner = self.owner(request)
        try:
            if not sid:
                raise CrowdchatError("there is no message to edit")
            path = self.sm.messages(owner, sid)
            if not (0 <= index < len(path)) or path[index]["role"] != "user":
                raise CrowdchatError("only your own messages can be edited")
            settings = self.settings(temperature, top_p, max_tokens, repetition)
            self.sm.set_settings(owner, sid, settings)
            turn = self.sm.edit(owner, sid, path[index]["id"], text, settings.params())
        except CrowdchatError as e:
            yield self.refused(owner, sid, e, screen)
            return
        shown = to_chatbot(path[:index]) + [{"role": "user", "content": text}]
        typed = (text, path[index]["id"])
        kept = path[:index]
        yield from self._stream(owner, sid, turn, screen, shown, typed, started, kept)

    def on_regenerate(
        self,
        index: int | None,
        sid: str | None,
        temperature: float,
        top_p: float,
        max_tokens: float,
        repetition: float,
        screen: Screen,
        request: gr.Request,
    ) -> Iterator[tuple]:
        """Answer again the reply at `index` of the chat (None: the last one); the old reply
        stays as a branch beside the new one. Outputs as on_send's."""
        started = time.monotonic()
        owner = self.owner(request)
        try:
            if not sid:
                raise CrowdchatError("there is no reply to regenerate yet")
            path = self.sm.messages(owner, sid)
            if index is None:
                index = len(path) - 1 if path and path[-1]["role"] == "assistant" else len(path)
            elif not (0 <= index < len(path)) or path[index]["role"] != "assistant":
                raise CrowdchatError("only a reply can be regenerated")
            settings = self.settings(temperature, top_p, max_tokens, repetition)
            self.sm.set_settings(owner, sid, settings)
            reply = path[index]["id"] if index < len(path) else None
            turn = self.sm.regenerate(owner, sid, settings.params(), message_id=reply)
        except CrowdchatError as e:
            yield self.refused(owner, sid, e, screen)
            return
        shown = to_chatbot(path[:index])  # the new reply streams in the old one's place
        kept = path[:index]
        yield from self._stream(owner, sid, turn, screen, shown, None, started, kept)
