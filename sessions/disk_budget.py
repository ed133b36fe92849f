"""The snapshot files' disk budget: the oldest snapshots go first, never one being written."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sessions.snapshots import SnapshotFiles
from sessions.store import Store

log = logging.getLogger(__name__)


class DiskBudget:
    """Keeps the snapshot files within `budget_bytes` by deleting the oldest (file and row).

    Another session's snapshot is deleted only under that session's gate, taken without
    waiting: a held gate means its snapshot is being written, restored or discarded right now
    (its file may be new and its row not yet), so it is skipped and the next write tries again.
    `gate(sid)` is the session's lock, `where(sid)` where its KV is once the snapshot is gone
    ('resident', 'persisted' while a host copy waits, or 'cold'), `on_state` records that.
    """

    def __init__(
        self,
        budget_bytes: int,
        files: SnapshotFiles,
        store: Store,
        gate: Callable[[str], threading.Lock],
        where: Callable[[str], str],
        on_state: Callable[[str, str], None],
    ) -> None:
        self.budget_bytes = budget_bytes
        self.files = files
        self.store = store
        self.gate = gate
        self.where = where
        self.on_state = on_state

    def enforce(self, keep: str, size: int) -> bool:
        """Delete the oldest snapshots other than `keep`'s (just written, `size` bytes; the
        caller holds its gate) until the budget holds. False, with `keep`'s snapshot deleted,
        if it alone is over budget: then nothing else is deleted for it."""
        if size > self.budget_bytes:
            self.files.delete(keep)
            self.store.delete_snapshot(keep)
            return False
        if self.files.total_bytes() <= self.budget_bytes:
            return True
        held = self.gate(keep)
        for row in self.store.snapshots():  # oldest first
            if row["session_id"] != keep:
                self._evict(row, held)
            if self.files.total_bytes() <= self.budget_bytes:
                return True
        # Still over: by snapshots being written or restored (each write enforces the budget
        # itself once done) or files no row lists (start-up reconciles them). This one fits.
        over = self.files.total_bytes() - self.budget_bytes
        log.info("disk budget: %d bytes over; the next write retries", over)
        return True

    def _evict(self, row: dict, held: threading.Lock) -> None:
        sid = row["session_id"]
        gate = self.gate(sid)
        mine = gate is held  # same stripe as the session written: our caller holds it already
        if not mine and not gate.acquire(blocking=False):
            log.debug("disk budget: session %s is being written or restored; skipped", sid)
            return
        try:
            now = self.store.get_snapshot(sid)
            if now is None or now["created"] != row["created"]:  # gone or rewritten since listed
                return
            self.files.delete(sid)
            self.store.delete_snapshot(sid)
            self.on_state(sid, self.where(sid))  # cold, unless it is resident or in host memory
            log.info("disk budget: deleted the snapshot of session %s", sid)
        finally:
            if not mine:
                gate.release()
