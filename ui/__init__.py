"""The Gradio pages: the chat page for everyone, the admin page for the operator.

Others use the page builders and the monitor named in `__all__`, and `ui.auth` for the
credential checks (not imported here: `python -m ui.auth` runs it as a script)."""

from __future__ import annotations

from ui.admin_page import build_admin_blocks
from ui.chat_blocks import build_chat_blocks
from ui.chat_page import ChatPage
from ui.monitor import Monitor

__all__ = ["ChatPage", "Monitor", "build_admin_blocks", "build_chat_blocks"]
