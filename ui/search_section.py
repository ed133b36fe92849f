"""The chat page's search: a box over the conversation list that finds the user's own
conversations by title or message text (any branch), and a list of hits with the matching
words; picking one opens that conversation with the matching message on the path shown."""

from __future__ import annotations

import gradio as gr

from engine import CrowdchatError
from ui.chat_page import ChatPage, Screen

MARKS = ("«", "»")  # the hit's words in a plain-text label


def hit_label(hit: dict) -> str:
    """A hit as the list shows it: the conversation's title and the matching words."""
    title = hit["title"] or "Untitled"
    where = "title" if hit["message_id"] is None else ("you" if hit["role"] == "user" else "reply")
    return f"{title} · {where}: {' '.join(hit['snippet'].split())}"


class SearchSection:
    """Handlers of the search box and its hits (plain methods, like ChatPage's)."""

    def __init__(self, page: ChatPage) -> None:
        self.page = page
        self.sm = page.sm

    def on_search(self, text: str, request: gr.Request):  # noqa: ANN201
        """Outputs: the hits list (hidden for an empty box), the status line."""
        if not (text or "").strip():
            return gr.update(choices=[], value=None, visible=False), ""
        owner = self.page.owner(request)
        try:
            hits = self.sm.search(owner, text, marks=MARKS)
        except CrowdchatError as e:
            return gr.update(choices=[], value=None, visible=False), f"Error: {e}"
        choices = [(hit_label(h), f"{h['session_id']}:{h['message_id'] or ''}") for h in hits]
        found = "" if hits else f"Nothing of yours matches “{text.strip()}”."
        return gr.update(choices=choices, value=None, visible=bool(hits)), found

    def on_open(self, hit: str | None, screen: Screen, request: gr.Request):  # noqa: ANN201
        """Outputs: sid, chatbot, status, system prompt box, the conversation list."""
        owner = self.page.owner(request)
        sid, _, message = (hit or "").partition(":")
        try:
            if sid and message:
                self.sm.show_message(owner, sid, int(message))
        except (CrowdchatError, ValueError) as e:
            return gr.skip(), gr.skip(), f"Error: {e}", gr.skip(), gr.skip()
        opened = self.page.on_select(sid or None, screen, request)[:4]
        return *opened, gr.update(choices=self.page.choices(owner), value=opened[0])
