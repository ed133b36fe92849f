"""Durable sessions, messages and snapshot records in SQLite: one writer thread, many readers."""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Self, TypeVar

from sqlite_utils import Database
from sqlite_utils.db import NotFoundError

log = logging.getLogger(__name__)

T = TypeVar("T")

STATES = ("active", "resident", "persisted", "cold")
BUSY_TIMEOUT_MS = 5000
SESSION_FIELDS = frozenset(
    {"owner", "title", "last_active", "state", "token_count", "fingerprint", "system_prompt"}
)
MESSAGE_FIELDS = frozenset({"role", "content", "token_count", "finish_reason"})


# Migrations: each runs once, in order, in its own transaction; never edit one that shipped,
# append a new one instead. Applied names are recorded in `_migrations`.


def m001_sessions(db: Database) -> None:
    db.table("sessions").create(
        {
            "id": str, "owner": str, "title": str, "created": float, "last_active": float,
            "state": str, "token_count": int, "fingerprint": str, "system_prompt": str,
        },
        pk="id",
        not_null=["owner", "title", "created", "last_active", "state", "token_count"],
        defaults={"state": "active", "token_count": 0, "title": "", "system_prompt": ""},
    )
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
    )


MIGRATIONS: list[Callable[[Database], None]] = [m001_sessions, m002_messages, m003_snapshots]


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


def _dumps(value: dict | None) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def _decoded(row: dict) -> dict:
    """A row with its JSON `fingerprint` column parsed back into a dict."""
    if isinstance(row.get("fingerprint"), str):
        row["fingerprint"] = json.loads(row["fingerprint"])
    return row


def _session_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """Checked session columns, with a fingerprint dict encoded as JSON."""
    assert fields.keys() <= SESSION_FIELDS, f"unknown session fields {fields.keys()}"
    assert fields.get("state", "active") in STATES, f"bad state {fields['state']!r}"
    if isinstance(fields.get("fingerprint"), dict):
        fields = {**fields, "fingerprint": _dumps(fields["fingerprint"])}
    return fields


_STOP = object()


class Store:
    """crowdchat's SQLite database: every write on one writer thread, reads on per-thread
    read-only connections. Write methods block until their transaction has committed
    (synchronous=FULL, so it survives SIGKILL and power loss) and re-raise its error.
    Rows come back as dicts; `fingerprint` columns are decoded from JSON.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._local = threading.local()
        self._readers: weakref.WeakSet[Database] = weakref.WeakSet()
        ready: Future[None] = Future()
        self._writer = threading.Thread(
            target=self._run_writer, args=(ready,), name="crowdchat-store-writer", daemon=True
        )
        self._writer.start()
        try:
            ready.result()
        except BaseException:
            self._closed = True
            self._writer.join()
            raise


    def _run_writer(self, ready: Future[None]) -> None:
        try:
            db = Database(self.path, execute_plugins=False)
            db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            db.enable_wal()
            db.execute("PRAGMA synchronous=FULL")
            migrate(db)
        except BaseException as exc:  # noqa: BLE001 - raised again by the constructor
            ready.set_exception(exc)
            return
        ready.set_result(None)
        try:
            while (job := self._jobs.get()) is not _STOP:
                fn, future = job
                try:
                    with db.atomic():
                        result = fn(db)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller; writer goes on
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        finally:
            db.close()

    def _write(self, fn: Callable[[Database], T]) -> T:
        """Run `fn(db)` in one transaction on the writer thread and wait for its commit."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"store {self.path} is closed")
            self._jobs.put((fn, future))
        return future.result()


    def _reader(self) -> Database:
        db = getattr(self._local, "db", None)
        if db is None:
            if self._closed:
                raise RuntimeError(f"store {self.path} is closed")
            conn = sqlite3.connect(
                self.path.resolve().as_uri() + "?mode=ro", uri=True, check_same_thread=False
            )
            conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            db = self._local.db = Database(conn, execute_plugins=False)
            # A reader dies with its thread (sqlite3 connections sit in a reference cycle, so
            # close explicitly rather than wait for gc); close() closes those still alive.
            weakref.finalize(db, conn.close)
            self._readers.add(db)
        return db

    def _rows(self, table: str, where: str | None, args: list, order_by: str) -> list[dict]:
        rows = self._reader().table(table).rows_where(where, args, order_by=order_by)
        return [_decoded(row) for row in rows]

    def _get(self, table: str, key: str) -> dict | None:
        try:
            return _decoded(self._reader().table(table).get(key))
        except NotFoundError:
            return None


    def create_session(self, id: str, owner: str, title: str, system_prompt: str) -> dict:
        """Insert a new active session; raises sqlite3.IntegrityError if `id` exists."""
        now = time.time()
        row = {
            "id": id, "owner": owner, "title": title, "created": now, "last_active": now,
            "state": "active", "token_count": 0, "fingerprint": None,
            "system_prompt": system_prompt,
        }
        self._write(lambda db: db.table("sessions").insert(row))
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

    def update_session(self, id: str, **fields: Any) -> None:
        """Set `fields` on session `id`; raises sqlite_utils NotFoundError if it is absent."""
        fields = _session_fields(fields)
        self._write(lambda db: db.table("sessions").update(id, fields))

    def delete_session(self, id: str) -> None:
        """Delete session `id` with its messages and snapshot row (not the snapshot file)."""

        def delete(db: Database) -> None:
            db.table("messages").delete_where("session_id = ?", [id])
            db.table("snapshots").delete_where("session_id = ?", [id])
            db.table("sessions").delete_where("id = ?", [id])

        self._write(delete)


    def add_message(
        self,
        session_id: str,
        role: str,
        content: str,
        token_count: int = 0,
        finish_reason: str | None = None,
        session_fields: dict[str, Any] | None = None,
    ) -> int:
        """Append a message and return its id once it is committed to disk. With
        `session_fields` the session row is updated in the same transaction (one fsync)."""
        row = {
            "session_id": session_id, "role": role, "content": content,
            "token_count": token_count, "created": time.time(), "finish_reason": finish_reason,
        }
        fields = _session_fields(session_fields or {})

        def write(db: Database) -> int | None:
            rowid = db.table("messages").insert(row).last_rowid
            if fields:
                db.table("sessions").update(session_id, fields)
            return rowid

        rowid = self._write(write)
        assert rowid is not None
        return rowid

    def update_message(self, id: int, **fields: Any) -> None:
        """Set `fields` on message `id`; raises sqlite_utils NotFoundError if it is absent."""
        assert fields.keys() <= MESSAGE_FIELDS, f"unknown message fields {fields.keys()}"
        self._write(lambda db: db.table("messages").update(id, fields))

    def delete_message(self, id: int) -> None:
        """Delete message `id` (regenerating replaces the last reply)."""
        self._write(lambda db: db.table("messages").delete_where("id = ?", [id]))

    def replace_reply(self, session_id: str, reply_ids: list[int],
                      edit: tuple[int, str] | None = None,
                      session_fields: dict[str, Any] | None = None) -> None:
        """Delete a turn's reply rows and, for an edit `(message id, text)`, rewrite its user
        message, with the session's fields, in one transaction: all of it or nothing."""
        fields = _session_fields(session_fields or {})

        def write(db: Database) -> None:
            for id in reply_ids:
                db.table("messages").delete_where("id = ? AND session_id = ?", [id, session_id])
            if edit is not None:
                db.table("messages").update(edit[0], {"content": edit[1]})
            if fields:
                db.table("sessions").update(session_id, fields)

        self._write(write)

    def messages(self, session_id: str) -> list[dict]:
        """The session's messages in the order they were added."""
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
            "session_id": session_id, "path": str(path), "bytes": bytes, "tokens": tokens,
            "token_hash": token_hash, "fingerprint": _dumps(fingerprint), "created": time.time(),
        }
        self._write(lambda db: db.table("snapshots").upsert(row, pk="session_id"))

    def get_snapshot(self, session_id: str) -> dict | None:
        """The session's snapshot record, or None."""
        return self._get("snapshots", session_id)

    def delete_snapshot(self, session_id: str) -> None:
        """Forget the session's snapshot record (not the file)."""
        self._write(lambda db: db.table("snapshots").delete_where("session_id = ?", [session_id]))

    def snapshots(self) -> list[dict]:
        """Every snapshot record, oldest first (eviction order)."""
        return self._rows("snapshots", None, [], "created, session_id")


    def close(self) -> None:
        """Finish queued writes, stop the writer and close every connection. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._jobs.put(_STOP)
        self._writer.join()
        for db in list(self._readers):
            db.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
