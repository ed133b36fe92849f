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


# Counters that triggers keep in step with every write, so /metrics and the admin page read
# a few rows instead of scanning every session (in the same transaction: exact by
# construction). Upserts in a trigger need SQLite 3.24.
_COUNTER_SQL = (
    "CREATE TABLE session_counts (state TEXT PRIMARY KEY, n INTEGER NOT NULL)",
    "INSERT INTO session_counts (state, n) SELECT state, count(*) FROM sessions GROUP BY state",
    "CREATE TABLE snapshot_totals"
    " (id INTEGER PRIMARY KEY CHECK (id = 1), files INTEGER NOT NULL, bytes INTEGER NOT NULL)",
    "INSERT INTO snapshot_totals (id, files, bytes)"
    " SELECT 1, count(*), coalesce(sum(bytes), 0) FROM snapshots",
    "CREATE TRIGGER session_counts_insert AFTER INSERT ON sessions BEGIN"
    " INSERT INTO session_counts (state, n) VALUES (NEW.state, 1)"
    " ON CONFLICT (state) DO UPDATE SET n = n + 1; END",
    "CREATE TRIGGER session_counts_delete AFTER DELETE ON sessions BEGIN"
    " UPDATE session_counts SET n = n - 1 WHERE state = OLD.state; END",
    "CREATE TRIGGER session_counts_update AFTER UPDATE OF state ON sessions"
    " WHEN OLD.state IS NOT NEW.state BEGIN"
    " UPDATE session_counts SET n = n - 1 WHERE state = OLD.state;"
    " INSERT INTO session_counts (state, n) VALUES (NEW.state, 1)"
    " ON CONFLICT (state) DO UPDATE SET n = n + 1; END",
    "CREATE TRIGGER snapshot_totals_insert AFTER INSERT ON snapshots BEGIN"
    " UPDATE snapshot_totals SET files = files + 1, bytes = bytes + NEW.bytes; END",
    "CREATE TRIGGER snapshot_totals_delete AFTER DELETE ON snapshots BEGIN"
    " UPDATE snapshot_totals SET files = files - 1, bytes = bytes - OLD.bytes; END",
    "CREATE TRIGGER snapshot_totals_update AFTER UPDATE OF bytes ON snapshots BEGIN"
    " UPDATE snapshot_totals SET bytes = bytes + NEW.bytes - OLD.bytes; END",
    # the admin page's most recent sessions, read in index order
    "CREATE INDEX sessions_recent ON sessions (last_active, created)",
)


def m005_counters(db: Database) -> None:
    for sql in _COUNTER_SQL:  # one statement each: executescript would commit mid-migration
        db.execute(sql)


# Messages form a tree: a regenerated reply or an edited message is a sibling of the one it
# replaces (same parent), numbered by `branch` among them; `selected` marks the sibling each
# group shows, and the active path (what the model sees, the API and transcripts show) follows
# the selected child from the root. Every existing message becomes branch 1 of its slot.
_BRANCH_SQL = (
    "ALTER TABLE messages ADD COLUMN parent_id INTEGER",
    "ALTER TABLE messages ADD COLUMN branch INTEGER NOT NULL DEFAULT 1",
    "ALTER TABLE messages ADD COLUMN selected INTEGER NOT NULL DEFAULT 1",
    "UPDATE messages SET parent_id = (SELECT max(p.id) FROM messages p"
    " WHERE p.session_id = messages.session_id AND p.id < messages.id)",
    "CREATE INDEX messages_parent ON messages (session_id, parent_id)",
)


def m006_branches(db: Database) -> None:
    for sql in _BRANCH_SQL:
        db.execute(sql)


def m007_shared_prompts(db: Database) -> None:
    # system prompts an operator marked shared on the admin page (their KV is shared by all)
    db.execute(
        "CREATE TABLE shared_prompts ("
        " id INTEGER PRIMARY KEY AUTOINCREMENT, text TEXT NOT NULL UNIQUE, created REAL NOT NULL)"
    )


# Full-text search (sessions.search): messages through an external-content FTS5 table on
# their id (an INTEGER PRIMARY KEY: stable), titles in a table of their own keyed by the
# session id (a sessions rowid may change on VACUUM). Triggers keep both current.
_SEARCH_SQL = (
    "CREATE VIRTUAL TABLE messages_fts USING fts5(content, content='messages', content_rowid='id')",
    "INSERT INTO messages_fts (messages_fts) VALUES ('rebuild')",
    "CREATE TRIGGER messages_fts_insert AFTER INSERT ON messages BEGIN"
    " INSERT INTO messages_fts (rowid, content) VALUES (NEW.id, NEW.content); END",
    "CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN"
    " INSERT INTO messages_fts (messages_fts, rowid, content)"
    " VALUES ('delete', OLD.id, OLD.content); END",
    "CREATE TRIGGER messages_fts_update AFTER UPDATE OF content ON messages BEGIN"
    " INSERT INTO messages_fts (messages_fts, rowid, content)"
    " VALUES ('delete', OLD.id, OLD.content);"
    " INSERT INTO messages_fts (rowid, content) VALUES (NEW.id, NEW.content); END",
    "CREATE VIRTUAL TABLE sessions_fts USING fts5(title, session_id UNINDEXED)",
    "INSERT INTO sessions_fts (title, session_id) SELECT title, id FROM sessions",
    "CREATE TRIGGER sessions_fts_insert AFTER INSERT ON sessions BEGIN"
    " INSERT INTO sessions_fts (title, session_id) VALUES (NEW.title, NEW.id); END",
    "CREATE TRIGGER sessions_fts_delete AFTER DELETE ON sessions BEGIN"
    " DELETE FROM sessions_fts WHERE session_id = OLD.id; END",
    "CREATE TRIGGER sessions_fts_update AFTER UPDATE OF title ON sessions BEGIN"
    " UPDATE sessions_fts SET title = NEW.title WHERE session_id = OLD.id; END",
)


def m008_search(db: Database) -> None:
    for sql in _SEARCH_SQL:
        db.execute(sql)


def m009_settings(db: Database) -> None:
    # a conversation's sampling settings (sessions.chat_settings, JSON; NULL: the owner's last
    # choice when it was created, or the defaults) and each owner's last choice
    db.execute("ALTER TABLE sessions ADD COLUMN settings TEXT")
    db.execute(
        "CREATE TABLE owner_settings"
        " (owner TEXT PRIMARY KEY, settings TEXT NOT NULL, updated REAL NOT NULL)"
    )


def m010_shares(db: Database) -> None:
    # read-only links (sessions.shares): a copy of the active branch as it was when shared,
    # JSON; `revoked` set when its owner takes it back (the copy is then dropped)
    db.execute(
        "CREATE TABLE shares (token TEXT PRIMARY KEY, session_id TEXT NOT NULL,"
        " owner TEXT NOT NULL, title TEXT NOT NULL, messages TEXT, created REAL NOT NULL,"
        " revoked REAL)"
    )
    db.execute("CREATE INDEX shares_session ON shares (session_id)")


def m011_user_records(db: Database) -> None:
    # with --auth (sessions.user_records): each user's last sign-in, and every change an
    # admin made to the users (who, to whom, what)
    db.execute("CREATE TABLE sign_ins (name TEXT PRIMARY KEY, last REAL NOT NULL)")
    db.execute(
        "CREATE TABLE user_changes (id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL,"
        " actor TEXT NOT NULL, user TEXT NOT NULL, action TEXT NOT NULL)"
    )


MIGRATIONS: list[Callable[[Database], None]] = [
    m001_sessions,
    m002_messages,
    m003_snapshots,
    m004_api_keys,
    m005_counters,
    m006_branches,
    m007_shared_prompts,
    m008_search,
    m009_settings,
    m010_shares,
    m011_user_records,
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
