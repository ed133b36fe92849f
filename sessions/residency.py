"""Where sessions' KV lives between turns: the idle sweeper, recovery after a restart,
prefetch when a user opens a conversation, and the admin's persist / drop."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine import Backend
from sessions.config import SessionConfig
from sessions.offload import KVOffloader
from sessions.snapshots import SnapshotFiles
from sessions.state import SessionState
from sessions.store import Store

log = logging.getLogger(__name__)


class Residency:
    """Moves idle sessions' KV out of the pool and back, and records each session's state.

    `is_busy(sid)`: the session has a turn running (its KV is the engine's to manage then,
    and its state is the turn's to record).
    """

    def __init__(
        self,
        engine: Backend,
        config: SessionConfig,
        store: Store,
        files: SnapshotFiles,
        is_busy: Callable[[str], bool],
    ) -> None:
        self.engine = engine
        self.config = config
        self.store = store
        self.is_busy = is_busy
        self.offload = KVOffloader(
            engine,
            store,
            files,
            int(config.kv_host_budget_mb * 2**20),
            int(config.kv_disk_budget_mb * 2**20),
            self.set_state,
        )
        self.recomputes = 0  # turns whose earlier KV was gone and had to be recomputed
        self.recomputes_chosen = 0  # of them, turns whose snapshot was slower to read
        self._recover()
        engine.set_memory_pressure_hook(
            lambda short, protected: self.offload.evict(short, protected, self.is_busy)
        )
        # a turn's restore starts when the turn is asked for and runs while its prompt is built
        # (tokenizing the conversation, writing the message): the disk read overlaps that work;
        # prefetches run here too, and shutdown waits for both
        self._restorer = ThreadPoolExecutor(4, thread_name_prefix="crowdchat-restore")
        self._stop = threading.Event()
        self._sweeper = threading.Thread(
            target=self._sweep_loop, name="crowdchat-sweeper", daemon=True
        )
        self._sweeper.start()

    def restore(self, sid: str, had_kv: bool) -> str:
        """Bring the session's KV back for its turn: 'resident', 'host', 'disk' or 'cold'
        ('upstream' when the backend keeps KV itself: nothing to move here). A session that
        had KV and comes back cold is a recompute, counted here, as is a snapshot left unread
        because recomputing it was faster (then 'cold' too)."""
        if not self.engine.keeps_kv:  # the upstream's prefix cache has it, or recomputes it
            return "upstream"
        source = self.offload.restore(sid)
        if source == "recompute":
            self.recomputes_chosen += 1
            source = "cold"
        if source == "cold" and had_kv:
            self.recomputes += 1
        return source

    def begin_restore(self, sid: str, had_kv: bool) -> Callable[[], str]:
        """Start `restore` on another thread now; the returned call waits for its answer (and
        raises its error)."""
        if not self.engine.keeps_kv:
            return lambda: "upstream"
        return self._restorer.submit(self.restore, sid, had_kv).result

    def prefetch(self, sid: str, state: str) -> None:
        """The user opened this conversation: bring its KV back while they type."""
        if state == SessionState.PERSISTED and self.engine.keeps_kv and not self.is_busy(sid):
            self._restorer.submit(self._prefetch, sid)

    def persist_now(self, sid: str) -> bool:
        """Admin: write the session's KV to disk and free its blocks now."""
        if self.is_busy(sid) or not self.engine.keeps_kv:
            return False
        return self.offload.persist(sid, force=True)  # an explicit request: no backoff

    def drop_kv(self, sid: str) -> None:
        """Admin: forget the session's KV everywhere (its next turn recomputes)."""
        if not self.is_busy(sid):
            self.offload.discard(sid)
            self.set_state(sid, SessionState.COLD)

    def record_where(self, sid: str, record: Callable[[str], None], fallback: str) -> None:
        """`record(state)` of the session's KV (`fallback` when the backend keeps KV itself),
        with no persist, restore or snapshot write of it in between: what it records is true."""
        if self.engine.keeps_kv:
            self.offload.record_where(sid, record)
        else:
            record(fallback)

    def set_state(self, sid: str, state: str) -> None:
        """Record where the session's KV went (ignored while a turn runs or once deleted)."""
        if self.is_busy(sid) or self.store.get_session(sid) is None:
            return
        try:
            self.store.update_session(sid, state=state)
        except Exception:  # noqa: BLE001 - deleted meanwhile
            log.debug("session %s vanished before its state update", sid)

    def stop_sweeper(self) -> None:
        self._stop.set()
        self._sweeper.join()

    def flush(self) -> None:
        """Shutdown: no more evictions; every session's KV goes to disk."""
        self._restorer.shutdown(wait=True)
        self.engine.set_memory_pressure_hook(None)
        self.offload.flush()

    def _prefetch(self, sid: str) -> None:
        try:
            self.offload.restore(sid)  # also 'cold': a damaged snapshot is dropped, not persisted
            # recorded under the session's gate: an eviction or persist right after the restore
            # records its own state after this one, never before
            self.offload.record_where(sid, functools.partial(self.set_state, sid))
        except Exception:  # noqa: BLE001 - a failed prefetch only costs the turn a restore
            log.exception("prefetch of session %s failed", sid)

    def _recover(self) -> None:
        """After a restart no KV is in the pool: sessions are persisted or cold. Snapshot
        files and rows that belong to no session (a delete that raced a write, a crash between
        the file and its row) are deleted first: a deleted conversation leaves nothing."""
        sessions = self.store.all_sessions()
        self.offload.reconcile({row["id"] for row in sessions})
        snaps = {r["session_id"] for r in self.store.snapshots()}
        for row in sessions:
            if row["state"] in (SessionState.ACTIVE, SessionState.RESIDENT) or (
                row["state"] == SessionState.PERSISTED and row["id"] not in snaps
            ):
                self.store.update_session(
                    row["id"],
                    state=SessionState.PERSISTED if row["id"] in snaps else SessionState.COLD,
                )

    def _sweep_loop(self) -> None:
        while not self._stop.wait(self.config.sweep_interval_s):
            try:
                for sid, (_t, _b, idle) in self.engine.resident_kv().items():
                    if idle >= self.config.idle_seconds and not self.is_busy(sid):
                        self.offload.persist(sid)
            except Exception:  # noqa: BLE001 - the sweeper must outlive any one failure
                log.exception("idle sweep failed")
