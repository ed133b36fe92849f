"""The store's schema as numbered migrations, applied once each and recorded in `_migrations`.

Each runs once, in order, in its own transaction; never edit one that shipped, append a new one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlite_utils import Database

log = logging.getLogger(__name__)


def m001_sessions(db: Database) -> None:
    db.table("sessions").create(
        {
            "id": str, "owner": str, "title": str, "created": float, "last_active": float,
            "state": str, "token_count": int, "fingerprint": str, "system_prompt": str,
        },
        pk="id",
        not_null=["owner", "title", "created", "last_active", "state", "token_count"],
        defaults={"state": "active", "token_count": 0, "title": "", "system_prompt": ""},
    )  # fmt: skip
    db.table("sessions").create_index(["owner"])


def m002_messages(db: Database) -> None:
    # AUTOINCREMENT (which sqlite-utils cannot declare) so ids are never reused after deletes.
    db.execute(
        "CREATE TABLE messages ("
        " id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, role TEXT NOT NULL,"
        " content TEXT NOT NULL, token_count INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL,"
        " finish_reason TEXT)"
    )
    db.table("messages").create_index(["session_id"])


def m003_snapshots(db: Database) -> None:
    db.table("snapshots").create(
        {
            "session_id": str, "path": str, "bytes": int, "tokens": int, "token_hash": str,
            "fingerprint": str, "created": float,
        },
        pk="session_id",
        not_null=["path", "bytes", "tokens", "token_hash", "fingerprint", "created"],
    )  # fmt: skip


def m004_api_keys(db: Database) -> None:
    # only the key's sha256 is kept: a key is shown once, when it is issued
    db.table("api_keys").create(
        {
            "id": str, "owner": str, "name": str, "hash": str, "created": float,
            "last_used": float, "revoked": float,
        },
        pk="id",
        not_null=["owner", "name", "hash", "created"],
    )  # fmt: skip
    db.table("api_keys").create_index(["hash"], unique=True)
    db.table("api_keys").create_index(["owner"])


MIGRATIONS: list[Callable[[Database], None]] = [
    m001_sessions,
    m002_messages,
    m003_snapshots,
    m004_api_keys,
]


def migrate(db: Database) -> list[str]:
    """Apply the migrations `db` has not seen yet; returns the names applied."""
    table = db.table("_migrations")
    if not table.exists():
        table.create({"name": str, "applied": float}, pk="name")
    done = {row["name"] for row in table.rows}
    applied = []
    for fn in MIGRATIONS:
        if fn.__name__ in done:
            continue
        with db.atomic():
            fn(db)
            table.insert({"name": fn.__name__, "applied": time.time()})
        log.info("applied migration %s", fn.__name__)
        applied.append(fn.__name__)
    return applied
