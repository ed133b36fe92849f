"""The settings dialog, opened from the header (⚙): the conversation's system prompt and
sampling settings, the user's usage against the per-user limits, their data (export all,
import) and, signed in, their API keys. Closed with ✕, Esc or a click beside it.

The settings belong to the conversation, like its system prompt: the sliders show the open
conversation's, a change is kept with it at once (and as the user's last choice), and a new
conversation starts from that last choice."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from engine import CrowdchatError
from ui.chat_page import ChatPage, Screen
from ui.keys_page import KeysSection, build_keys_section
from ui.status_line import near_limit, usage_text
from ui.transfer_section import EXPORT_ALL


@dataclass
class SettingsParts:
    system: gr.Textbox
    sampling: list[gr.Slider]
    usage: gr.Markdown
    upload: gr.UploadButton


class SettingsDialog:
    """Handlers of the dialog (plain methods, like ChatPage's)."""

    def __init__(self, page: ChatPage) -> None:
        self.page = page
        self.sm = page.sm

    def on_show(self, sid: str | None, screen: Screen, request: gr.Request) -> tuple:
        """Outputs: temperature, top-p, max new tokens, repetition penalty: the open
        conversation's settings, or the user's last choice for a new one. Nothing once the
        tab shows another conversation (a late answer for one it left must not paint over
        the one it opened: a Send would keep them with it)."""
        owner = self.page.owner(request)
        if sid != screen.sid:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        try:
            settings = self.sm.settings(owner, sid) if sid else self.sm.last_settings(owner)
        except CrowdchatError:  # deleted meanwhile in another tab: leave the sliders be
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()
        return (
            settings.temperature,
            settings.top_p,
            settings.max_tokens,
            settings.repetition_penalty,
        )

    def on_change(
        self,
        sid: str | None,
        temperature: float,
        top_p: float,
        max_tokens: float,
        repetition: float,
        request: gr.Request,
    ) -> str:
        """A slider was moved: keep the settings with the conversation. Output: the status
        line (empty, or what was wrong)."""
        owner = self.page.owner(request)
        try:
            settings = self.page.settings(temperature, top_p, max_tokens, repetition)
            self.sm.set_settings(owner, sid or None, settings)
        except CrowdchatError as e:
            return f"Error: {e}"
        return ""

    def on_usage(self, request: gr.Request) -> tuple[str, str]:
        """Outputs: the dialog's usage line, and the one under the composer (only near a
        limit)."""
        u = self.sm.usage(self.page.owner(request))
        text = usage_text(u)
        return text, text if near_limit(u) else ""


def build_settings_dialog(keys: KeysSection | None, demo: gr.Blocks) -> SettingsParts:
    """The dialog (inside the page's Blocks; hidden until the header's ⚙ opens it)."""
    with gr.Column(elem_id="settings-dialog", elem_classes="cc-dialog"):
        with gr.Row(elem_classes="cc-dialog-head"):
            gr.HTML("<h2>Settings</h2>", apply_default_css=False)
            close = gr.Button("✕", elem_id="settings-close", elem_classes="cc-icon", scale=0)
        system = gr.Textbox(
            label="System prompt",
            lines=2,
            max_lines=8,
            elem_id="system",
            info="Kept with this conversation.",
            placeholder="e.g. You are a concise assistant.",
        )
        with gr.Row():
            temperature = gr.Slider(
                0, 2, value=0.7, step=0.05, label="Temperature", elem_id="temperature"
            )
            top_p = gr.Slider(0.05, 1, value=0.9, step=0.05, label="Top-p", elem_id="top-p")
        with gr.Row():
            max_tokens = gr.Slider(
                16, 2048, value=512, step=16, label="Max new tokens", elem_id="max-tokens"
            )
            repetition = gr.Slider(
                1,
                2,
                value=1,
                step=0.05,
                label="Repetition penalty",
                info="Above 1 curbs replies that loop (1: off).",
                elem_id="repetition",
            )
        usage = gr.Markdown("", elem_id="usage")
        with gr.Row(elem_id="data", equal_height=True):
            gr.HTML(
                f'<a href="export/{EXPORT_ALL}.json" download id="export-all">'
                "Export all conversations (JSON)</a>",
                apply_default_css=False,
            )
            upload = gr.UploadButton(
                "Import a file (.json)",
                file_types=[".json"],
                type="filepath",
                size="sm",
                elem_id="import",
            )
        if keys is not None:
            build_keys_section(keys, demo)
    close.click(None, js="() => window.crowdchat.closeDialogs()")
    return SettingsParts(system, [temperature, top_p, max_tokens, repetition], usage, upload)
