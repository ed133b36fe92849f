"""The admin page's "Shared system prompts" section: mark a system prompt shared (its KV
blocks computed once for every user), list them, stop sharing one."""

from __future__ import annotations

import datetime as dt

import gradio as gr
import pandas as pd

from engine import CrowdchatError
from sessions import SessionManager


def shared_table(sessions: SessionManager) -> pd.DataFrame:
    """The system prompts marked shared on this page."""
    rows = [
        {"id": r["id"], "system prompt": r["text"][:200], "since": _when(r["created"])}
        for r in sessions.shared_prompts.list()
    ]
    return pd.DataFrame(rows, columns=["id", "system prompt", "since"])


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M")


def build_shared_prompts(sessions: SessionManager) -> None:
    """Mark a system prompt shared (its KV computed once for every user), list, stop."""

    def share(text: str) -> tuple[str, pd.DataFrame, str]:
        try:
            row = sessions.shared_prompts.add(text or "")
        except CrowdchatError as e:
            return f"Not shared: {e}", shared_table(sessions), text
        return f"Shared as prompt {row['id']}.", shared_table(sessions), ""

    def unshare(prompt_id: float | None) -> tuple[str, pd.DataFrame]:
        done = prompt_id is not None and sessions.shared_prompts.remove(int(prompt_id))
        note = f"Prompt {int(prompt_id)} is no longer shared." if done else "No such prompt."
        return note, shared_table(sessions)

    with gr.Accordion("Shared system prompts", open=False, elem_id="shared-prompts"):
        gr.Markdown(
            "A conversation whose system prompt is exactly one of these shares its KV blocks "
            "with every user: computed once, held once. Share only text anyone may see."
        )
        text = gr.Textbox(label="System prompt", lines=3, elem_id="shared-prompt-text")
        share_btn = gr.Button("Mark shared", size="sm", elem_id="share-prompt")
        table = gr.Dataframe(shared_table(sessions), interactive=False, label="Shared now")
        with gr.Row():
            target = gr.Number(label="Prompt id", precision=0, minimum=1)
            stop_btn = gr.Button("Stop sharing", size="sm", elem_id="unshare-prompt")
        result = gr.Markdown()
        share_btn.click(
            share, [text], [result, table, text], api_name="share_prompt", concurrency_limit=None
        )
        stop_btn.click(
            unshare, [target], [result, table], api_name="unshare_prompt", concurrency_limit=None
        )
