"""The sidebar: the brand, New chat (Ctrl+Shift+O) and the conversation list with its search.
Gradio's `gr.Sidebar` collapses it on a desktop and makes it a drawer on a phone."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from ui.conversation_list import build_conversation_list

WIDTH = 272


@dataclass
class Sidebar:
    new_chat: gr.Button
    convos: gr.HTML


def build_sidebar() -> Sidebar:
    """The sidebar (inside the page's Blocks)."""
    with gr.Sidebar(open=True, width=WIDTH, elem_id="sidebar"):
        gr.HTML('<div class="cc-brand">crowdchat</div>', apply_default_css=False)
        new_chat = gr.Button("New chat", elem_id="new-chat", size="md")
        convos = build_conversation_list()
    return Sidebar(new_chat, convos)
