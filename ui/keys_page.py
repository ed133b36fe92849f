"""The chat page's "API keys" section for signed-in users: create (the key is shown once),
list with last use, revoke. Keys act as their user: same conversations, same limits."""

from __future__ import annotations

import time

import gradio as gr

from sessions.api_keys import ApiKeys
from ui.chat_page import ChatPage

HEADERS = ["id", "name", "created", "last used", "state"]


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.gmtime(t)) + " UTC" if t else "never"


class KeysSection:
    """Handlers over `ApiKeys`, always for the signed-in user of the request."""

    def __init__(self, keys: ApiKeys, page: ChatPage) -> None:
        self.keys = keys
        self.page = page

    def rows(self, owner: str) -> list[list[str]]:
        return [
            [k["id"], k["name"], _when(k["created"]), _when(k["last_used"]),
             "revoked" if k["revoked"] else "active"]
            for k in self.keys.list(owner)
        ]  # fmt: skip

    def on_show(self, request: gr.Request) -> list[list[str]]:
        return self.rows(self.page.owner(request))

    def on_create(self, name: str, request: gr.Request):  # noqa: ANN201
        """Outputs: the new key (shown once), the table, the name box."""
        owner = self.page.owner(request)
        row, key = self.keys.issue(owner, name or "key")
        shown = f"New key {row['id']}: copy it now, it is not shown again.\n\n    {key}"
        return shown, self.rows(owner), ""

    def on_revoke(self, key_id: str, request: gr.Request):  # noqa: ANN201
        """Outputs: a note, the table, the id box."""
        owner = self.page.owner(request)
        done = self.keys.revoke(owner, (key_id or "").strip())
        note = f"Key {key_id.strip()} revoked." if done else f"No active key {key_id!r} of yours."
        return note, self.rows(owner), ""


def build_keys_section(section: KeysSection, demo: gr.Blocks) -> None:
    """The section's components and events (call inside the page's Blocks)."""
    with gr.Accordion("API keys", open=False, elem_id="api-keys"):
        gr.Markdown("For the OpenAI-compatible API at `/v1`: `Authorization: Bearer <key>`.")
        with gr.Row():
            name = gr.Textbox(label="New key's name", max_lines=1, scale=3)
            create = gr.Button("Create key", size="sm", scale=1, elem_id="create-key")
        shown = gr.Markdown("", elem_id="new-key")
        table = gr.Dataframe(headers=HEADERS, interactive=False, elem_id="keys")
        with gr.Row():
            key_id = gr.Textbox(label="Key id to revoke", max_lines=1, scale=3)
            revoke = gr.Button("Revoke", size="sm", variant="stop", scale=1)
    create.click(section.on_create, [name], [shown, table, name], concurrency_limit=None)
    revoke.click(section.on_revoke, [key_id], [shown, table, key_id], concurrency_limit=None)
    demo.load(section.on_show, None, table, concurrency_limit=None)
