"""A turn's reply on the chat page: streamed as it grows, the status line while it waits (and
empty once it streams), Send turned into Stop while it runs, the page repainted right when the
user opens another conversation meanwhile, the typed text given back when the engine never took
the turn, and the reply's speed kept for the line under it. A part of `ChatPage`."""

from __future__ import annotations

import logging
import threading
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
# A reply paints at most every PAINT_S (its first text and its end at once), and the page as a
# whole at most PAINTS_PER_S times a second, shared by the replies streaming at once (each
# paints at most every MAX_PAINT_S): every paint has Gradio process, diff and send every output
# of the turn, Python work that takes the model's CPU. Measured with bench/page_latency.py at
# 8 users on the 2-core box: a paint every 50 ms each left the page's streamed tokens/s at
# 0.47-0.53x the API's, 100 ms at 0.53-0.76x; this, with painted() in ui/chat_blocks.py,
# 0.81-1.36x (median 0.88x, against 0.70x before in the same run; docs/PERFORMANCE.md)
PAINT_S = 0.1
PAINTS_PER_S = 40.0
MAX_PAINT_S = 0.5
AWAY_S = 2.0  # while its conversation is not on screen a reply yields this seldom
PAGE = 100  # conversations the list holds before the user scrolls for more


def paint_interval(streaming: int) -> float:
    """How often each of `streaming` replies streaming at once paints: a lone reader gains
    nothing from more than 1 / PAINT_S paints a second, and a crowd's paints give the model
    back its CPU."""
    return min(MAX_PAINT_S, max(PAINT_S, streaming / PAINTS_PER_S))


class Streaming:
    """How many replies stream on the page now, in every tab: it spaces each one's paints."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.count += n

    def interval(self) -> float:
        return paint_interval(self.count)


def to_chatbot(messages: list[dict]) -> list[dict]:
    return [{"role": m["role"], "content": m["content"]} for m in messages]


@dataclass
class Screen:
    """What one browser tab shows. Mutable on purpose: Gradio hands a State's own object to
    every handler of that tab, so a reply still streaming sees the user open another
    conversation and stops painting over it."""

    sid: str | None = None
    shown: int = PAGE  # conversations loaded into the list (more as the user scrolls)
    # the text of a turn the engine never took, and the message it edits (None: a new one),
    # for the message box (ChatPage.on_given_back)
    back: tuple[str, int | None] | None = None


def buttons(busy: bool) -> tuple[dict, dict]:
    """Send and Stop: Stop stands in Send's place while the conversation shown answers."""
    return gr.update(visible=not busy), gr.update(visible=busy)


class ReplyStream:
    """`_stream` of the chat page (mixed into `ChatPage`)."""

    sm: SessionManager
    reply_stats: StatsMemory
    streaming: Streaming
    listing: Callable[[str, str | None, Screen], dict]

    def _stream(
        self,
        owner: str,
        sid: str,
        turn: ChatTurn,
        screen: Screen,
        history: list[dict],
        typed: tuple[str, int | None] | None = None,
        started: float | None = None,
        kept: list[dict] | None = None,
    ) -> Iterator[tuple]:
        """Run the turn on a thread; yield the growing reply, and the status while waiting.
        Outputs: chatbot, status, sid, list, Send, Stop, the messages' meta (the message box
        is not one: the browser empties it as it sends, and ChatPage.on_given_back fills it
        after the turn if need be). Only while `sid` is on screen: after the user opened
        another conversation the turn runs on (and is committed) but every yield changes
        nothing, not even the tab's sid, until they come back. Yielding still lets Gradio
        close us when the tab goes away. `typed`: (text, id of the message it edits) of an
        edit, written only once the engine takes the turn: if it never does (queue full,
        engine stopped, Stop first), the text goes back into the box beside the reason
        (`screen.back`), and Send tries the edit again. `started`: when the user sent it
        (monotonic), for the time to the first token. `kept`: the stored messages that stay
        on screen above the new ones (their ‹ n/m › and stats stay while the reply streams)."""
        started = time.monotonic() if started is None else started
        screen.sid = sid
        history.append({"role": "assistant", "content": ""})
        events = RelayThread(turn, "crowdchat-page-reply")
        on_screen = [True]
        keys_shown: list[bool] = []  # what Send/Stop show now, once painted
        last: dict[str, object] = {}  # the list and the meta as the page shows them
        first: list[float] = []

        def paint(
            status: str, convos: object = None, busy: bool = True, meta: object = None
        ) -> tuple:
            if screen.sid != sid:
                if not on_screen[0]:
                    return (gr.skip(),) * 7
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
                    return (gr.skip(),) * 7
                return (shown, gr.skip(), now, *(gr.skip(),) * 4)
            on_screen[0] = True
            # what the page already shows goes again as its value, not gr.skip(): Gradio builds
            # the component anew for each skip() (1-3 ms), and five of them a paint took the
            # CPU the model needed at 8 users (the value's diff against the last paint is empty)
            if convos is not None:
                last["convos"] = convos
            if meta is not None:
                last["meta"] = meta
            keys: tuple = ("Send", "Stop")
            if keys_shown != [busy]:  # first paint, back on screen, or the reply ended
                keys_shown[:] = [busy]
                keys = buttons(busy)
            skip = gr.skip()
            return (history, status, sid, last.get("convos", skip), *keys, last.get("meta", skip))

        def status_now() -> str:
            return turn_status(turn, self.sm.engine)

        def given_back(status: str) -> tuple:
            """The page after a turn the engine never took: as stored, `typed` in the box."""
            try:
                history[:] = to_chatbot(self.sm.messages(owner, sid))
            except CrowdchatError:  # deleted meanwhile
                history[:] = []
            screen.back = typed
            if typed[1] is not None:  # type: ignore[index]
                status += " Your edit is back in the message box: Send tries it again."
            meta = meta_of(self.sm.messages(owner, sid), self.reply_stats) if history else None
            return paint(status.strip(), busy=False, meta=meta)

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

        def gathered(text: str) -> tuple[str, object]:
            """`text` and what else arrives within a paint interval of the last paint; and
            the event that ended the wait (an End or a Failed), if any."""
            while (left := painted[0] + self.streaming.interval() - time.monotonic()) > 0:
                event = events.get(timeout=left)
                if not isinstance(event, Delta):
                    return text, event
                text += event.text
            return text, None

        painted = [0.0]  # when the reply last painted (monotonic)
        self.streaming.add(1)
        try:
            meta = meta_of(kept or [], self.reply_stats)
            yield paint(status_now(), self.listing(owner, sid, screen), meta=meta)
            held = None  # an event that came while deltas were gathered
            while True:
                # no event within POLL_S: the status line still moves (queue position)
                event, held = held or events.get(timeout=POLL_S), None
                match event:
                    case Delta(text):
                        if first:
                            text, held = gathered(text)
                        else:
                            first.append(time.monotonic())
                        history[-1]["content"] += text
                        painted[0] = time.monotonic()
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
                # away (another conversation on screen): the reply runs on, gathered here, and
                # yields only every AWAY_S, which is enough for Gradio to see a closed tab
                until = time.monotonic() + AWAY_S
                while not on_screen[0] and screen.sid != sid and not held:
                    if (left := until - time.monotonic()) <= 0:
                        break
                    event = events.get(timeout=left)
                    if isinstance(event, Delta):
                        history[-1]["content"] += event.text
                    elif event is not None:
                        held = event
        finally:
            self.streaming.add(-1)
            if turn.status != "done":
                turn.cancel()  # the browser went away (tab closed): free the batch slot


def _message(error: BaseException) -> str:
    """What the page says about a failed reply: no raw traceback reaches it."""
    if isinstance(error, CrowdchatError):
        return str(error)
    log.error("chat turn failed", exc_info=error)
    return f"something went wrong: {type(error).__name__}"
