"""The chat page's sampling settings belong to the conversation, like its system prompt: the
sliders show the open conversation's settings, a change is kept with it at once (and as the
user's last choice), and a new conversation starts from that last choice."""

from __future__ import annotations

import gradio as gr

from engine import CrowdchatError
from ui.chat_page import ChatPage, Screen


class SettingsSection:
    """Handlers of the settings sliders (plain methods, like ChatPage's)."""

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
