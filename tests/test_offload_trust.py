"""Session states and snapshot files that tell the truth (issue 34, items 10 and 11): the disk
budget never deletes what another session is writing, its byte count is kept as files come and
go, and no session is recorded where its KV is not. Real SQLite and real snapshot files; a
fake engine where the interleaving must be exact, the real model for whole turns."""

from __future__ import annotations

import os
import random
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import SamplingParams, ServerBusy
from engine.model.loader import LoadedModel
from sessions import SessionConfig, SessionState
from sessions.offload import RESTORE_STRIPES
from sessions.residency import Residency
from sessions.snapshots import SUFFIX, SnapshotFiles
from sessions.store import Store
from tests.conftest import close_sessions, make_sessions
from tests.offload_rig import FP, FakeEngine, Rig, fake_kv, wait_for

GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


def one_snapshot_bytes(tmp: Path, tokens: int = 5) -> int:
    kv = fake_kv(tokens)
    return SnapshotFiles(tmp / "probe").write("probe", kv.token_ids, kv.k, kv.v, FP)[1]


def bytes_on_disk(directory: Path) -> int:
    """The snapshot files' sizes as the file system tells them (not through SnapshotFiles)."""
    return sum(
        os.path.getsize(directory / name) for name in os.listdir(directory) if name.endswith(SUFFIX)
    )


def stripe(sid: str) -> int:
    return zlib.crc32(sid.encode()) % RESTORE_STRIPES


@pytest.fixture
def budget_of_one(tmp_path: Path) -> Iterator[Rig]:
    """Room for one snapshot and a half: a second one evicts the oldest."""
    rig = Rig(tmp_path, disk_budget=one_snapshot_bytes(tmp_path) * 3 // 2)
    yield rig
    rig.close()


# -- item 10: the disk budget ----------------------------------------------------------------
def test_a_budget_cleanup_never_deletes_a_snapshot_another_session_is_still_writing(
    budget_of_one: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = budget_of_one
    x, y = rig.session("x"), rig.session("y")
    assert stripe(x) != stripe(y)  # two gates, as two random session ids almost always have
    assert rig.off.persist(x)  # x's first snapshot: the oldest row
    rig.engine.resident[x] = fake_kv(seed=1)  # x came back and went on chatting
    entered, go = threading.Event(), threading.Event()
    real_put = rig.store.put_snapshot

    def slow_put(sid: str, *args: object) -> None:
        if sid == x:  # x's new file is on disk, its row not yet written
            entered.set()
            assert go.wait(10)
        real_put(sid, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(rig.store, "put_snapshot", slow_put)
    writing = threading.Thread(target=rig.off.persist, args=(x,))
    writing.start()
    assert entered.wait(10)
    assert rig.off.persist(y)  # y's write is over budget; x's old row is the oldest listed
    go.set()
    writing.join(10)
    assert not writing.is_alive()
    for sid in (x, y):
        has_file = rig.files.path(sid).is_file()
        assert has_file == (rig.store.get_snapshot(sid) is not None), sid
        assert (rig.states[sid] == SessionState.PERSISTED) == has_file, (sid, rig.states[sid])
    assert rig.states[x] == SessionState.PERSISTED and x not in rig.engine.resident
    assert rig.states[y] == SessionState.COLD  # x's write, the newer one, evicted y
    assert rig.files.total_bytes() <= rig.off.disk_budget


def test_the_running_total_of_snapshot_bytes_is_the_sum_of_the_files_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = SnapshotFiles(tmp_path / "snapshots")
    listings = {"n": 0}
    real_glob = Path.glob

    def counted_glob(self: Path, pattern: str) -> Iterator[Path]:
        listings["n"] += 1
        return real_glob(self, pattern)

    monkeypatch.setattr(Path, "glob", counted_glob)
    rng = random.Random(34)
    sids = [f"s{i}" for i in range(6)]
    for step in range(150):
        sid = rng.choice(sids)
        if rng.random() < 0.6:  # a new snapshot or a replacement of another size
            kv = fake_kv(rng.randint(1, 40), seed=step)
            files.write(sid, kv.token_ids, kv.k, kv.v, FP)
        else:  # also of a session that has none
            files.delete(sid)
        assert files.total_bytes() == bytes_on_disk(files.directory), step
    assert listings["n"] == 0  # counted as files came and went, not by listing the directory
    monkeypatch.undo()
    assert SnapshotFiles(files.directory).total_bytes() == bytes_on_disk(files.directory)


def test_a_seeded_run_of_persists_evictions_restores_and_deletes_keeps_files_rows_states_agreeing(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path, disk_budget=one_snapshot_bytes(tmp_path, tokens=20) * 5 // 2)
    try:
        rng = random.Random(11)
        sids = [rig.session(f"s{i}", tokens=rng.randint(1, 20), seed=i) for i in range(6)]
        for step in range(120):
            sid, op = rng.choice(sids), rng.choice(["persist", "evict", "restore", "discard"])
            if op in ("persist", "evict") and sid not in rig.engine.resident:
                rig.engine.resident[sid] = fake_kv(rng.randint(1, 20), seed=step)
            if op == "persist":
                rig.off.persist(sid, force=True)
            elif op == "evict":
                rig.off.evict(1, None, lambda other, sid=sid: other != sid)
                assert wait_for(lambda: rig.off.host_bytes() == 0)
            elif op == "restore" and rig.off.restore(sid) in ("host", "disk"):
                rig.states[sid] = SessionState.RESIDENT  # as a prefetch records it
            elif op == "discard":
                rig.off.discard(sid)
                rig.states[sid] = SessionState.COLD  # as the admin's drop records it
            assert (
                rig.files.total_bytes() == bytes_on_disk(rig.files.directory) <= rig.off.disk_budget
            )
            for s in sids:
                has_file = rig.files.path(s).is_file()
                assert has_file == (rig.store.get_snapshot(s) is not None), (step, s)
                if rig.states.get(s) == SessionState.PERSISTED:
                    assert has_file and s not in rig.engine.resident, (step, s)
    finally:
        rig.close()


# -- item 11: states that tell where the KV is -----------------------------------------------
class KeepingEngine(FakeEngine):
    """The fake engine as the session layer's Residency sees a KV-keeping backend."""

    keeps_kv = True

    def set_memory_pressure_hook(self, hook: object) -> None:
        self.hook = hook


def test_the_writer_does_not_mark_persisted_a_session_restored_from_host_memory_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, store = KeepingEngine(), Store(tmp_path / "crowdchat.db")
    files = SnapshotFiles(tmp_path / "snapshots")
    res = Residency(engine, SessionConfig(idle_seconds=3600.0), store, files, lambda sid: False)  # type: ignore[arg-type]
    try:
        slow, x, last = "other", "x", "z"
        assert len({stripe(slow), stripe(x), stripe(last)}) == 3
        for sid in (slow, x, last):
            store.create_session(sid, "u", "", "")
            engine.resident[sid] = fake_kv()
        entered, go = threading.Event(), threading.Event()
        real_write = files.write

        def slow_write(sid: str, *args: object) -> tuple[Path, int]:
            if sid == slow:
                entered.set()
                assert go.wait(10)
            return real_write(sid, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(files, "write", slow_write)

        def evict(sid: str) -> None:
            res.offload.evict(1, None, lambda other: other != sid)

        evict(slow)
        assert entered.wait(10)  # the writer is busy with another session's file
        evict(x)  # x's KV waits in host memory, its job queued behind
        res.prefetch(x, SessionState.PERSISTED)  # its user opened it: back from host memory
        assert wait_for(lambda: store.get_session(x)["state"] == SessionState.RESIDENT)
        go.set()
        evict(last)  # the writer takes jobs in order: once this one is recorded, x's was
        assert wait_for(lambda: store.get_snapshot(last) is not None)
        assert wait_for(lambda: store.get_session(last)["state"] == SessionState.PERSISTED)
        assert x in engine.resident and store.get_session(x)["state"] == SessionState.RESIDENT
    finally:
        res.flush()
        store.close()


@pytest.mark.parametrize("refusal", ["queue full", "stopped before the engine took it"])
@pytest.mark.parametrize("damaged", [True, False])
def test_a_turn_the_engine_never_took_records_where_its_restore_left_the_kv(
    nf4_model: LoadedModel, tmp_path: Path, refusal: str, damaged: bool
) -> None:
    engine, sm = make_sessions(nf4_model, tmp_path)
    try:
        sid = sm.create_session("u")["id"]
        sm.chat("u", sid, "Name a large animal.", GREEDY).result()
        assert sm.persist_now(sid)
    finally:
        close_sessions(engine, sm)
    if damaged:  # the restore finds a bad file, drops it and the next turn recomputes
        sm.files.path(sid).write_bytes(b"\x00" * 64)
    queue = {"max_queue": 0} if refusal == "queue full" else {}
    engine, sm = make_sessions(nf4_model, tmp_path, engine_overrides=queue)
    try:
        assert sm.get_session("u", sid)["state"] == SessionState.PERSISTED
        turn = sm.chat("u", sid, "Where does it live?", GREEDY)
        if refusal == "queue full":
            with pytest.raises(ServerBusy):
                turn.result()
        else:
            turn.cancel()
            assert turn.result() == ""
        assert not turn.accepted and turn.restored_from == ("cold" if damaged else "disk")
        state = sm.get_session("u", sid)["state"]
        if damaged:
            assert state == SessionState.COLD and sid not in engine.resident_kv()
            assert sm.store.get_snapshot(sid) is None
        else:
            assert state == SessionState.RESIDENT and sid in engine.resident_kv()
    finally:
        close_sessions(engine, sm)
