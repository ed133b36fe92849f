"""A turn's reply on the chat page: streamed as it grows, the status line while it waits (and
empty once it streams), Send turned into Stop while it runs, the page repainted right when the
user opens another conversation meanwhile, the typed text given back when the engine never took
the turn, and the reply's speed kept for the line under it. A part of `ChatPage`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import gradio as gr

from engine import CrowdchatError
from sessions import ChatTurn, SessionManager
from sessions.relay import Delta, End, Failed, RelayThread
from ui.message_meta import ReplyStats, StatsMemory, meta_of
from ui.status_line import turn_status

log = logging.getLogger("ui.chat_page")
POLL_S = 0.4
PAGE = 100  # conversations the list holds before the user scrolls for more


def to_chatbot(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@dataclass
class Screen:
    """What one browser tab shows. Mutable on purpose: Gradio hands a State's own object to
    every handler of that tab, so a reply still streaming sees the user open another
    conversation and stops painting over it."""

    sid: str | None = None
    shown: int = PAGE  # conversations loaded into the list (more as the user scrolls)


def buttons(busy: bool) -> tuple[dict, dict]:
    """Send and Stop: Stop stands in Send's place while the conversation shown answers."""
    return gr.update(visible=not busy), gr.update(visible=busy)


class ReplyStream:
    """`_stream` of the chat page (mixed into `ChatPage`)."""

    sm: SessionManager
    reply_stats: StatsMemory
    listing: Callable[[str, str | None, Screen], dict]

    def _stream(
        self,
        owner: str,
        sid: str,
        turn: ChatTurn,
        screen: Screen,
        history: list[dict],
        clear_box: bool,
        typed: tuple[str, int | None] | None = None,
        started: float | None = None,
        kept: list[dict] | None = None,
    ) -> Iterator[tuple]:
        """Run the turn on a thread; yield the growing reply, and the status while waiting.
        Outputs: chatbot, status, box, sid, list, editing, Send, Stop, the messages'
        meta. Only while `sid` is
        on screen: after the user opened another conversation the turn runs on (and is
        committed) but every yield changes nothing, not even the tab's sid, until they come
        back. Yielding still lets Gradio close us when the tab goes away. `typed`: (text,
        id of the message it edits) of an edit, written only once the engine takes the turn:
        if it never does (queue full, engine stopped, Stop first), the text goes back into
        the box beside the reason, and Send tries the edit again. `started`: when the user
        sent it (monotonic), for the time to the first token. `kept`: the stored messages
        that stay on screen above the new ones (their ‹ n/m › and stats stay while the reply
        streams)."""
        started = time.monotonic() if started is None else started
        screen.sid = sid
        history.append({"role": "assistant", "content": ""})
        box = "" if clear_box else gr.update()
        events = RelayThread(turn, "crowdchat-page-reply")
        on_screen = [True]
        keys_shown: list[bool] = []  # what Send/Stop show now, once painted
        first: list[float] = []

        def paint(
            status: str,
            box: object = None,
            convos: object = None,
            editing: int | None = None,
            busy: bool = True,
            meta: object = None,
        ) -> tuple:
            if screen.sid != sid:
                if not on_screen[0]:
                    return (gr.skip(),) * 9
                # the user just opened another conversation (or a new one): a delta painted
                # before that can reach the browser after the page showed it, over it. Once,
                # paint what is on screen now: this generator's yields arrive in order. (Send
                # and Stop are the opening event's to set.)
                on_screen[0] = False
                keys_shown[:] = []
                now = screen.sid
                try:
                    shown = to_chatbot(self.sm.messages(owner, now)) if now else []
                except CrowdchatError:  # deleted meanwhile: the page's own event shows that
                    return (gr.skip(),) * 9
                return (shown, gr.skip(), gr.skip(), now, *(gr.skip(),) * 5)
            on_screen[0] = True
            keys: tuple = (gr.skip(), gr.skip())
            if keys_shown != [busy]:  # first paint, back on screen, or the reply ended
                keys_shown[:] = [busy]
                keys = buttons(busy)
            return (
                history,
                status,
                gr.skip() if box is None else box,
                sid,
                gr.skip() if convos is None else convos,
                editing,
                *keys,
                gr.skip() if meta is None else meta,
            )

        def status_now() -> str:
            return turn_status(turn, self.sm.engine)

        def given_back(status: str) -> tuple:
            """The page after a turn the engine never took: as stored, `typed` in the box."""
            try:
                history[:] = to_chatbot(self.sm.messages(owner, sid))
            except CrowdchatError:  # deleted meanwhile
                history[:] = []
            text, editing = typed  # type: ignore[misc]
            if editing is not None:
                status += " Your edit is back in the message box: Send tries it again."
            meta = meta_of(self.sm.messages(owner, sid), self.reply_stats) if history else None
            return paint(status.strip(), box=text, editing=editing, busy=False, meta=meta)

        def ended() -> tuple:
            """The stored conversation, with the reply's stats kept for the line under it."""
            stored = self.sm.messages(owner, sid)
            history[:] = to_chatbot(stored)
            if first and stored and stored[-1]["role"] == "assistant":
                tokens = turn.num_generated_tokens
                took = time.monotonic() - first[0]
                speed = (tokens - 1) / took if tokens > 1 and took > 0 else None
                self.reply_stats.put(
                    stored[-1]["id"], ReplyStats(tokens, first[0] - started, speed)
                )
            note = "Stopped." if turn.finish_reason == "cancelled" else ""
            listing = self.listing(owner, sid, screen)
            return paint(note, convos=listing, busy=False, meta=meta_of(stored, self.reply_stats))

        try:
            meta = meta_of(kept or [], self.reply_stats)
            yield paint(status_now(), box, self.listing(owner, sid, screen), meta=meta)
            while True:
                # no event within POLL_S: the status line still moves (queue position)
                match events.get(timeout=POLL_S):
                    case Delta(text):
                        if not first:
                            first.append(time.monotonic())
                        history[-1]["content"] += text
                        yield paint("")
                    case Failed(error):
                        status = f"Error: {_message(error)}"
                        if typed and not turn.accepted:
                            yield given_back(status)
                        else:
                            stored = self.sm.messages(owner, sid)
                            yield paint(status, busy=False, meta=meta_of(stored, self.reply_stats))
                        return
                    case End():
                        if typed and not turn.accepted:
                            yield given_back("Stopped." if turn.finish_reason else "")
                            return
                        yield ended()
                        return
                    case None:
                        yield paint(status_now())
        finally:
            if turn.status != "done":
                turn.cancel()  # the browser went away (tab closed): free the batch slot


def _message(error: BaseException) -> str:
    """What the page says about a failed reply: no raw traceback reaches it."""
    if isinstance(error, CrowdchatError):
        return str(error)
    log.error("chat turn failed", exc_info=error)
    return f"something went wrong: {type(error).__name__}"
