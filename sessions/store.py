"""Durable sessions, messages and snapshot records in SQLite: the tables crowdchat keeps."""

from __future__ import annotations

import secrets
import time
from pathlib import Path
from typing import Any, Self

from sqlite_utils import Database

from sessions.branches import END, active_path
from sessions.importing import Conversation
from sessions.migrations import migrate
from sessions.records import Records, decoded, dumps
from sessions.search import search
from sessions.shares import Shares
from sessions.sqlite_worker import SQLiteWorker
from sessions.state import SessionState
from sessions.user_records import UserRecords

SESSION_FIELDS = frozenset(
    {
        "owner", "title", "last_active", "state", "token_count", "fingerprint", "system_prompt",
        "settings",
    }
)  # fmt: skip
MESSAGE_FIELDS = frozenset({"role", "content", "token_count", "finish_reason"})


def _tree(db: Database, session_id: str) -> list[dict]:
    """The session's messages as the branch logic needs them, read in a write transaction."""
    sql = "SELECT id, parent_id, selected FROM messages WHERE session_id = ? ORDER BY id"
    cols = ("id", "parent_id", "selected")
    return [dict(zip(cols, row, strict=True)) for row in db.execute(sql, [session_id])]


def _session_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Checked session columns, with a fingerprint dict encoded as JSON."""
    assert fields.keys() <= SESSION_FIELDS, f"unknown session fields {fields.keys()}"
    assert fields.get("state", "active") in set(SessionState), f"bad state {fields['state']!r}"
    if isinstance(fields.get("fingerprint"), dict):
        fields = {**fields, "fingerprint": dumps(fields["fingerprint"])}
    return fields


class Store(Records):
    """crowdchat's SQLite database: every write on one writer thread, reads on per-thread
    read-only connections (see `SQLiteWorker`). Write methods block until their transaction
    has committed and been fsynced (synchronous=FULL; see docs/RELIABILITY.md) and re-raise its
    error. Rows come back as dicts; `fingerprint` columns are decoded from JSON.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.sql = SQLiteWorker(self.path, setup=migrate, name="crowdchat-store-writer")
        self.shares = Shares(self.sql)
        self.users = UserRecords(self.sql)

    def create_session(
        self, id: str, owner: str, title: str, system_prompt: str, settings: str | None = None
    ) -> dict:
        """Insert a new active session; raises sqlite3.IntegrityError if `id` exists.
        `settings`: its sampling settings as JSON (sessions.chat_settings)."""
        now = time.time()
        row = {
            "id": id,
            "owner": owner,
            "title": title,
            "created": now,
            "last_active": now,
            "state": "active",
            "token_count": 0,
            "fingerprint": None,
            "system_prompt": system_prompt,
        }
        if settings is not None:  # a column of migration 009 (older tables lack it)
            row["settings"] = settings
        self.sql.write(lambda db: db.table("sessions").insert(row))
        return {**row, "settings": settings}

    def get_session(self, id: str) -> dict | None:
        """The session `id`, or None."""
        return self._get("sessions", id)

    def list_sessions(self, owner: str) -> list[dict]:
        """`owner`'s sessions, most recently active first."""
        return self._rows("sessions", "owner = ?", [owner], "last_active desc, created desc")

    def all_sessions(self) -> list[dict]:
        """Every session, most recently active first."""
        return self._rows("sessions", None, [], "last_active desc, created desc")

    def recent_sessions(self, limit: int) -> list[dict]:
        """The `limit` most recently active sessions, most recent first (read in index order,
        whatever the number of sessions)."""
        sql = "SELECT * FROM sessions ORDER BY last_active DESC, created DESC LIMIT ?"
        return [decoded(row) for row in self.sql.reader().query(sql, [limit])]

    def sessions_starting(self, prefix: str, limit: int) -> list[str]:
        """Ids of up to `limit` sessions whose id starts with the hex `prefix`."""
        if not prefix or not all(c in "0123456789abcdef" for c in prefix):
            return []
        sql = "SELECT id FROM sessions WHERE id GLOB ? ORDER BY id LIMIT ?"
        return [row[0] for row in self.sql.reader().execute(sql, [prefix + "*", limit])]

    def search(self, owner: str, text: str, limit: int, marks: tuple[str, str]) -> list[dict]:
        """`owner`'s conversations matching `text` (sessions.search.search)."""
        return search(self.sql.reader(), owner, text, limit, marks)

    def count_sessions(self, owner: str) -> int:
        """How many sessions `owner` has (an index count)."""
        sql = "SELECT count(*) FROM sessions WHERE owner = ?"
        return self.sql.reader().execute(sql, [owner]).fetchone()[0]

    def session_counts(self) -> dict[str, int]:
        """Sessions by state, as the triggers of migration 005 keep them (no scan)."""
        rows = self.sql.reader().execute("SELECT state, n FROM session_counts WHERE n > 0")
        return dict(rows.fetchall())

    def update_session(self, id: str, **fields: Any) -> None:
        """Set `fields` on session `id`; raises sqlite_utils NotFoundError if it is absent."""
        fields = _session_fields(fields)
        self.sql.write(lambda db: db.table("sessions").update(id, fields))

    def owner_settings(self, owner: str) -> str | None:
        """The settings (JSON) `owner` chose last, or None."""
        sql = "SELECT settings FROM owner_settings WHERE owner = ?"
        row = self.sql.reader().execute(sql, [owner]).fetchone()
        return row[0] if row else None

    def put_settings(self, owner: str, session_id: str | None, settings: str) -> None:
        """Record `settings` (JSON) as `owner`'s last choice and, with a session id, as that
        session's settings, in one transaction."""

        def write(db: Database) -> None:
            if session_id is not None:
                db.table("sessions").update(session_id, {"settings": settings})
            db.table("owner_settings").upsert(
                {"owner": owner, "settings": settings, "updated": time.time()}, pk="owner"
            )

        self.sql.write(write)

    def import_conversations(self, owner: str, conversations: list[Conversation]) -> list[str]:
        """Write `conversations` (sessions.importing) as new cold sessions of `owner`, all in
        one transaction: all of them or, on any error, none. Returns their new ids."""
        rows = [
            {
                "id": secrets.token_hex(16),
                "owner": owner,
                "title": c.title,
                "created": c.created,
                "last_active": c.last_active,
                "state": SessionState.COLD,
                "token_count": 0,
                "fingerprint": None,
                "system_prompt": c.system_prompt,
                "settings": c.settings,
            }
            for c in conversations
        ]

        def write(db: Database) -> None:
            for row, convo in zip(rows, conversations, strict=True):
                db.table("sessions").insert(row)
                ids: list[int] = []
                branch: dict[int | None, int] = {}
                for m in convo.messages:
                    parent = None if m.parent is None else ids[m.parent]
                    branch[parent] = branch.get(parent, 0) + 1
                    message = {
                        "session_id": row["id"],
                        "role": m.role,
                        "content": m.content,
                        "token_count": 0,
                        "created": m.created,
                        "finish_reason": m.finish_reason,
                        "parent_id": parent,
                        "branch": branch[parent],
                        "selected": int(m.selected),
                    }
                    ids.append(db.table("messages").insert(message).last_rowid)

        self.sql.write(write)
        return [row["id"] for row in rows]

    def delete_session(self, id: str) -> None:
        """Delete session `id` with its messages and snapshot row (not the snapshot file)."""

        def delete(db: Database) -> None:
            self.shares.forget(db, id)
            db.table("messages").delete_where("session_id = ?", [id])
            db.table("snapshots").delete_where("session_id = ?", [id])
            db.table("sessions").delete_where("id = ?", [id])

        self.sql.write(delete)

    def add_message(
        self,
        session_id: str,
        role: str,
        content: str,
        token_count: int = 0,
        finish_reason: str | None = None,
        session_fields: dict[str, Any] | None = None,
        parent_id: int | None | str = END,
    ) -> int:
        """Add a message after `parent_id` (default: at the end of the active path; None: as
        a first message) and return its id once it is committed to disk. It becomes the
        selected branch of its slot: a sibling of an earlier child of the same parent (a
        regenerated reply, an edited message) stays, unselected. With `session_fields` the
        session row is updated in the same transaction (one fsync)."""
        fields = _session_fields(session_fields or {})

        def write(db: Database) -> int | None:
            parent = parent_id
            if parent == END:
                path = active_path(_tree(db, session_id))
                parent = path[-1]["id"] if path else None
            group = "session_id = ? AND parent_id IS ?"
            n = db.execute(f"SELECT count(*) FROM messages WHERE {group}", [session_id, parent])  # noqa: S608
            branch = n.fetchone()[0] + 1
            db.execute(f"UPDATE messages SET selected = 0 WHERE {group}", [session_id, parent])  # noqa: S608
            row = {
                "session_id": session_id,
                "role": role,
                "content": content,
                "token_count": token_count,
                "created": time.time(),
                "finish_reason": finish_reason,
                "parent_id": parent,
                "branch": branch,
                "selected": 1,
            }
            rowid = db.table("messages").insert(row).last_rowid
            if fields:
                db.table("sessions").update(session_id, fields)
            return rowid

        rowid = self.sql.write(write)
        assert rowid is not None
        return rowid

    def update_message(self, id: int, **fields: Any) -> None:
        """Set `fields` on message `id`; raises sqlite_utils NotFoundError if it is absent."""
        assert fields.keys() <= MESSAGE_FIELDS, f"unknown message fields {fields.keys()}"
        self.sql.write(lambda db: db.table("messages").update(id, fields))

    def select_message(
        self, session_id: str, message_id: int, session_fields: dict[str, Any] | None = None
    ) -> bool:
        """Make `message_id` the selected branch of its slot (the active path then runs
        through it and, below it, through the branches selected there before); False if the
        session has no such message. Nothing is deleted."""
        fields = _session_fields(session_fields or {})

        def write(db: Database) -> bool:
            sql = "SELECT parent_id FROM messages WHERE id = ? AND session_id = ?"
            found = db.execute(sql, [message_id, session_id]).fetchone()
            if found is None:
                return False
            db.execute(
                "UPDATE messages SET selected = (id = ?) WHERE session_id = ? AND parent_id IS ?",
                [message_id, session_id, found[0]],
            )
            if fields:
                db.table("sessions").update(session_id, fields)
            return True

        return self.sql.write(write)

    def messages(self, session_id: str) -> list[dict]:
        """The session's active path, first message first: the conversation as the model,
        the API and the page see it. Each row has `branch` (its number among its siblings)
        and `branches` (how many there are)."""
        return active_path(self.message_tree(session_id))

    def message_tree(self, session_id: str) -> list[dict]:
        """Every message of the session, every branch, in the order they were added."""
        return self._rows("messages", "session_id = ?", [session_id], "id")

    def close(self) -> None:
        """Finish queued writes, stop the writer and close every connection. Idempotent."""
        self.sql.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
