"""The composer: the message box (Enter sends, Shift+Enter breaks a line, it grows with its
text up to ten lines) and Send, which turns into Stop while the conversation shown answers
(Esc stops too: static/crowdchat.js). On a phone it stays at the bottom of the screen."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr


@dataclass
class Composer:
    box: gr.Textbox
    send: gr.Button
    stop: gr.Button


def build_composer() -> Composer:
    """The composer's row (inside the page's Blocks; ui.chat_blocks wires its events)."""
    with gr.Row(elem_id="composer", equal_height=False):
        box = gr.Textbox(
            placeholder="Send a message",
            show_label=False,
            container=False,
            lines=1,
            max_lines=10,
            scale=8,
            elem_id="message",
            autofocus=True,
        )
        send = gr.Button("Send", variant="primary", scale=0, min_width=76, elem_id="send")
        stop = gr.Button(
            "Stop", variant="stop", scale=0, min_width=76, elem_id="stop", visible=False
        )
    return Composer(box, send, stop)
