"""What the store keeps about signed-in users (with --auth): each one's last sign-in, every
change an admin made to the users, and the totals the admin page lists per user."""

from __future__ import annotations

import logging
import time

from sessions.sqlite_worker import SQLiteWorker

log = logging.getLogger(__name__)


class UserRecords:
    """The `sign_ins` and `user_changes` tables (migration 011)."""

    def __init__(self, sql: SQLiteWorker) -> None:
        self.sql = sql

    def signed_in(self, name: str) -> None:
        """`name` signed in just now."""
        row = {"name": name, "last": time.time()}
        self.sql.write(lambda db: db.table("sign_ins").upsert(row, pk="name"))

    def last_sign_ins(self) -> dict[str, float]:
        return dict(self.sql.reader().execute("SELECT name, last FROM sign_ins").fetchall())

    def changed(self, actor: str, user: str, action: str) -> None:
        """Record (and log) that `actor` did `action` to `user`."""
        log.info("users: %s %s %s", actor, action, user)
        row = {"at": time.time(), "actor": actor, "user": user, "action": action}
        self.sql.write(lambda db: db.table("user_changes").insert(row))

    def changes(self, limit: int = 50) -> list[dict]:
        """The latest changes, newest first."""
        sql = "SELECT at, actor, user, action FROM user_changes ORDER BY id DESC LIMIT ?"
        cols = ("at", "actor", "user", "action")
        return [dict(zip(cols, r, strict=True)) for r in self.sql.reader().execute(sql, [limit])]

    def totals(self) -> dict[str, tuple[int, int]]:
        """owner -> (conversations, tokens of the replies they hold), for every `user:` owner."""
        sql = (
            "SELECT s.owner, count(DISTINCT s.id), coalesce(sum(m.token_count), 0)"
            " FROM sessions s LEFT JOIN messages m ON m.session_id = s.id AND m.role = 'assistant'"
            " WHERE s.owner GLOB 'user:*' GROUP BY s.owner"
        )
        return {o: (n, t) for o, n, t in self.sql.reader().execute(sql).fetchall()}
