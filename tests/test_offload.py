"""The KV offloader off the happy path, driven by a fake engine (no model, tests/offload_rig.py):
writer crashes, races between a delete and a write, unexpected restore errors, orphan snapshot
files, a snapshot left unread where a recompute is faster."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest

from sessions.kv_writer import kv_bytes
from sessions.offload import PROBE_EVERY, RECOMPUTE_COST
from sessions.persist_retry import PersistRetry, RetryPolicy
from tests.offload_rig import FP, Rig, fake_kv, wait_for


def test_evicted_kv_becomes_durable_after_a_failure_inside_the_writer(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = rig.files.total_bytes
    calls = {"n": 0}

    def fails_once() -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError("injected: listing the snapshot directory failed")
        return real()

    monkeypatch.setattr(rig.files, "total_bytes", fails_once)
    rig.evict(rig.session("first"))
    assert wait_for(lambda: calls["n"] >= 1)
    rig.evict(rig.session("second"))  # a later eviction still reaches the disk
    assert wait_for(lambda: rig.store.get_snapshot("second") is not None)
    assert rig.files.path("second").is_file()
    assert wait_for(lambda: rig.off.host_bytes() == 0)
    assert rig.off.healthy()


def test_a_crashed_writer_loop_is_restarted_counted_and_catches_up(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = rig.off._drain_host
    crashed = threading.Event()

    def crashes_once() -> None:
        if not crashed.is_set():
            crashed.set()
            raise RuntimeError("injected writer bug")
        real()

    monkeypatch.setattr(rig.off, "_drain_host", crashes_once)
    with caplog.at_level(logging.ERROR):
        rig.evict(rig.session("a"))
        # the restarted loop writes what the crashed pass left in host memory
        assert wait_for(lambda: rig.store.get_snapshot("a") is not None)
    assert rig.off.writer_restarts == 1
    assert "KV writer crashed" in caplog.text and "injected writer bug" in caplog.text
    rig.evict(rig.session("b"))
    assert wait_for(lambda: rig.store.get_snapshot("b") is not None)
    assert rig.off.healthy() and rig.off.host_bytes() == 0


def test_a_writer_crashing_every_time_reports_unhealthy(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    def always_crashes() -> None:
        raise RuntimeError("injected writer bug")

    monkeypatch.setattr(rig.off, "_drain_host", always_crashes)
    rig.evict(rig.session("a"))
    assert wait_for(lambda: not rig.off.healthy())
    assert rig.off.writer_restarts >= 3
    monkeypatch.undo()  # fixed: the next restart drains and the writer is healthy again
    assert wait_for(lambda: rig.off.healthy() and rig.store.get_snapshot("a") is not None)


def test_failed_persists_back_off_per_session_and_reset_on_success(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig.off.retry = PersistRetry(RetryPolicy(first_s=0.3, max_s=0.6))
    real = rig.files.write
    attempts = {"n": 0}

    def disk_full(*args: object, **kwargs: object) -> tuple[Path, int]:
        attempts["n"] += 1
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(rig.files, "write", disk_full)
    sid = rig.session("s")
    for _ in range(50):  # a sweeper calling every few ms
        assert rig.off.persist(sid) is False
    assert attempts["n"] == 1 and rig.engine.exports == 1  # skipped, not even exported
    status = rig.off.persist_status(sid)
    assert status is not None and status.failures == 1 and "No space left" in status.last_error
    assert 0 < status.retry_at - time.time() <= 0.3
    assert rig.off.persist_failing() == {sid: status}
    time.sleep(0.35)
    assert rig.off.persist(sid) is False and attempts["n"] == 2
    second = rig.off.persist_status(sid)
    assert second is not None and second.failures == 2
    assert 0.3 < second.retry_at - time.time() <= 0.6  # doubled
    assert rig.off.persist(sid) is False and attempts["n"] == 2
    assert sid in rig.engine.resident  # the KV stays in the pool meanwhile
    monkeypatch.setattr(rig.files, "write", real)  # space freed
    assert rig.off.persist(sid, force=True)  # an explicit request does not wait
    assert rig.off.persist_status(sid) is None and rig.store.get_snapshot(sid) is not None
    assert sid not in rig.engine.resident


def test_retry_policy_doubles_up_to_its_cap() -> None:
    policy = RetryPolicy()
    assert [policy.delay(n) for n in (1, 2, 3, 7, 8, 1000)] == [5, 10, 20, 300, 300, 300]


def test_an_unexpected_restore_error_is_logged_counted_and_the_session_recomputes(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sid = rig.session("s")
    assert rig.off.persist(sid) and sid not in rig.engine.resident

    def engine_bug(*args: object, **kwargs: object) -> None:
        raise RuntimeError("slot out of range")  # the engine's fault, not the file's

    monkeypatch.setattr(rig.engine, "import_kv_file", engine_bug)
    with caplog.at_level(logging.WARNING):
        assert rig.off.restore(sid) == "cold"  # still served: the engine recomputes
    assert rig.off.restore_errors == 1
    assert "slot out of range" in rig.off.last_restore_error
    assert rig.off.last_error == rig.off.last_restore_error  # on the admin page's warnings
    error = next(r for r in caplog.records if r.levelno == logging.ERROR)
    assert error.exc_info is not None and "restoring session s failed" in error.getMessage()
    assert rig.files.path(sid).is_file()  # not the file's fault: it stays
    monkeypatch.undo()
    assert rig.off.restore(sid) == "disk"


def test_a_snapshot_slower_to_read_than_to_recompute_stays_unread(rig: Rig) -> None:
    """The disk is read unless the engine predicts a recompute RECOMPUTE_COST times faster;
    a snapshot left unread stays on disk, and every PROBE_EVERY-th choice reads anyway so the
    disk's pace stays measured."""
    sid = rig.session("s", tokens=40)
    nbytes = kv_bytes(rig.engine.resident[sid])  # what a read of its snapshot moves
    for recompute, read in ((None, 1.0), (1e-3, None), (1.0, 1.0)):  # unknown, or disk faster
        assert rig.off.persist(sid) and sid not in rig.engine.resident
        rig.engine.recompute_s_per_token = recompute
        rig.engine.read_s_per_byte = read if read is None else read * 40 / nbytes
        assert rig.off.restore(sid) == "disk" and sid in rig.engine.resident
    assert rig.off.persist(sid)
    rig.engine.recompute_s_per_token = 1.0  # 40 s to recompute against a read of...
    rig.engine.read_s_per_byte = 2.01 * 40 / nbytes  # ...80.4 s: just past RECOMPUTE_COST
    assert RECOMPUTE_COST == 2.0
    reads = rig.engine.imports_from_file
    sources = [rig.off.restore(sid) for _ in range(PROBE_EVERY)]
    assert sources == ["recompute"] * (PROBE_EVERY - 1) + ["disk"]
    assert rig.engine.imports_from_file == reads + 1
    assert rig.off.restores["disk"] == 4
    assert rig.off.persist(sid) and rig.off.restore(sid) == "recompute"
    assert rig.files.path(sid).is_file() and rig.store.get_snapshot(sid) is not None
    assert sid not in rig.engine.resident


def test_a_damaged_snapshot_is_a_warning_not_a_restore_error(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    sid = rig.session("s")
    assert rig.off.persist(sid)
    rig.files.path(sid).write_bytes(b"\x00" * 40)
    with caplog.at_level(logging.WARNING):
        assert rig.off.restore(sid) == "cold"
    assert rig.off.restore_errors == 0 and "ignored" in caplog.text
    assert not rig.files.path(sid).exists() and rig.store.get_snapshot(sid) is None


def block_writes(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, ...]:
    """Make the next snapshot write stop inside files.write until `go` is set."""
    entered, go = threading.Event(), threading.Event()
    real = rig.files.write

    def slow_write(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        entered.set()
        assert go.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(rig.files, "write", slow_write)
    return entered, go


@pytest.mark.parametrize("writer", ["sweeper", "writer thread"])
@pytest.mark.parametrize("deleted", [True, False])  # False: discard, then delete the row
def test_a_write_racing_a_delete_leaves_nothing_behind(
    rig: Rig, monkeypatch: pytest.MonkeyPatch, writer: str, deleted: bool
) -> None:
    sid = rig.session("s")
    entered, go = block_writes(rig, monkeypatch)
    if writer == "sweeper":
        sweep = threading.Thread(target=rig.off.persist, args=(sid,))
        sweep.start()
    else:
        rig.evict(sid)
    assert entered.wait(10)  # the KV is being written right now

    def delete() -> None:
        if deleted:
            rig.off.discard(sid, deleted=True)
        else:  # what the session manager does today
            rig.off.discard(sid)
        rig.store.delete_session(sid)

    deleting = threading.Thread(target=delete)
    deleting.start()
    deleting.join(0.2)  # waits for the write in flight (before the fix: done at once)
    go.set()
    deleting.join(10)
    assert not deleting.is_alive()
    if writer == "sweeper":
        sweep.join(10)
    assert wait_for(lambda: rig.off.host_bytes() == 0)
    time.sleep(0.1)  # let a late writer finish what it would do
    assert not rig.files.path(sid).exists() and rig.files.session_ids() == []
    assert rig.store.get_snapshot(sid) is None and sid not in rig.engine.resident


def test_after_a_final_discard_nothing_writes_or_restores_the_session(rig: Rig) -> None:
    sid = rig.session("s")
    rig.off.discard(sid, deleted=True)
    rig.engine.resident[sid] = fake_kv()  # a late turn's KV arrives after the delete
    assert rig.off.persist(sid, force=True) is False
    assert sid not in rig.engine.resident  # dropped, not kept resident forever
    rig.engine.resident[sid] = fake_kv()
    rig.evict(sid)
    assert sid not in rig.engine.resident and rig.off.host_bytes() == 0
    assert rig.off.restore(sid) == "cold"
    assert rig.files.session_ids() == [] and rig.store.snapshots() == []


def test_reconcile_deletes_orphan_files_and_rows(rig: Rig) -> None:
    for sid in ("kept", "deleted", "no_file"):
        assert rig.off.persist(rig.session(sid))
    kv = fake_kv()
    rig.files.write("ghost", kv.token_ids, kv.k, kv.v, FP)  # a file no row knows
    rig.files.delete("no_file")  # a row whose file is gone
    rig.store.delete_session("deleted")  # its file outlived the conversation (row gone)
    rig.store.put_snapshot("gone", "x", 1, 1, "h", FP)  # a row of no session
    known = {r["id"] for r in rig.store.all_sessions()}
    assert rig.off.reconcile(known) == 4  # 2 files (ghost, deleted), 2 rows (no_file, gone)
    assert rig.files.session_ids() == ["kept"]
    assert [r["session_id"] for r in rig.store.snapshots()] == ["kept"]
    assert rig.off.restore("kept") == "disk"
    assert rig.off.reconcile(known) == 0
