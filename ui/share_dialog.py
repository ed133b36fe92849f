"""The share dialog, opened from a conversation's menu: a read-only link to that conversation
(a copy of its active branch as it is now), its live links, and revoking one. Viewers reach
the links through `api.shares`."""

from __future__ import annotations

import html
from dataclasses import dataclass
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


@dataclass
class ShareParts:
    sid: gr.State  # the conversation the dialog is about (not always the one open)
    title: gr.HTML
    link: gr.Textbox
    links: gr.Dropdown
    revoke: gr.Button


class ShareDialog:
    """Handlers of the dialog (plain methods, like ChatPage's)."""

    def __init__(self, page: ChatPage) -> None:
        self.page = page
        self.sm = page.sm

    def _choices(self, owner: str, sid: str) -> list[tuple[str, str]]:
        def label(row: dict) -> str:
            when = datetime.fromtimestamp(row["created"], UTC).strftime("%Y-%m-%d %H:%M")
            return f"shared {when} UTC · …{row['token'][-6:]}"

        return [(label(r), r["token"]) for r in self.sm.shares(owner, sid)]

    def on_share(self, evt: gr.EventData, request: gr.Request):  # noqa: ANN201
        """'Share' in a conversation's menu: a new link to it. Outputs: the dialog's
        conversation, its title, the link, the live links, the status line."""
        owner = self.page.owner(request)
        data = getattr(evt, "_data", None)
        sid = data.get("id") if isinstance(data, dict) else None
        if not isinstance(sid, str) or not sid:
            return gr.skip(), gr.skip(), "", gr.skip(), "Error: pick a conversation to share."
        try:
            title = self.sm.get_session(owner, sid)["title"] or "New chat"
            row = self.sm.share(owner, sid)
            choices = self._choices(owner, sid)
        except CrowdchatError as e:
            return gr.skip(), gr.skip(), "", gr.skip(), f"Error: {e}"
        link = link_of(row["token"], request)
        heading = f"<h2>Share “{html.escape(title)}”</h2>"
        return sid, heading, link, gr.update(choices=choices, value=row["token"]), ""

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


def build_share_dialog() -> ShareParts:
    """The dialog (inside the page's Blocks; hidden until a menu's Share opens it)."""
    sid = gr.State(None)
    with gr.Column(elem_id="share-dialog", elem_classes="cc-dialog"):
        with gr.Row(elem_classes="cc-dialog-head"):
            title = gr.HTML("<h2>Share</h2>", apply_default_css=False)
            close = gr.Button("✕", elem_id="share-close", elem_classes="cc-icon", scale=0)
        gr.Markdown("Anyone you give this link to can read the conversation as it is now.")
        link = gr.Textbox(
            label="Link (a copy of the conversation as it is now)",
            interactive=False,
            buttons=["copy"],
            elem_id="share-link",
        )
        with gr.Row(equal_height=True):
            links = gr.Dropdown(
                choices=[], label="Live links", elem_id="share-list", allow_custom_value=False
            )
            revoke = gr.Button("Revoke", size="sm", scale=0, elem_id="share-revoke")
    close.click(None, js="() => window.crowdchat.closeDialogs()")
    return ShareParts(sid, title, link, links, revoke)
