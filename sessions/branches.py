"""Conversation branches as a tree of messages: which path is active, and a message's siblings.

A message's parent is the message before it on its path (None for a conversation's first). A
regenerated reply or an edited message is a new sibling of the one it replaces; each group of
siblings has one `selected` member, and the active path follows the selected child from the
root. Switching a branch selects another sibling: nothing is ever deleted, and every deeper
choice is kept for when the user comes back to that branch.
"""

from __future__ import annotations

END = "end"  # add_message's default parent: the last message of the active path


def _children(rows: list[dict]) -> dict[int | None, list[dict]]:
    """parent id -> its children in the order they were written (rows in id order)."""
    children: dict[int | None, list[dict]] = {}
    for row in rows:
        children.setdefault(row["parent_id"], []).append(row)
    return children


def active_path(rows: list[dict]) -> list[dict]:
    """The active path from the first message to the last, given all of a session's messages
    in id order. Each row comes back with `branches`: how many siblings its group has."""
    children = _children(rows)
    path: list[dict] = []
    parent: int | None = None
    while group := children.get(parent):
        # one selected per group; should a write ever have left none, the newest shows
        pick = next((r for r in reversed(group) if r["selected"]), group[-1])
        path.append({**pick, "branches": len(group)})
        parent = pick["id"]
    return path


def siblings(rows: list[dict], message_id: int) -> list[dict]:
    """The group of `message_id` (itself included) in branch order; [] if it is not there."""
    parent = next((r["parent_id"] for r in rows if r["id"] == message_id), -1)
    return [] if parent == -1 else _children(rows)[parent]
