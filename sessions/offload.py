"""Moves idle sessions' KV out of the pool (host RAM, disk) and back, never changing a byte."""

from __future__ import annotations

import logging
import queue
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable

from engine import Backend, KVExport, KVFile, KVFileDamaged, kv_file_bytes
from sessions.disk_budget import DiskBudget
from sessions.kv_writer import SnapshotWriter, kv_bytes
from sessions.persist_retry import PersistRetry, PersistStatus, RetryPolicy
from sessions.snapshots import SnapshotFiles
from sessions.state import SessionState
from sessions.store import Store

log = logging.getLogger(__name__)
RESTORE_STRIPES = 64
TOMBSTONES = 4096  # deleted session ids remembered; ids are random, so never reused
CRASHES_UNHEALTHY = 3  # writer crashes in a row without one clean pass
# A snapshot is read unless recomputing its tokens is predicted this many times faster: a
# recompute takes steps every user shares, a read only the returning user's thread.
RECOMPUTE_COST = 2.0
PROBE_EVERY = 16  # every so many recomputes chosen over the disk, read anyway: its pace moves


def recompute_is_faster(read_s: float | None, recompute_s: float | None) -> bool:
    """Whether recomputing a conversation beats reading its snapshot, by the engine's
    predictions of both (None: not known yet, so the snapshot is read)."""
    return read_s is not None and recompute_s is not None and read_s > RECOMPUTE_COST * recompute_s


class KVOffloader(SnapshotWriter):
    """The tiers below the KV pool: host RAM (CUDA only) and snapshot files on disk.

    `persist` (idle sweeper) writes synchronously and frees the pool only once the file is
    durable, so a failed write leaves the session resident. `evict` runs on the engine thread
    under memory pressure: it copies KV to host memory, frees the blocks at once, and a writer
    thread makes the copy durable; until then a returning user restores from that copy.
    """

    def __init__(
        self,
        engine: Backend,
        store: Store,
        files: SnapshotFiles,
        host_budget_bytes: int,
        disk_budget_bytes: int,
        on_state: Callable[[str, str], None],
        retry: RetryPolicy = RetryPolicy(),
    ) -> None:
        self.engine = engine
        self.store = store
        self.files = files
        self.fingerprint = engine.kv_fingerprint
        self.pin = engine.device_type == "cuda"
        self.host_budget = host_budget_bytes if self.pin else 0
        self.disk_budget = disk_budget_bytes
        self.on_state = on_state  # (session id, new state), under its gate: the manager records it
        # (session id, token ids) -> the prefix-cache namespace and shareable prefix its KV
        # is loaded under (the manager sets it; by default nothing of it is shared)
        self.cache_key: Callable[[str, list[int]], tuple[str | None, int]] = lambda s, i: (None, 0)
        self.host: OrderedDict[str, KVExport] = OrderedDict()  # LRU first
        self.lock = threading.Lock()  # guards `host`; never held while waiting on others
        # one persist, restore, write or discard per session at a time (so a discard waits for
        # a write in flight, then deletes what it wrote); striped: the table never grows.
        # Never taken on the engine thread: a holder may be waiting for that thread.
        self._gates = [threading.Lock() for _ in range(RESTORE_STRIPES)]
        self.disk = DiskBudget(disk_budget_bytes, files, store, self._gate, self._where, on_state)
        self._deleted: OrderedDict[str, None] = OrderedDict()  # guarded by `lock`
        self.last_error: str | None = None
        self.restores = {"host": 0, "disk": 0}
        self._recompute_choices = 0  # snapshots left unread (every PROBE_EVERY-th is read)
        self.weigh_recompute = True  # False: always read a snapshot (bench/restore.py times it)
        self.persists = 0
        self.evictions = 0
        self.failures = 0
        self.restore_errors = 0  # restores that failed for a reason other than a bad file
        self.last_restore_error: str | None = None
        self.retry = PersistRetry(retry)  # sessions whose last write failed wait before the next
        self.writer_restarts = 0  # times the writer loop crashed and was restarted
        self._crashes_in_a_row = 0
        self._jobs: queue.Queue[str | None] = queue.Queue()
        self._writer = threading.Thread(
            target=self._supervise_writer, name="crowdchat-kv-writer", daemon=True
        )
        self._writer.start()

    # -- out of the pool ----------------------------------------------------------------
    def persist(self, sid: str, force: bool = False) -> bool:
        """Write a resident session's KV to disk, then free its blocks (False: stays put).
        A session whose last write failed is skipped (not even exported) until its retry time,
        unless `force` (shutdown, an admin's explicit request)."""
        with self._gate(sid):
            if self._gone(sid):  # a late turn's KV of a deleted conversation
                self.engine.drop_kv(sid)
                return False
            if not force and self.retry.waiting(sid):
                return False
            kv = self.engine.export_kv(sid)
            if kv is None or not self._write(sid, kv):
                return False
            # recorded before the blocks go: whoever sees the pool without it reads 'persisted'
            self.on_state(sid, SessionState.PERSISTED)
            self.engine.drop_kv(sid)
        return True

    def evict(self, short: int, protected: str | None, busy: Callable[[str], bool]) -> None:
        """Engine thread, pool full: move idle resident KV (LRU first) to host memory."""
        for sid, (_tokens, blocks, _idle) in self.engine.resident_kv().items():
            if short <= 0:
                break
            if sid == protected or busy(sid):
                continue
            kv = self.engine.export_kv(sid)
            if kv is None:
                continue
            if self._gone(sid):
                self.engine.drop_kv(sid)
                continue
            if self.pin:
                kv = KVExport(kv.token_ids, kv.k.pin_memory(), kv.v.pin_memory())
            self.engine.drop_kv(sid)
            self.evictions += 1
            short -= blocks
            with self.lock:
                self.host[sid] = kv
            self._jobs.put(sid)  # the writer decides: keep in host RAM or write to disk

    # -- back into the pool -------------------------------------------------------------
    def restore(self, sid: str) -> str:
        """Make the session's KV resident if it is anywhere: 'resident', 'host', 'disk',
        'recompute' when a snapshot exists but recomputing its tokens is faster than reading it
        (the file stays), or 'cold' when nothing valid exists (the engine then recomputes the
        prefix)."""
        with self._gate(sid):  # a prefetch and the turn itself never load the same file twice
            if self._gone(sid):
                return "cold"
            try:
                return self._restore(sid)
            except Exception as e:  # noqa: BLE001 - loud, but the user is still served
                self.restore_errors += 1
                when = time.strftime("%H:%M:%S")
                self.last_restore_error = self.last_error = (
                    f"{when} restoring {sid[:8]} failed: {type(e).__name__}: {e}"
                )
                log.exception("restoring session %s failed unexpectedly; it recomputes", sid)
                return "cold"

    def _restore(self, sid: str) -> str:
        if sid in self.engine.resident_kv():
            return "resident"
        with self.lock:
            kv = self.host.get(sid)
        if kv is not None and self.engine.import_kv(sid, kv, *self.cache_key(sid, kv.token_ids)):
            with self.lock:
                self.host.pop(sid, None)
            self.restores["host"] += 1
            return "host"
        row = self.store.get_snapshot(sid)
        if row is None:
            return "cold"
        kv = self.files.kv_file(sid, self.fingerprint, row["token_hash"])
        if kv is not None and self._recompute_wins(kv):
            return "recompute"
        try:
            if kv is not None and not self.engine.import_kv_file(
                sid, kv, *self.cache_key(sid, kv.token_ids)
            ):
                return "cold"
        except KVFileDamaged as exc:
            log.warning("snapshot %s: ignored, %s (%s)", sid, exc, kv.path)
            kv = None
        if kv is None:  # damaged, stale or missing: recompute, and forget the file
            self.drop_snapshot(sid)
            return "cold"
        self.restores["disk"] += 1
        return "disk"

    def _recompute_wins(self, kv: KVFile) -> bool:
        """Whether the engine recomputes the snapshot's tokens RECOMPUTE_COST times faster than
        the disk reads it, both at their measured pace (not known yet: read it)."""
        if not self.weigh_recompute:
            return False
        read = self.engine.read_s(kv_file_bytes(kv))
        if not recompute_is_faster(read, self.engine.recompute_s(len(kv.token_ids))):
            return False
        self._recompute_choices += 1
        return self._recompute_choices % PROBE_EVERY != 0

    # -- bookkeeping --------------------------------------------------------------------
    def record_where(self, sid: str, record: Callable[[str], None]) -> None:
        """`record(state)` of the session's KV under its gate; a pool eviction records after."""
        with self._gate(sid):
            record(self._where(sid))

    def host_bytes(self) -> int:
        with self.lock:
            return sum(kv_bytes(kv) for kv in self.host.values())

    def persist_status(self, sid: str) -> PersistStatus | None:
        """Why the session's KV is not on disk (None: its last write, if any, succeeded)."""
        return self.retry.status(sid)

    def persist_failing(self) -> dict[str, PersistStatus]:
        """Every session whose last snapshot write failed (for the admin page)."""
        return self.retry.failing()

    def healthy(self) -> bool:
        """Whether the writer thread runs and is not stuck crashing (for the admin page)."""
        return self._writer.is_alive() and self._crashes_in_a_row < CRASHES_UNHEALTHY

    def discard(self, sid: str, deleted: bool = False) -> None:
        """Forget every copy of the session's KV, also one a write in flight is making.
        `deleted` (the conversation is being deleted) makes it final: a later persist, evict,
        write or restore of `sid` does nothing."""
        with self._gate(sid):  # waits for a persist, write or restore of sid in flight
            if deleted:
                with self.lock:
                    self._deleted[sid] = None
                    while len(self._deleted) > TOMBSTONES:
                        self._deleted.popitem(last=False)
            self.engine.drop_kv(sid)
            with self.lock:
                self.host.pop(sid, None)
            self.drop_snapshot(sid)
            self.retry.forget(sid)

    def reconcile(self, known_session_ids: set[str]) -> int:
        """Start-up: delete snapshot files and rows of no known session, files without a row
        and rows without a file. Returns how many files and rows it deleted."""
        rows = {r["session_id"] for r in self.store.snapshots()}
        on_disk = set(self.files.session_ids())
        doomed_rows = {sid for sid in rows if sid not in known_session_ids or sid not in on_disk}
        doomed_files = {sid for sid in on_disk if sid not in known_session_ids or sid not in rows}
        for sid in doomed_rows:
            self.store.delete_snapshot(sid)
        for sid in doomed_files:
            self.files.delete(sid)
        if doomed_rows or doomed_files:
            log.info(
                "reconcile: deleted %d orphan snapshot file(s) and %d row(s)",
                len(doomed_files),
                len(doomed_rows),
            )
        return len(doomed_rows) + len(doomed_files)

    def drop_snapshot(self, sid: str) -> None:
        self.files.delete(sid)
        self.store.delete_snapshot(sid)

    def flush(self) -> None:
        """Shutdown: write every resident and host-held KV to disk."""
        for sid in list(self.engine.resident_kv()):
            self.persist(sid, force=True)  # last chance: backoff no longer saves anything
        self._jobs.put(None)
        self._writer.join()
        with self.lock:
            pending = list(self.host.items())
            self.host.clear()
        for sid, kv in pending:
            with self._gate(sid):
                ok = self._write(sid, kv)
                self.on_state(sid, SessionState.PERSISTED if ok else SessionState.COLD)

    def _gate(self, sid: str) -> threading.Lock:
        return self._gates[zlib.crc32(sid.encode()) % RESTORE_STRIPES]

    def _gone(self, sid: str) -> bool:
        """Whether the conversation was deleted (its KV must not be written anywhere)."""
        with self.lock:
            if sid in self._deleted:
                return True
        return self.store.get_session(sid) is None

    def _where(self, sid: str) -> str:
        """'resident', 'persisted' (host RAM or a snapshot) or 'cold'; the caller holds the gate."""
        if sid in self.engine.resident_kv():
            return SessionState.RESIDENT
        with self.lock:
            held = sid in self.host
        return SessionState.PERSISTED if held or self.store.get_snapshot(sid) else SessionState.COLD
