"""A turn's reply on the chat page: streamed as it grows, the status line while it waits,
the page repainted right when the user opens another conversation meanwhile, and the typed
text given back when the engine never took the turn. A part of `ChatPage` (ui.chat_page)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import gradio as gr

from engine import CrowdchatError
from sessions import ChatTurn, SessionManager
from sessions.relay import Delta, End, Failed, RelayThread

log = logging.getLogger("ui.chat_page")
POLL_S = 0.4


def to_chatbot(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@dataclass
class Screen:
    """Which conversation one browser tab shows. Mutable on purpose: Gradio hands a State's
    own object to every handler of that tab, so a reply still streaming sees the user open
    another conversation and stops painting over it."""

    sid: str | None = None
    focus: int | None = None  # the message whose branches the switcher shows


class ReplyStream:
    """`_stream` and `status` of the chat page (mixed into `ChatPage`)."""

    sm: SessionManager
    choices: Callable[[str], list[tuple[str, str]]]

    def _stream(
        self,
        owner: str,
        sid: str,
        turn: ChatTurn,
        screen: Screen,
        history: list[dict],
        clear_box: bool,
        typed: tuple[str, bool] | None = None,
    ) -> Iterator[tuple]:
        """Run the turn on a thread; yield the growing reply, and the status while waiting.
        Only while `sid` is on screen: after the user opened another conversation the turn
        runs on (and is committed) but every yield changes nothing, not even the tab's sid,
        until they come back. Yielding still lets Gradio close us when the tab goes away.
        `typed`: (text, editing) of a message written only once the engine takes the turn (an
        edit): if it never does (queue full, engine stopped, Stop first), the text goes back
        into the box, editing as before, beside the reason."""
        screen.sid = sid
        screen.focus = None  # the switcher follows the newest branch again
        history.append({"role": "assistant", "content": ""})
        box = "" if clear_box else gr.update()
        choices = gr.update(choices=self.choices(owner), value=sid)
        events = RelayThread(turn, "crowdchat-page-reply")

        on_screen = [True]

        def paint(
            status: str, box: object = None, convos: object = None, editing: bool = False
        ) -> tuple:
            if screen.sid != sid:
                if not on_screen[0]:
                    return (gr.skip(),) * 6
                # the user just opened another conversation (or a new one): a delta painted
                # before that can reach the browser after the page showed it, over it. Once,
                # paint what is on screen now: this generator's yields arrive in order.
                on_screen[0] = False
                now = screen.sid
                try:
                    shown = to_chatbot(self.sm.messages(owner, now)) if now else []
                except CrowdchatError:  # deleted meanwhile: the page's own event shows that
                    return (gr.skip(),) * 6
                return (shown, gr.skip(), gr.skip(), now, gr.skip(), gr.skip())
            on_screen[0] = True
            return (
                history,
                status,
                gr.skip() if box is None else box,
                sid,
                gr.skip() if convos is None else convos,
                editing,
            )

        def given_back(status: str) -> tuple:
            """The page after a turn the engine never took: as stored, `typed` in the box."""
            try:
                history[:] = to_chatbot(self.sm.messages(owner, sid))
            except CrowdchatError:  # deleted meanwhile
                history[:] = []
            text, editing = typed  # type: ignore[misc]
            return paint(status, box=text, editing=editing)

        try:
            yield paint(self.status(turn), box, choices)
            while True:
                # no event within POLL_S: the status line still moves (queue position)
                match events.get(timeout=POLL_S):
                    case Delta(text):
                        history[-1]["content"] += text
                        yield paint(self.status(turn))
                    case Failed(error):
                        status = f"Error: {_message(error)}"
                        yield given_back(status) if typed and not turn.accepted else paint(status)
                        return
                    case End():
                        note = "Stopped." if turn.finish_reason == "cancelled" else ""
                        if typed and not turn.accepted:
                            yield given_back(note)
                            return
                        history[:] = to_chatbot(self.sm.messages(owner, sid))  # as stored
                        yield paint(note, convos=gr.update(choices=self.choices(owner), value=sid))
                        return
                    case None:
                        yield paint(self.status(turn))
        finally:
            if turn.status != "done":
                turn.cancel()  # the browser went away (tab closed): free the batch slot

    def status(self, turn: ChatTurn) -> str:
        if turn.status == "restoring":
            return "Restoring your conversation…"
        if turn.status == "queued":
            ahead = turn.queue_position()
            if ahead is None:
                return "Starting…"
            eta = self.sm.engine.wait_estimate(ahead)
            about = f" (about {eta:.0f} s)" if eta is not None and eta >= 1 else ""
            return (
                f"Waiting: {ahead} ahead of you{about}…"
                if ahead
                else f"Waiting for a free slot{about}…"
            )
        return "Replying…" if turn.status == "generating" else ""


def _message(error: BaseException) -> str:
    """What the page says about a failed reply: no raw traceback reaches it."""
    if isinstance(error, CrowdchatError):
        return str(error)
    log.error("chat turn failed", exc_info=error)
    return f"something went wrong: {type(error).__name__}"
