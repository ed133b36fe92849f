"""How the store reads rows back, and its records of snapshot files (the files themselves:
sessions.snapshots)."""

from __future__ import annotations

import json
import time

from sqlite_utils.db import NotFoundError

from sessions.sqlite_worker import SQLiteWorker


def dumps(value: dict | None) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def decoded(row: dict) -> dict:
    """A row with its JSON `fingerprint` column parsed back into a dict."""
    if isinstance(row.get("fingerprint"), str):
        row["fingerprint"] = json.loads(row["fingerprint"])
    return row


class Records:
    """The store's row readers, and the `snapshots` table: one row per session whose KV is in
    a snapshot file."""

    sql: SQLiteWorker

    def _rows(self, table: str, where: str | None, args: list, order_by: str) -> list[dict]:
        rows = self.sql.reader().table(table).rows_where(where, args, order_by=order_by)
        return [decoded(row) for row in rows]

    def _get(self, table: str, key: str) -> dict | None:
        try:
            return decoded(self.sql.reader().table(table).get(key))
        except NotFoundError:
            return None

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
            "fingerprint": dumps(fingerprint),
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
