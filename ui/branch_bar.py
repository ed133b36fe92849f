"""The chat page's branch switcher: `‹ 1/2 ›` under the chat for a message that has siblings
(a regenerated reply, an edited message). It follows the message the user clicked in the chat,
else the newest one on screen that has siblings."""

from __future__ import annotations

import gradio as gr

from engine import CrowdchatError
from ui.chat_page import ChatPage, Screen, to_chatbot

SNIPPET = 40


def focused(path: list[dict], focus: int | None) -> dict | None:
    """The message the switcher works on: `focus` if it is on the path and has siblings,
    else the newest message on the path that has any."""
    forks = [m for m in path if m.get("branches", 1) > 1]
    return next((m for m in forks if m["id"] == focus), forks[-1] if forks else None)


def describe(message: dict | None) -> str:
    """The switcher's label: which version this is and of what."""
    if message is None:
        return ""
    words = " ".join(message["content"].split())
    words = words[:SNIPPET] + ("…" if len(words) > SNIPPET else "")
    what = "reply" if message["role"] == "assistant" else "your message"
    return f"**{message['branch']}/{message['branches']}** · {what} “{words}”"


class BranchBar:
    """Handlers of the switcher (plain methods, like ChatPage's)."""

    def __init__(self, page: ChatPage) -> None:
        self.page = page
        self.sm = page.sm

    def render(self, sid: str | None, screen: Screen, request: gr.Request):  # noqa: ANN201
        """Outputs: the switcher row (shown only when a message on screen has siblings) and
        its label."""
        if not sid or screen.sid != sid:
            return gr.update(visible=False), ""
        try:
            path = self.sm.messages(self.page.owner(request), sid)
        except CrowdchatError:
            return gr.update(visible=False), ""
        message = focused(path, screen.focus)
        screen.focus = message["id"] if message else None
        return gr.update(visible=message is not None), describe(message)

    def on_pick(self, evt: gr.SelectData, sid: str | None, screen: Screen, request: gr.Request):  # noqa: ANN201
        """A click on a message in the chat: the switcher follows it if it has siblings."""
        if sid and isinstance(evt.index, int):
            path = self.sm.messages(self.page.owner(request), sid)
            if 0 <= evt.index < len(path) and path[evt.index]["branches"] > 1:
                screen.focus = path[evt.index]["id"]
        return self.render(sid, screen, request)

    def on_prev(self, sid: str | None, screen: Screen, request: gr.Request):  # noqa: ANN201
        return self.on_step(-1, sid, screen, request)

    def on_next(self, sid: str | None, screen: Screen, request: gr.Request):  # noqa: ANN201
        return self.on_step(+1, sid, screen, request)

    def on_step(self, step: int, sid: str | None, screen: Screen, request: gr.Request):  # noqa: ANN201
        """‹ or ›: show the previous or next sibling. Outputs: chatbot, status, row, label."""
        owner = self.page.owner(request)
        if not sid or screen.focus is None:
            return gr.skip(), "", *self.render(sid, screen, request)
        status = ""
        try:
            screen.focus = self.sm.switch_branch(owner, sid, screen.focus, step)
        except CrowdchatError as e:
            status = f"Error: {e}"
        return to_chatbot(self.sm.messages(owner, sid)), status, *self.render(sid, screen, request)
