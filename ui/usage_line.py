"""The chat page's usage line: where the user stands against the per-user limits, so a limited
user knows why a message waits or is refused, and when it frees."""

from __future__ import annotations

import gradio as gr

from ui.chat_page import ChatPage


def usage_text(u: dict) -> str:
    """One line: tokens this minute, replies answering, conversations kept (limits that are
    off are left out)."""
    parts = []
    if u["tokens_per_minute"]:
        held = u["tokens_used"] + u["tokens_reserved"]
        part = f"{held:,} of {u['tokens_per_minute']:,} tokens this minute"
        if held >= u["tokens_per_minute"] and u["tokens_free_in_seconds"]:
            part += f" (some free in {u['tokens_free_in_seconds']:.0f} s)"
        parts.append(part)
    if u["max_turns_per_user"]:
        parts.append(f"{u['turns_answering']} of {u['max_turns_per_user']} replies at once")
    if u.get("max_storage_bytes"):  # the storage quota (sessions.quota)
        parts.append(
            f"{u['storage_bytes'] / 1e6:.1f} of {u['max_storage_bytes'] / 1e6:.0f} MB kept"
        )
    if u["max_sessions_per_user"]:
        parts.append(f"{u['conversations']} of {u['max_sessions_per_user']} conversations")
    return "Your usage: " + " · ".join(parts) if parts else ""


class UsageLine:
    """Handler of the usage line (a plain method, like ChatPage's)."""

    def __init__(self, page: ChatPage) -> None:
        self.page = page

    def on_usage(self, request: gr.Request) -> str:
        """Output: the usage line."""
        return usage_text(self.page.sm.usage(self.page.owner(request)))
