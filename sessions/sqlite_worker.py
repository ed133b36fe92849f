"""One SQLite file, one writer thread, many readers: the concurrency the store is built on.

SQLite in WAL mode lets readers run beside one writer; funnelling every write through one thread
means writers never contend for the lock (no SQLITE_BUSY under load) and each write is a whole
transaction that commits, or raises to its caller, before the caller goes on.
"""

from __future__ import annotations

import queue
import sqlite3
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from sqlite_utils import Database

T = TypeVar("T")

BUSY_TIMEOUT_MS = 5000
_STOP = object()


class SQLiteWorker:
    """Runs writes on its own thread, one transaction each, and hands out a read-only
    connection per calling thread. The write connection is in WAL mode with synchronous=FULL,
    so a write that returned has been fsynced. `setup(db)` (migrations) runs first, on the
    writer; its error is raised by the constructor.
    """

    def __init__(self, path: Path | str, setup: Callable[[Database], object], name: str) -> None:
        self.path = Path(path)
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._local = threading.local()
        self._readers: weakref.WeakSet[Database] = weakref.WeakSet()
        ready: Future[None] = Future()
        self._writer = threading.Thread(
            target=self._run_writer, args=(setup, ready), name=name, daemon=True
        )
        self._writer.start()
        try:
            ready.result()
        except BaseException:
            self._closed = True
            self._writer.join()
            raise

    def _run_writer(self, setup: Callable[[Database], object], ready: Future[None]) -> None:
        try:
            db = Database(self.path, execute_plugins=False)
            db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
            db.enable_wal()
            db.execute("PRAGMA synchronous=FULL")
            setup(db)
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

    def write(self, fn: Callable[[Database], T]) -> T:
        """Run `fn(db)` in one transaction on the writer thread and wait for its commit."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"store {self.path} is closed")
            self._jobs.put((fn, future))
        return future.result()

    def reader(self) -> Database:
        """This thread's read-only connection (opened on first use)."""
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
