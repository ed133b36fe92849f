"""Faults a demo server meets: an unwritable or full snapshot directory, SIGKILL during SQLite
writes."""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.model.loader import LoadedModel
from sessions.persist_retry import PersistRetry, RetryPolicy
from sessions.store import Store
from tests.conftest import close_sessions, make_sessions
from ui.monitor import Monitor

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)


def break_directory(path: Path) -> None:
    """Replace the snapshot directory by a plain file: every write there fails (ENOTDIR)."""
    shutil.rmtree(path)
    path.write_text("not a directory")


def test_unwritable_snapshots_keep_sessions_resident_and_chatting(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path)
    monitor = Monitor(engine, sm)
    try:
        sid = sm.create_session("u")["id"]
        sm.chat("u", sid, "Hello!", GREEDY).result()
        break_directory(sm.files.directory)
        assert not sm.persist_now(sid)  # fails cleanly ...
        assert sid in engine.resident_kv()  # ... and the KV stays in the pool
        assert sm.get_session("u", sid)["state"] == "resident"
        assert sm.offload.failures == 1 and "persisting" in sm.offload.last_error
        assert any("Snapshot error" in w for w in monitor.warnings())  # on the admin page
        turn = sm.chat("u", sid, "Still there?", GREEDY)
        assert turn.result() and turn.restored_from == "resident"
    finally:
        monitor.stop()
        close_sessions(engine, sm)


POLITE = "Answer every question carefully and politely, in plain and simple words. " * 4


def test_unwritable_snapshots_under_memory_pressure_make_sessions_cold(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    from engine.model.kv_cache import bytes_per_token

    blocks = 10
    engine, sm = make_sessions(
        nf4_model,
        tmp_path,
        {"kv_budget_mb": blocks * 16 * bytes_per_token(nf4_model) / 2**20, "max_model_len": 150},
    )
    try:
        break_directory(sm.files.directory)
        # each its own system prompt: the template's default one would be shared by all four
        # in the prefix cache, and they would fit without pressure
        sids = [
            sm.create_session(f"u{i}", system_prompt=f"You are assistant number {i}. " + POLITE)[
                "id"
            ]
            for i in range(4)
        ]
        for i, sid in enumerate(sids):  # each needs ~4 blocks: the pool must evict
            assert sm.chat(f"u{i}", sid, "Hello there!", GREEDY).result()
        deadline = time.time() + 10
        while sm.offload.failures == 0 and time.time() < deadline:
            time.sleep(0.05)
        assert sm.offload.failures >= 1
        states = {sm.get_session(f"u{i}", s)["state"] for i, s in enumerate(sids)}
        assert "cold" in states
        for i, sid in enumerate(sids):  # every session still chats (recomputing if cold)
            assert sm.chat(f"u{i}", sid, "Again?", GREEDY).result()
            assert len(sm.messages(f"u{i}", sid)) == 4
    finally:
        close_sessions(engine, sm)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MB tmpfs as the snapshot directory (room for a few sessions' KV), filled up to
    64 KiB (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (a real full filesystem) needs root")
    mount = tmp_path / "snapshots"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
        (mount / "filler").write_bytes(b"\0" * (free - 64 * 1024))
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_backs_off_per_session_and_recovers_once_space_is_freed(
    nf4_model: LoadedModel, tmp_path: Path, full_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path, idle_seconds=0.3, sweep_interval_s=0.1)
    sm.offload.retry = PersistRetry(RetryPolicy(first_s=1.0, max_s=4.0))
    counts = {"writes": 0, "exports": 0}
    write, export = sm.files.write, engine.export_kv

    def counted_write(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        counts["writes"] += 1
        return write(*args, **kwargs)

    def counted_export(sid: str):  # noqa: ANN202
        counts["exports"] += 1
        return export(sid)

    monkeypatch.setattr(sm.files, "write", counted_write)
    monkeypatch.setattr(engine, "export_kv", counted_export)
    try:
        start = time.monotonic()
        sids = [sm.create_session(f"u{i}")["id"] for i in range(3)]
        for i, sid in enumerate(sids):
            assert sm.chat(f"u{i}", sid, "Hello there!", GREEDY).result()
        for _ in range(2):  # chatting goes on while the others fail to persist
            turn = sm.chat("u0", sids[0], "Still there?", GREEDY)
            assert turn.result() and turn.restored_from == "resident"
        time.sleep(max(0.0, start + 4 - time.monotonic()))  # at least ~40 sweeps
        tries, elapsed = sm.offload.failures, time.monotonic() - start
        # per session, tries at about 0, 1, 3, 7, 11 ... s (without backoff: every sweep)
        assert len(sids) <= tries <= len(sids) * (4 + elapsed / 4), (tries, elapsed)
        # an export only before a write (one sweep may be between the two right now)
        assert counts["writes"] == tries and counts["exports"] <= tries + 1
        for sid in sids:
            status = sm.offload.persist_status(sid)
            assert status is not None and "No space left" in status.last_error
            assert sid in engine.resident_kv()
        assert [p.name for p in full_disk.iterdir()] == ["filler"]  # no temp files left
        (full_disk / "filler").unlink()
        deadline = time.monotonic() + 10
        # written (its status cleared, its snapshot recorded), then its blocks freed: wait for both
        while time.monotonic() < deadline and any(
            sm.offload.persist_status(s) is not None or s in engine.resident_kv() for s in sids
        ):
            time.sleep(0.1)
        for i, sid in enumerate(sids):
            assert sm.offload.persist_status(sid) is None
            assert sm.store.get_snapshot(sid) is not None and sid not in engine.resident_kv()
            turn = sm.chat(f"u{i}", sid, "Back again?", GREEDY)
            assert turn.result() and turn.restored_from == "disk"
    finally:
        close_sessions(engine, sm)


def test_sigkill_during_sqlite_writes_loses_nothing_committed(tmp_path: Path) -> None:
    db = tmp_path / "crowdchat.db"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sqlite_worker", str(db)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    acknowledged = -1
    try:
        deadline = time.time() + 60
        stop_after = random.randint(50, 400)
        for line in proc.stdout:  # type: ignore[union-attr]
            acknowledged = int(line.split()[1])
            if acknowledged >= stop_after or time.time() > deadline:
                break
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert acknowledged >= 50
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    conn.close()
    store = Store(db)  # reopening recovers the WAL
    try:
        contents = [m["content"].split(" ")[1] for m in store.messages("s" * 32)]
        assert len(contents) >= acknowledged + 1  # every acknowledged write is there
        assert contents == [str(i) for i in range(len(contents))]  # in order, none torn
    finally:
        store.close()
