"""The chat page's export and import: download links for the open conversation (Markdown, JSON)
and for all of the user's (JSON), served by `api.downloads` on the page's own door; and an
upload that brings in a crowdchat export or ChatGPT's conversations.json."""

from __future__ import annotations

import logging
import os
from urllib.parse import quote

import gradio as gr

from engine import CrowdchatError
from ui.chat_page import ChatPage

log = logging.getLogger(__name__)
EXPORT_ALL = "all"  # /export/all.json: every conversation (api.downloads serves them)


def export_links(sid: str | None) -> str:
    """The export links under the conversation list (relative, so they work behind a proxy's
    path prefix too)."""
    links = []
    if sid:
        one = quote(sid, safe="")
        links += [
            f'<a href="export/{one}.md" download id="export-md">Markdown</a>',
            f'<a href="export/{one}.json" download id="export-json">JSON</a>',
        ]
    links.append(f'<a href="export/{EXPORT_ALL}.json" download id="export-all">All (JSON)</a>')
    return "Export: " + " · ".join(links)


class TransferSection:
    """Handlers of the export links and the import upload (plain methods, like ChatPage's)."""

    def __init__(self, page: ChatPage) -> None:
        self.page = page
        self.sm = page.sm

    def on_links(self, sid: str | None) -> str:
        """Output: the export links for the conversation on screen."""
        return export_links(sid)

    def on_import(self, path: str | None, request: gr.Request):  # noqa: ANN201
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
        return gr.update(choices=self.page.choices(owner)), said + "."
