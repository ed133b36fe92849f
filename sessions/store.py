"""Durable sessions, messages and snapshot records in SQLite: the tables crowdchat keeps."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Self

from sqlite_utils import Database
from sqlite_utils.db import NotFoundError

from sessions.branches import END, active_path
from sessions.migrations import migrate
from sessions.search import search
from sessions.sqlite_worker import SQLiteWorker
from sessions.state import SessionState

SESSION_FIELDS = frozenset(
    {"owner", "title", "last_active", "state", "token_count", "fingerprint", "system_prompt"}
)
MESSAGE_FIELDS = frozenset({"role", "content", "token_count", "finish_reason"})


def _dumps(value: dict | None) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def _decoded(row: dict) -> dict:
    """A row with its JSON `fingerprint` column parsed back into a dict."""
    if isinstance(row.get("fingerprint"), str):
        row["fingerprint"] = json.loads(row["fingerprint"])
    return row


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
        fields = {**fields, "fingerprint": _dumps(fields["fingerprint"])}
    return fields


class Store:
    """crowdchat's SQLite database: every write on one writer thread, reads on per-thread
    read-only connections (see `SQLiteWorker`). Write methods block until their transaction
    has committed and been fsynced (synchronous=FULL; see docs/RELIABILITY.md) and re-raise its
    error. Rows come back as dicts; `fingerprint` columns are decoded from JSON.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self.sql = SQLiteWorker(self.path, setup=migrate, name="crowdchat-store-writer")

    def _rows(self, table: str, where: str | None, args: list, order_by: str) -> list[dict]:
        rows = self.sql.reader().table(table).rows_where(where, args, order_by=order_by)
        return [_decoded(row) for row in rows]

    def _get(self, table: str, key: str) -> dict | None:
        try:
            return _decoded(self.sql.reader().table(table).get(key))
        except NotFoundError:
            return None

    def create_session(self, id: str, owner: str, title: str, system_prompt: str) -> dict:
        """Insert a new active session; raises sqlite3.IntegrityError if `id` exists."""
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
        self.sql.write(lambda db: db.table("sessions").insert(row))
        return dict(row)

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
        return [_decoded(row) for row in self.sql.reader().query(sql, [limit])]

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

    def snapshot_totals(self) -> tuple[int, int]:
        """(snapshot rows, their bytes), kept by triggers (no scan)."""
        return self.sql.reader().execute("SELECT files, bytes FROM snapshot_totals").fetchone()

    def snapshot_bytes(self, session_ids: list[str]) -> dict[str, int]:
        """session id -> its snapshot's bytes, for those of `session_ids` that have one."""
        if not session_ids:
            return {}
        marks = ", ".join("?" * len(session_ids))
        sql = f"SELECT session_id, bytes FROM snapshots WHERE session_id IN ({marks})"  # noqa: S608
        return dict(self.sql.reader().execute(sql, session_ids).fetchall())

    def update_session(self, id: str, **fields: Any) -> None:
        """Set `fields` on session `id`; raises sqlite_utils NotFoundError if it is absent."""
        fields = _session_fields(fields)
        self.sql.write(lambda db: db.table("sessions").update(id, fields))

    def delete_session(self, id: str) -> None:
        """Delete session `id` with its messages and snapshot row (not the snapshot file)."""

        def delete(db: Database) -> None:
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

    def put_snapshot(
        self,
        session_id: str,
        path: str,
        bytes: int,
        tokens: int,
        token_hash: str,
        fingerprint: dict,
    ) -> None:
        """Record (or replace) the session's snapshot file."""
        row = {
            "session_id": session_id,
            "path": str(path),
            "bytes": bytes,
            "tokens": tokens,
            "token_hash": token_hash,
            "fingerprint": _dumps(fingerprint),
            "created": time.time(),
        }
        self.sql.write(lambda db: db.table("snapshots").upsert(row, pk="session_id"))

    def get_snapshot(self, session_id: str) -> dict | None:
        """The session's snapshot record, or None."""
        return self._get("snapshots", session_id)

    def delete_snapshot(self, session_id: str) -> None:
        """Forget the session's snapshot record (not the file)."""
        self.sql.write(
            lambda db: db.table("snapshots").delete_where("session_id = ?", [session_id])
        )

    def snapshots(self) -> list[dict]:
        """Every snapshot record, oldest first (eviction order)."""
        return self._rows("snapshots", None, [], "created, session_id")

    def close(self) -> None:
        """Finish queued writes, stop the writer and close every connection. Idempotent."""
        self.sql.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
