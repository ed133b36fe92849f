"""What crowdchat's data dir holds after a kill, read as `bench/crash_load.py` checks it:
acknowledged things missing from SQLite, snapshot files and rows that do not match, states
that lie, and a session's transcript as the model sees it."""

from __future__ import annotations

import inspect
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from sessions.branches import active_path
from sessions.snapshots import SUFFIX, TEMP_SUFFIX


@dataclass(frozen=True)
class Ack:
    """Something the server acknowledged: a session ('session'), a user message whose turn got
    its 200 ('user'), or a finished reply ('assistant') to the user message `after`. `shown`:
    the content as the chat page shows it, which Gradio's Chatbot passes through
    `inspect.cleandoc` (leading and trailing blank lines and common indentation go)."""

    sid: str
    role: str
    content: str = ""
    after: str | None = None
    shown: bool = False


@dataclass
class Db:
    """What crowdchat.db holds, read once."""

    sessions: dict[str, dict]
    messages: dict[str, list[dict]]  # session id -> rows in id order
    snapshots: dict[str, dict]  # session id -> snapshot row


def read_db(path: Path) -> Db:
    """Read crowdchat.db read-only (the server may be running: WAL readers do not block it)."""
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        sessions = {r["id"]: dict(r) for r in db.execute("SELECT * FROM sessions")}
        messages: dict[str, list[dict]] = {}
        for r in db.execute("SELECT * FROM messages ORDER BY id"):
            messages.setdefault(r["session_id"], []).append(dict(r))
        snapshots = {r["session_id"]: dict(r) for r in db.execute("SELECT * FROM snapshots")}
    finally:
        db.close()
    return Db(sessions, messages, snapshots)


def lost_acks(db: Db, acks: list[Ack]) -> list[Ack]:
    """The acknowledged things SQLite does not hold (a reply: not as its message's child)."""
    users, replies, shown = set(), set(), set()
    for sid, rows in db.messages.items():
        text = {r["id"]: r["content"] for r in rows}
        for r in rows:
            if r["role"] == "user":
                users.add((sid, r["content"]))
            else:
                replies.add((sid, r["content"], text.get(r["parent_id"])))
                shown.add((sid, inspect.cleandoc(r["content"]), text.get(r["parent_id"])))
    return [
        a
        for a in acks
        if a.sid not in db.sessions
        or (a.role == "user" and (a.sid, a.content) not in users)
        or (
            a.role == "assistant"
            and (a.sid, a.content, a.after) not in (shown if a.shown else replies)
        )
    ]


def snapshot_mismatch(data: Path, db: Db) -> dict[str, list[str]]:
    """Snapshot files without a row, rows without their file, temp files left over."""
    directory = data / "snapshots"
    files = {p.name[: -len(SUFFIX)] for p in directory.glob("*" + SUFFIX)}
    return {
        "files_without_row": sorted(files - db.snapshots.keys()),
        "rows_without_file": sorted(
            sid
            for sid, row in db.snapshots.items()
            if sid not in files or not Path(row["path"]).is_file()
        ),
        "temp_files": sorted(p.name for p in directory.glob("*" + TEMP_SUFFIX)),
    }


def lying_states(db: Db) -> list[str]:
    """Right after a start: sessions said to be resident/active (nothing is), or persisted
    without a snapshot row."""
    return sorted(
        sid
        for sid, s in db.sessions.items()
        if s["state"] in ("active", "resident")
        or (s["state"] == "persisted" and sid not in db.snapshots)
    )


def transcript(db: Db, sid: str) -> list[dict[str, str]]:
    """The session's conversation as the model sees it: its system prompt, the active path."""
    system = db.sessions[sid].get("system_prompt") or ""
    path = active_path(db.messages.get(sid, []))
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": m["role"], "content": m["content"]} for m in path]
