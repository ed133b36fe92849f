"""The chat's header: the model answering, and the page's controls (a new chat on phones,
light or dark, the settings dialog). Its buttons act in the browser alone (static/crowdchat.js)."""

from __future__ import annotations

import html
from dataclasses import dataclass

import gradio as gr


@dataclass
class Header:
    new_chat: gr.Button
    theme: gr.Button
    settings: gr.Button


def build_header(model: str) -> Header:
    """The header row (inside the page's Blocks)."""
    with gr.Row(elem_id="header", equal_height=True):
        gr.HTML(
            f'<span class="cc-model" title="The model that answers">{html.escape(model)}</span>',
            elem_id="model-name",
            apply_default_css=False,
        )
        new_chat = gr.Button("✎", elem_id="new-chat-top", elem_classes="cc-icon", scale=0)
        theme = gr.Button("◐", elem_id="theme-toggle", elem_classes="cc-icon", scale=0)
        settings = gr.Button("⚙", elem_id="settings-open", elem_classes="cc-icon", scale=0)
    theme.click(None, js="() => window.crowdchat.toggleTheme()")
    settings.click(None, js="() => window.crowdchat.openDialog('settings')")
    return Header(new_chat, theme, settings)
