"""API keys per user: issued once in clear, stored as a sha256, listed with their last use,
revocable. Keys are 256 random bits, so a plain sha256 is enough (no salt, no slow hash)."""

from __future__ import annotations

import hashlib
import secrets
import threading
import time

from sessions.store import Store

PREFIX = "cc-"
TOUCH_EVERY_S = 60.0  # last_used is written at most this often per key
NAME_CHARS = 60
PUBLIC = ("id", "owner", "name", "created", "last_used", "revoked")


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def looks_like_key(token: str) -> bool:
    """`cc-` and 43 URL-safe base64 characters, as `issue` makes them."""
    return token.startswith(PREFIX) and len(token) == len(PREFIX) + 43


class ApiKeys:
    """The `api_keys` table: issue, list, revoke and verify, through the store's one writer."""

    def __init__(self, store: Store, touch_every_s: float = TOUCH_EVERY_S) -> None:
        self.store = store
        self.touch_every_s = touch_every_s
        self._touched: dict[str, float] = {}  # key id -> when last_used was last written
        self._lock = threading.Lock()

    def issue(self, owner: str, name: str) -> tuple[dict, str]:
        """A new key for `owner`: (its public row, the key itself, shown only now)."""
        key = PREFIX + secrets.token_urlsafe(32)
        row = {
            "id": "key_" + secrets.token_hex(6),
            "owner": owner,
            "name": (name.strip() or "key")[:NAME_CHARS],
            "hash": key_hash(key),
            "created": time.time(),
            "last_used": None,
            "revoked": None,
        }
        self.store.sql.write(lambda db: db.table("api_keys").insert(row))
        return {k: row[k] for k in PUBLIC}, key

    def list(self, owner: str | None) -> list[dict]:
        """`owner`'s keys (everyone's with None), newest first; never the hashes."""
        where, args = ("owner = ?", [owner]) if owner is not None else (None, [])
        rows = (
            self.store.sql.reader()
            .table("api_keys")
            .rows_where(where, args, order_by="created desc", select=", ".join(PUBLIC))
        )
        return list(rows)

    def revoke(self, owner: str | None, key_id: str) -> bool:
        """Revoke `key_id` if it is `owner`'s (anyone's with None) and active."""
        sql = "UPDATE api_keys SET revoked = ? WHERE id = ? AND revoked IS NULL"
        args: list = [time.time(), key_id]
        if owner is not None:
            sql, args = sql + " AND owner = ?", [*args, owner]
        return self.store.sql.write(lambda db: db.execute(sql, args).rowcount) == 1

    def revoke_all(self, owner: str) -> int:
        """Revoke every active key of `owner`; how many there were."""
        sql = "UPDATE api_keys SET revoked = ? WHERE owner = ? AND revoked IS NULL"
        return self.store.sql.write(lambda db: db.execute(sql, [time.time(), owner]).rowcount)

    def verify(self, key: str) -> str | None:
        """The owner of an active `key`, or None. Blocks on a write at most once a minute
        per key (last_used); call it off the event loop."""
        if not looks_like_key(key):
            return None
        rows = list(
            self.store.sql.reader()
            .table("api_keys")
            .rows_where("hash = ? AND revoked IS NULL", [key_hash(key)], select="id, owner")
        )
        if not rows:
            return None
        key_id, now = rows[0]["id"], time.time()
        with self._lock:
            due = now - self._touched.get(key_id, 0.0) >= self.touch_every_s
            if due:
                self._touched[key_id] = now
        if due:
            self.store.sql.write(
                lambda db: db.execute(
                    "UPDATE api_keys SET last_used = ? WHERE id = ?", [now, key_id]
                )
            )
        return rows[0]["owner"]
