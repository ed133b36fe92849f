"""A conversation taken out: as Markdown (the active branch, for reading) and as crowdchat's JSON
(every branch, the settings and the timestamps, for `sessions.importing` to bring back in).

The JSON file, one conversation or all of a user's:

    {"format": "crowdchat", "version": 1, "exported": 1765000000.0,
     "conversations": [{"title": ..., "created": ..., "last_active": ..., "system_prompt": ...,
                        "settings": {...}, "messages": [{"id": 1, "parent": null,
                        "role": "user", "content": ..., "created": ..., "finish_reason": null,
                        "selected": true}, ...]}]}

`settings` is null for a conversation whose turns take what each request says (the API's).
Message ids are numbers within the file (1, 2, ...), parents before their children; `selected`
marks the branch each group of siblings shows. Nothing of the server's own (row ids, KV, owner)
leaves in it.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from sessions.branches import active_path

FORMAT = "crowdchat"
VERSION = 1
SPEAKERS = {"user": "You", "assistant": "Assistant", "system": "System"}


def conversation_json(session: dict, tree: list[dict], settings: dict | None) -> dict:
    """One conversation as the export file holds it; `tree`: every message, in id order."""
    number = {row["id"]: i for i, row in enumerate(tree, 1)}
    return {
        "title": session["title"],
        "created": session["created"],
        "last_active": session["last_active"],
        "system_prompt": session["system_prompt"],
        "settings": settings,
        "messages": [
            {
                "id": number[row["id"]],
                "parent": number.get(row["parent_id"]),
                "role": row["role"],
                "content": row["content"],
                "created": row["created"],
                "finish_reason": row["finish_reason"],
                "selected": bool(row["selected"]),
            }
            for row in tree
        ],
    }


def export_file(conversations: list[dict]) -> dict:
    """The export file around conversations made by `conversation_json`."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "exported": time.time(),
        "conversations": conversations,
    }


def _when(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M UTC")


def conversation_markdown(session: dict, tree: list[dict]) -> str:
    """The conversation's active branch as Markdown: a title, when, the system prompt, then
    each message under its speaker's name."""
    lines = [f"# {session['title'] or 'Untitled conversation'}", ""]
    lines += [
        f"*Started {_when(session['created'])}; exported from crowdchat {_when(time.time())}.*"
    ]
    if session["system_prompt"]:
        lines += ["", "**System prompt:**", "", *_quoted(session["system_prompt"])]
    for row in active_path(tree):
        lines += ["", f"## {SPEAKERS.get(row['role'], row['role'])}", "", row["content"]]
        if row["finish_reason"] == "cancelled":
            lines += ["", "*(stopped)*"]
    return "\n".join(lines) + "\n"


def _quoted(text: str) -> list[str]:
    return [f"> {line}" if line else ">" for line in text.splitlines()]


def file_name(title: str, suffix: str) -> str:
    """A safe download name from a conversation's title."""
    stem = "".join(c if c.isalnum() or c in " -_" else " " for c in title).split()
    return ("-".join(stem)[:60] or "conversation") + suffix
