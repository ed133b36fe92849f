"""Making KV durable: a session's snapshot write (with the disk budget after it) and the
writer thread that moves host-RAM copies of evicted KV to disk, oldest first. A part of
`KVOffloader` (sessions.offload), which sets the attributes declared here; every method runs
under the session's gate."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from engine import KVExport
from sessions.disk_budget import DiskBudget
from sessions.persist_retry import PersistRetry
from sessions.snapshots import SnapshotFiles, token_hash
from sessions.state import SessionState
from sessions.store import Store

log = logging.getLogger("sessions.offload")


def kv_bytes(kv: KVExport) -> int:
    return (kv.k.numel() * kv.k.element_size()) * 2


class SnapshotWriter:
    """`_write` and the writer thread of `KVOffloader`."""

    store: Store
    files: SnapshotFiles
    disk: DiskBudget
    retry: PersistRetry
    fingerprint: dict
    host: OrderedDict[str, KVExport]
    host_budget: int
    lock: threading.Lock
    on_state: Callable[[str, str], None]
    failures: int
    persists: int
    last_error: str | None
    writer_restarts: int
    _crashes_in_a_row: int
    _jobs: queue.Queue[str | None]
    _gate: Callable[[str], threading.Lock]
    _gone: Callable[[str], bool]
    _where: Callable[[str], str]
    drop_snapshot: Callable[[str], None]

    def _supervise_writer(self) -> None:
        """Restart the writer loop whenever it crashes: if it stayed dead, evicted KV would
        pile up in host RAM and never become durable."""
        while True:
            try:
                self._write_loop()
                return
            except Exception:  # noqa: BLE001 - logged and counted; the loop starts over
                self.writer_restarts += 1
                self._crashes_in_a_row += 1
                log.exception("KV writer crashed (restart %d)", self.writer_restarts)
                time.sleep(min(0.1 * 2**self._crashes_in_a_row, 5.0))  # no hot crash loop

    def _write_loop(self) -> None:
        """Keep host copies within the host budget (0 on CPU): oldest go to disk first."""
        self._drain_host()  # after a restart: what the crashed pass left behind
        while (sid := self._jobs.get()) is not None:
            with self._gate(sid):  # a turn or prefetch may have restored it meanwhile
                if self._where(sid) == SessionState.PERSISTED:
                    self.on_state(sid, SessionState.PERSISTED)
            self._drain_host()

    def _drain_host(self) -> None:
        while True:
            with self.lock:  # one look at `host`: a restore may pop entries at any time
                if not self.host or sum(map(kv_bytes, self.host.values())) <= self.host_budget:
                    break
                victim, kv = next(iter(self.host.items()))
            with self._gate(victim):
                with self.lock:  # restored or discarded before we got the gate: not ours
                    mine = self.host.get(victim) is kv
                ok = mine and self._write(victim, kv)
                with self.lock:
                    if mine and self.host.get(victim) is kv:
                        del self.host[victim]
                if mine and not ok:
                    self.on_state(victim, SessionState.COLD)  # gone; the next turn recomputes
        self._crashes_in_a_row = 0

    def _write(self, sid: str, kv: KVExport) -> bool:
        """Make `kv` the session's snapshot (the caller holds the session's gate)."""
        if self._gone(sid):
            return False
        try:
            path, size = self.files.write(sid, kv.token_ids, kv.k, kv.v, self.fingerprint)
            self.store.put_snapshot(
                sid, str(path), size, len(kv.token_ids), token_hash(kv.token_ids), self.fingerprint
            )
        except Exception as e:  # noqa: BLE001 - disk full, unwritable dir: keep serving
            self.failures += 1
            self.last_error = f"{time.strftime('%H:%M:%S')} persisting {sid[:8]} failed: {e}"
            status = self.retry.failed(sid, f"{type(e).__name__}: {e}")
            log.error(
                "snapshot of session %s failed (%d in a row, next try in %.0f s): %s",
                sid,
                status.failures,
                status.retry_at - time.time(),
                e,
            )
            return False
        if self._gone(sid):  # its row was deleted while we wrote: undo
            self.drop_snapshot(sid)
            return False
        try:  # the file is durable either way; a failed cleanup must not undo that
            kept = self.disk.enforce(keep=sid, size=size)
        except Exception:  # noqa: BLE001 - retried after the next write
            log.exception("enforcing the snapshot disk budget failed")
            kept = True
        if not kept:  # larger than the whole budget: the KV stays where it was
            self.failures += 1
            self.last_error = (
                f"{time.strftime('%H:%M:%S')} persisting {sid[:8]} failed: "
                f"its snapshot alone exceeds --kv-disk-budget-mb"
            )
            self.retry.failed(sid, "the snapshot alone exceeds --kv-disk-budget-mb")
            return False
        self.persists += 1
        self.retry.forget(sid)
        return True
