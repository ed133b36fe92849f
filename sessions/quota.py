"""Each user's storage quota: the bytes of text they keep in the database (their messages,
imported ones included, and the copies their live share links hold), so that imports and
share links cannot grow the database without bound. Counted from SQLite when asked (an indexed
scan of the owner's rows), never kept in memory."""

from __future__ import annotations

from sessions.config import SessionConfig
from sessions.errors import RateLimited
from sessions.store import Store

MESSAGES_SQL = (
    "SELECT COALESCE(SUM(LENGTH(CAST(m.content AS BLOB))), 0) FROM messages m"
    " JOIN sessions s ON s.id = m.session_id WHERE s.owner = ?"
)
SHARES_SQL = (
    "SELECT COALESCE(SUM(LENGTH(CAST(messages AS BLOB))), 0) FROM shares"
    " WHERE owner = ? AND revoked IS NULL"
)


class StorageQuota:
    """--max-storage-mb-per-user: what `owner` keeps, and the check before adding to it."""

    def __init__(self, store: Store, config: SessionConfig) -> None:
        self.store = store
        self.limit = int(config.max_storage_mb_per_user * 1e6)

    def used(self, owner: str) -> int:
        """Bytes of text `owner` keeps: messages (every branch) and live share copies."""
        db = self.store.sql.reader()
        messages = db.execute(MESSAGES_SQL, [owner]).fetchone()[0]
        return messages + db.execute(SHARES_SQL, [owner]).fetchone()[0]

    def check(self, owner: str, adding: int, what: str) -> None:
        """RateLimited (429) if `adding` more bytes would take `owner` past the quota; a reply
        in progress may end a little past it (its size is known only at its end)."""
        if not self.limit:
            return
        used = self.used(owner)
        if used + adding > self.limit:
            raise RateLimited(
                f"{what} needs {adding / 1e6:.2f} MB and you keep {used / 1e6:.2f} MB of "
                f"{self.limit / 1e6:.0f} MB (--max-storage-mb-per-user): delete conversations "
                "or revoke share links first"
            )
