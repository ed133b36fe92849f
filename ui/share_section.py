"""The chat page's share links: make a read-only link to the open conversation (a copy of its
active branch as it is now), see the live ones, revoke one. Viewers reach them through
`api.shares`."""

from __future__ import annotations

from datetime import UTC, datetime
from urllib.parse import urljoin

import gradio as gr

from engine import CrowdchatError
from ui.chat_page import ChatPage


def link_of(token: str, request: gr.Request) -> str:
    """The link as the user's browser reaches this server: the page's own address (the
    Referer of the page's request) with share/TOKEN, so a proxy's host and prefix hold."""
    page = request.headers.get("referer") if request is not None else None
    return urljoin(page, f"share/{token}") if page else f"/share/{token}"


class ShareSection:
    """Handlers of the share box (plain methods, like ChatPage's)."""

    def __init__(self, page: ChatPage) -> None:
        self.page = page
        self.sm = page.sm

    def _choices(self, owner: str, sid: str) -> list[tuple[str, str]]:
        def label(row: dict) -> str:
            when = datetime.fromtimestamp(row["created"], UTC).strftime("%Y-%m-%d %H:%M")
            return f"shared {when} UTC · …{row['token'][-6:]}"

        return [(label(r), r["token"]) for r in self.sm.shares(owner, sid)]

    def on_list(self, sid: str | None, request: gr.Request):  # noqa: ANN201
        """Output: the live links of the conversation on screen."""
        owner = self.page.owner(request)
        try:
            choices = self._choices(owner, sid) if sid else []
        except CrowdchatError:
            choices = []
        return gr.update(choices=choices, value=None)

    def on_create(self, sid: str | None, request: gr.Request):  # noqa: ANN201
        """Outputs: the new link, the links list, the status line."""
        owner = self.page.owner(request)
        if not sid:
            return "", gr.skip(), "Error: open or start a conversation to share it."
        try:
            row = self.sm.share(owner, sid)
            choices = self._choices(owner, sid)
        except CrowdchatError as e:
            return "", gr.skip(), f"Error: {e}"
        link = link_of(row["token"], request)
        said = "Anyone you give this link to can read the conversation as it is now."
        return link, gr.update(choices=choices, value=row["token"]), said

    def on_revoke(self, sid: str | None, token: str | None, request: gr.Request):  # noqa: ANN201
        """Outputs: the link box (emptied), the links list, the status line."""
        owner = self.page.owner(request)
        if not token:
            return gr.skip(), gr.skip(), "Error: pick a link to revoke."
        try:
            self.sm.revoke_share(owner, token)
            choices = self._choices(owner, sid) if sid else []
        except CrowdchatError as e:
            return gr.skip(), gr.skip(), f"Error: {e}"
        return "", gr.update(choices=choices, value=None), "Revoked: that link shows nothing now."
