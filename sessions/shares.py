"""Read-only links to a conversation. A link is a random, unguessable token (192 bits) naming a
copy of the conversation's active branch as it was when it was shared: what its owner writes
afterwards is not shown (share again for a new link), and nobody reaches the conversation
itself through it. Its owner can list and revoke it; revoking (or deleting the conversation)
drops the copy. A viewer who may chat can continue it as a conversation of their own."""

from __future__ import annotations

import json
import secrets
import time

from sqlite_utils import Database

from engine import InvalidRequest
from sessions.errors import SessionNotFound
from sessions.sqlite_worker import SQLiteWorker

GONE = "this link was revoked, or never existed"
MAX_LINKS_PER_CONVERSATION = 20


class Shares:
    """The `shares` table (migration 010)."""

    def __init__(self, sql: SQLiteWorker) -> None:
        self.sql = sql

    def create(self, owner: str, session: dict, messages: list[dict]) -> dict:
        """A new link to `session`'s active branch `messages` as they are now."""
        if len(self.of_session(owner, session["id"])) >= MAX_LINKS_PER_CONVERSATION:
            raise InvalidRequest(
                f"this conversation has {MAX_LINKS_PER_CONVERSATION} live links: revoke one first"
            )
        row = {
            "token": secrets.token_urlsafe(24),
            "session_id": session["id"],
            "owner": owner,
            "title": session["title"],
            "messages": json.dumps(
                [{"role": m["role"], "content": m["content"]} for m in messages if m["content"]]
            ),
            "created": time.time(),
            "revoked": None,
        }
        self.sql.write(lambda db: db.table("shares").insert(row))
        return {k: row[k] for k in ("token", "session_id", "title", "created")}

    def of_session(self, owner: str, session_id: str) -> list[dict]:
        """The live links `owner` made to the conversation, newest first."""
        sql = (
            "SELECT token, session_id, title, created FROM shares WHERE session_id = ?"
            " AND owner = ? AND revoked IS NULL ORDER BY created DESC"
        )
        cols = ("token", "session_id", "title", "created")
        rows = self.sql.reader().execute(sql, [session_id, owner]).fetchall()
        return [dict(zip(cols, r, strict=True)) for r in rows]

    def read(self, token: object) -> dict:
        """The shared copy: `title`, `created`, `messages` (role, content), `owner`; SessionNotFound
        for a revoked or unknown token (the same answer for both)."""
        if not isinstance(token, str) or not 16 <= len(token) <= 64:
            raise SessionNotFound(GONE)
        sql = (
            "SELECT title, messages, created, owner FROM shares WHERE token = ? AND revoked IS NULL"
        )
        row = self.sql.reader().execute(sql, [token]).fetchone()
        if row is None:
            raise SessionNotFound(GONE)
        return {"title": row[0], "messages": json.loads(row[1]), "created": row[2], "owner": row[3]}

    def revoke(self, owner: str, token: str) -> None:
        """Take the link back (only its owner can); SessionNotFound otherwise."""

        def write(db: Database) -> int:
            return db.execute(
                "UPDATE shares SET revoked = ?, messages = NULL"
                " WHERE token = ? AND owner = ? AND revoked IS NULL",
                [time.time(), token, owner],
            ).rowcount

        if not self.sql.write(write):
            raise SessionNotFound(GONE)

    def forget(self, db: Database, session_id: str) -> None:
        """Inside a deletion's transaction: the conversation's links go with it."""
        db.execute("DELETE FROM shares WHERE session_id = ?", [session_id])
