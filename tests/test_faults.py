"""Faults a demo server meets: an unwritable snapshot directory, SIGKILL during SQLite writes."""

from __future__ import annotations

import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from engine import SamplingParams
from engine.loader import LoadedModel
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


def test_unwritable_snapshots_under_memory_pressure_make_sessions_cold(
    nf4_model: LoadedModel, tmp_path: Path
) -> None:
    from engine.kv_cache import bytes_per_token
    blocks = 10
    engine, sm = make_sessions(nf4_model, tmp_path, {
        "kv_budget_mb": blocks * 16 * bytes_per_token(nf4_model) / 2**20, "max_model_len": 150})
    try:
        break_directory(sm.files.directory)
        sids = [sm.create_session(f"u{i}")["id"] for i in range(4)]
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


def test_sigkill_during_sqlite_writes_loses_nothing_committed(tmp_path: Path) -> None:
    db = tmp_path / "crowdchat.db"
    proc = subprocess.Popen([sys.executable, "-m", "tests.sqlite_worker", str(db)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
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
