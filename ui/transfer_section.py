"""The chat page's export and import: each conversation's menu links its Markdown and JSON
exports, the settings dialog all of the user's (JSON), served by `api.downloads` on the page's
own door; and an upload that brings in a crowdchat export or ChatGPT's conversations.json."""

from __future__ import annotations

import logging
import os

import gradio as gr

from engine import CrowdchatError
from ui.chat_page import ChatPage, Screen

log = logging.getLogger(__name__)
EXPORT_ALL = "all"  # /export/all.json: every conversation (api.downloads serves them)


class TransferSection:
    """Handler of the import upload (a plain method, like ChatPage's)."""

    def __init__(self, page: ChatPage) -> None:
        self.page = page
        self.sm = page.sm

    def on_import(self, path: str | None, screen: Screen, request: gr.Request):  # noqa: ANN201
        """Outputs: the conversation list, the status line. The uploaded file is deleted once
        read: nothing of it stays in the server's upload cache."""
        owner = self.page.owner(request)
        if not path:
            return gr.skip(), ""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            return gr.skip(), f"Error: the upload could not be read ({e.strerror})."
        finally:
            try:
                os.remove(path)
            except OSError:
                log.warning("could not delete the uploaded file %s", path)
        try:
            ids, skipped = self.sm.import_file(owner, data)
        except CrowdchatError as e:
            return gr.skip(), f"Error: nothing was imported: {e}"
        said = f"Imported {len(ids)} conversation{'s' * (len(ids) != 1)}"
        if skipped:
            said += f" ({skipped} tool message{'s' * (skipped != 1)} or images left out)"
        return self.page.listing(owner, screen.sid, screen), said + "."
