"""Actions on the message they act on, as Open WebUI puts them: copy (the Chatbot's own button),
edit any of the user's messages in place (the Chatbot's own `edit` event), regenerate any reply,
‹ n/m › on a message that has versions, and a reply's stats under it.

Regenerate, ‹ › and the stats are drawn into each message's button row by
static/message_actions.js, the script of a `gr.HTML` whose value is the messages' meta
(ui.message_meta); a click comes back as that component's 'regenerate' or 'branch' event with
the message's index in the chat."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gradio as gr

from engine import CrowdchatError
from ui.chat_page import ChatPage, Screen, to_chatbot
from ui.message_meta import meta_of

SCRIPT = Path(__file__).resolve().parent.parent / "static" / "message_actions.js"


def _index(evt: gr.EventData) -> int | None:
    data = getattr(evt, "_data", None)
    i = data.get("index") if isinstance(data, dict) else None
    return i if isinstance(i, int) and not isinstance(i, bool) else None


class MessageActions:
    """Handlers of the actions (plain methods, like ChatPage's)."""

    def __init__(self, page: ChatPage) -> None:
        self.page = page
        self.sm = page.sm

    def on_edit(
        self,
        evt: gr.EditData,
        sid: str | None,
        temperature: float,
        top_p: float,
        max_tokens: float,
        repetition: float,
        screen: Screen,
        request: gr.Request,
    ) -> Iterator[tuple]:
        """The Chatbot's in-place edit of a user message. Outputs as ChatPage.on_send's."""
        index = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
        text = evt.value if isinstance(evt.value, str) else str(evt.value)
        sampling = (temperature, top_p, max_tokens, repetition)
        yield from self.page.on_edit(int(index), text, sid, *sampling, screen, request)

    def on_regenerate(
        self,
        evt: gr.EventData,
        sid: str | None,
        temperature: float,
        top_p: float,
        max_tokens: float,
        repetition: float,
        screen: Screen,
        request: gr.Request,
    ) -> Iterator[tuple]:
        """↻ under a reply: answer its question again (the old reply stays a branch)."""
        index = _index(evt)
        if index is None:
            yield (*(gr.skip(),) * 7,)
            return
        sampling = (temperature, top_p, max_tokens, repetition)
        yield from self.page.on_regenerate(index, sid, *sampling, screen, request)

    def on_branch(self, evt: gr.EventData, sid: str | None, screen: Screen, request: gr.Request):  # noqa: ANN201
        """‹ or › on a message: show its previous or next version (and below it whatever that
        version was continued with). Outputs: chatbot, status, meta."""
        owner = self.page.owner(request)
        index = _index(evt)
        data = getattr(evt, "_data", None) or {}
        step = data.get("step") if isinstance(data, dict) else None
        if not sid or index is None or step not in (-1, 1) or screen.sid != sid:
            return gr.skip(), gr.skip(), gr.skip()
        status = ""
        try:
            path = self.sm.messages(owner, sid)
            if 0 <= index < len(path):
                self.sm.switch_branch(owner, sid, path[index]["id"], step)
        except CrowdchatError as e:
            status = f"Error: {e}"
        path = self.sm.messages(owner, sid)
        return to_chatbot(path), status, meta_of(path, self.page.reply_stats)


def build_message_actions() -> gr.HTML:
    """The component that draws the actions onto the chat (it shows nothing itself)."""
    return gr.HTML(
        {"items": []},
        html_template="",
        js_on_load=SCRIPT.read_text(encoding="utf-8"),
        elem_id="message-actions",
        apply_default_css=False,
    )
