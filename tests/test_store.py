"""The SQLite store: migrations, sessions, messages, snapshot rows, the writer thread, restarts."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlite_utils import Database
from sqlite_utils.db import NotFoundError

from sessions import migrations as migrations_module
from sessions.migrations import MIGRATIONS
from sessions.store import Store

FP = {"model_id": "m", "block_size": 16, "num_layers": 2}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "crowdchat.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    s = Store(db_path)
    yield s
    s.close()


def test_migrations_run_once_and_are_recorded(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def m999_probe(db: Database) -> None:
        calls.append(1)

    monkeypatch.setattr(migrations_module, "MIGRATIONS", [*MIGRATIONS, m999_probe])
    Store(db_path).close()
    Store(db_path).close()
    assert calls == [1]
    db = Database(db_path)
    names = [row["name"] for row in db.table("_migrations").rows_where(order_by="applied")]
    assert names == [fn.__name__ for fn in MIGRATIONS] + ["m999_probe"]
    assert db.journal_mode == "wal"
    assert {"sessions", "messages", "snapshots"} <= set(db.table_names())
    db.close()


def test_failed_migration_rolls_back_and_raises(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def m999_broken(db: Database) -> None:
        db.table("half").create({"id": int}, pk="id")
        raise ValueError("broken migration")

    monkeypatch.setattr(migrations_module, "MIGRATIONS", [*MIGRATIONS, m999_broken])
    with pytest.raises(ValueError, match="broken migration"):
        Store(db_path)
    db = Database(db_path)
    assert "half" not in db.table_names()  # the migration's transaction was rolled back
    assert "m999_broken" not in {row["name"] for row in db.table("_migrations").rows}
    db.close()
    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS)
    Store(db_path).close()  # the earlier migrations stuck; a fixed release starts fine


def test_session_create_get_update_list(store: Store) -> None:
    created = store.create_session("s1", "alice", "First", "be brief")
    assert created["state"] == "active" and created["token_count"] == 0
    assert store.get_session("s1") == created
    assert store.get_session("nope") is None

    store.update_session("s1", title="Renamed", state="resident", token_count=42, fingerprint=FP)
    got = store.get_session("s1")
    assert got is not None
    assert (got["title"], got["state"], got["token_count"]) == ("Renamed", "resident", 42)
    assert got["fingerprint"] == FP
    with pytest.raises(NotFoundError):
        store.update_session("nope", title="x")


def test_listing_is_per_owner_newest_first(store: Store) -> None:
    for sid, owner, active in [("a1", "alice", 10.0), ("b1", "bob", 20.0), ("a2", "alice", 30.0)]:
        store.create_session(sid, owner, sid, "")
        store.update_session(sid, last_active=active)
    assert [s["id"] for s in store.list_sessions("alice")] == ["a2", "a1"]
    assert [s["id"] for s in store.list_sessions("bob")] == ["b1"]
    assert store.list_sessions("carol") == []
    assert [s["id"] for s in store.all_sessions()] == ["a2", "b1", "a1"]


def test_messages_round_trip_in_order(store: Store) -> None:
    store.create_session("s", "alice", "t", "")
    store.create_session("other", "alice", "t", "")
    roles = ["user", "assistant"] * 3
    ids = [store.add_message("s", role, f"m{i}") for i, role in enumerate(roles)]
    store.add_message("other", "user", "elsewhere")
    assert ids == sorted(ids)
    store.update_message(ids[1], content="edited", token_count=7, finish_reason="stop")
    msgs = store.messages("s")
    assert [m["id"] for m in msgs] == ids
    assert [m["content"] for m in msgs] == ["m0", "edited", "m2", "m3", "m4", "m5"]
    assert (msgs[1]["token_count"], msgs[1]["finish_reason"]) == (7, "stop")
    assert msgs[0]["finish_reason"] is None and msgs[0]["role"] == "user"


def test_snapshot_rows(store: Store) -> None:
    store.create_session("s", "alice", "t", "")
    store.create_session("t", "alice", "t", "")
    store.put_snapshot("s", "/x/s.safetensors", 100, 10, "h1", FP)
    store.put_snapshot("t", "/x/t.safetensors", 200, 20, "h2", FP)
    store.put_snapshot("s", "/x/s.safetensors", 300, 30, "h3", FP)  # replaces, now newest
    snap = store.get_snapshot("s")
    assert snap is not None
    assert (snap["bytes"], snap["tokens"], snap["token_hash"]) == (300, 30, "h3")
    assert snap["fingerprint"] == FP
    assert [s["session_id"] for s in store.snapshots()] == ["t", "s"]
    store.delete_snapshot("t")
    assert store.get_snapshot("t") is None
    assert [s["session_id"] for s in store.snapshots()] == ["s"]


def test_delete_session_removes_messages_and_snapshot(store: Store) -> None:
    for sid in ("gone", "kept"):
        store.create_session(sid, "alice", "t", "")
        store.add_message(sid, "user", "hi")
        store.put_snapshot(sid, f"/x/{sid}", 1, 1, "h", FP)
    store.delete_session("gone")
    assert store.get_session("gone") is None
    assert store.messages("gone") == []
    assert store.get_snapshot("gone") is None
    assert store.get_session("kept") is not None
    assert len(store.messages("kept")) == 1 and store.get_snapshot("kept") is not None
    store.delete_session("gone")  # idempotent


def test_concurrent_writes_all_land(store: Store) -> None:
    threads, per_thread = 8, 25
    store.create_session("s", "alice", "t", "")

    def work(n: int) -> list[int]:
        ids = []
        for i in range(per_thread):
            ids.append(store.add_message("s", "user", f"{n}-{i}"))
            assert store.messages("s")  # reads interleave with writes
        return ids

    with ThreadPoolExecutor(threads) as pool:
        ids = [i for batch in pool.map(work, range(threads)) for i in batch]
    assert len(set(ids)) == threads * per_thread
    contents = {m["content"] for m in store.messages("s")}
    assert contents == {f"{n}-{i}" for n in range(threads) for i in range(per_thread)}


def test_message_is_committed_before_add_returns(store: Store, db_path: Path) -> None:
    store.create_session("s", "alice", "t", "")
    msg_id = store.add_message("s", "user", "durable")
    other = sqlite3.connect(db_path)  # another connection, as after a crash and restart
    assert other.execute("SELECT content FROM messages WHERE id = ?", [msg_id]).fetchall() == [
        ("durable",)
    ]
    other.close()
    # synchronous=FULL (2) in WAL mode: a commit is fsync'd before the write returns.
    assert store.sql.write(lambda db: db.execute("PRAGMA synchronous").fetchone()[0]) == 2


def test_failed_write_reraises_and_writer_survives(store: Store) -> None:
    store.create_session("dup", "alice", "t", "")
    with pytest.raises(sqlite3.IntegrityError):
        store.create_session("dup", "bob", "t2", "")
    assert store.get_session("dup")["owner"] == "alice"  # type: ignore[index]
    store.create_session("after", "bob", "t", "")
    assert store.add_message("after", "user", "still writing") > 0
    assert [s["id"] for s in store.list_sessions("bob")] == ["after"]


def test_data_survives_restart(db_path: Path) -> None:
    first = Store(db_path)
    first.create_session("s", "alice", "t", "sys")
    msg_id = first.add_message("s", "user", "hello", token_count=3)
    first.put_snapshot("s", "/x/s", 10, 3, "h", FP)
    first.close()
    first.close()  # idempotent
    with pytest.raises(RuntimeError):
        first.add_message("s", "user", "after close")

    with Store(db_path) as second:
        session = second.get_session("s")
        assert session is not None and session["system_prompt"] == "sys"
        assert [(m["id"], m["content"]) for m in second.messages("s")] == [(msg_id, "hello")]
        assert second.get_snapshot("s") is not None
        assert second.add_message("s", "assistant", "hi") > msg_id
