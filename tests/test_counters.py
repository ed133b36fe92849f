"""Figures that cost the same with ten sessions or thousands: counters kept by SQLite triggers
in the writes' own transactions, read by /metrics and the admin page instead of a scan."""

from __future__ import annotations

import random
import sqlite3
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.model.loader import LoadedModel
from sessions import migrations as migrations_module
from sessions.migrations import MIGRATIONS
from sessions.state import SessionState
from sessions.store import Store
from tests.web import running_server

FP = {"model_id": "m"}


def scanned(store: Store) -> tuple[dict[str, int], int, int]:
    """Sessions by state, snapshot rows and bytes, by a full scan."""
    snaps = store.snapshots()
    states = Counter(row["state"] for row in store.all_sessions())
    return dict(states), len(snaps), sum(r["bytes"] for r in snaps)


def counted(store: Store) -> tuple[dict[str, int], int, int]:
    return (store.session_counts(), *store.snapshot_totals())


def test_counters_equal_a_full_scan_after_every_kind_of_write(tmp_path: Path) -> None:
    rng = random.Random(11)
    with Store(tmp_path / "crowdchat.db") as store:
        assert counted(store) == ({}, 0, 0)
        ids: list[str] = []
        for step in range(300):
            op = rng.random()
            if op < 0.3 or not ids:
                ids.append(f"s{step:04d}")
                store.create_session(ids[-1], rng.choice("abc"), "", "")
            elif op < 0.5:
                fields = {"state": rng.choice(list(SessionState))}
                if rng.random() < 0.5:
                    fields["token_count"] = step  # a write that keeps the state
                    fields.pop("state")
                store.update_session(rng.choice(ids), **fields)
            elif op < 0.6:
                sid = rng.choice(ids)
                store.add_message(
                    sid, "user", "hi", session_fields={"state": rng.choice(list(SessionState))}
                )
            elif op < 0.75:  # a new snapshot, or a replaced one of another size
                store.put_snapshot(rng.choice(ids), "p", rng.randint(1, 10**6), 1, "h", FP)
            elif op < 0.85:
                store.delete_snapshot(rng.choice(ids))
            else:
                sid = ids.pop(rng.randrange(len(ids)))
                store.delete_session(sid)  # its snapshot row goes with it
            assert counted(store) == scanned(store), step
        with pytest.raises(sqlite3.IntegrityError):  # a failed write leaves the counts alone
            store.create_session(ids[0], "a", "", "")
        assert counted(store) == scanned(store)
        assert store.count_sessions("a") == sum(
            1 for r in store.all_sessions() if r["owner"] == "a"
        )


def test_the_counters_migration_counts_what_an_older_database_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "crowdchat.db"
    older = [fn for fn in MIGRATIONS if fn.__name__ < "m005"]
    monkeypatch.setattr(migrations_module, "MIGRATIONS", older)
    with Store(path) as store:
        for i, state in enumerate(["cold", "persisted", "persisted", "resident"]):
            store.create_session(f"s{i}", "o", "", "")
            store.update_session(f"s{i}", state=state)
        store.put_snapshot("s1", "p", 1234, 1, "h", FP)
        store.put_snapshot("s2", "p", 66, 1, "h", FP)
    monkeypatch.setattr(migrations_module, "MIGRATIONS", MIGRATIONS)
    with Store(path) as store:
        assert counted(store) == ({"cold": 1, "persisted": 2, "resident": 1}, 2, 1300)
        assert counted(store) == scanned(store)


def test_metrics_and_admin_figures_read_no_session_rows_with_5000_sessions(
    nf4_model: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    statements: list[tuple[str, str]] = []  # (thread, SQL) on every connection opened below
    connect = sqlite3.connect

    def traced(*args: object, **kwargs: object) -> sqlite3.Connection:
        conn = connect(*args, **kwargs)  # type: ignore[arg-type]
        conn.set_trace_callback(
            lambda sql: statements.append((threading.current_thread().name, sql))
        )
        return conn

    monkeypatch.setattr(sqlite3, "connect", traced)
    with running_server(nf4_model, tmp_path) as (url, _engine, sm):
        rng = random.Random(5)
        now = time.time()
        rows = [
            {
                "id": f"{i:032x}",
                "owner": f"browser:{i % 50}",
                "title": "",
                "created": now - i,
                "last_active": now - i,
                "state": rng.choice(["persisted", "cold", "resident"]),
                "token_count": i,
                "fingerprint": None,
                "system_prompt": "",
            }
            for i in range(5000)
        ]
        sm.store.sql.write(lambda db: db.table("sessions").insert_all(rows))
        for row in rows[:300]:
            sm.store.put_snapshot(row["id"], "p", rng.randint(1, 10**6), 1, "h", FP)

        def metrics() -> tuple[dict[str, float], list[str]]:
            statements.clear()
            text = httpx.get(f"{url}/metrics", timeout=60).text
            sql = [s for _t, s in statements if not s.startswith("PRAGMA")]
            families = {f.name: f for f in text_string_to_metric_families(text)}
            by_state = {
                s.labels["state"]: s.value
                for s in families["crowdchat_sessions"].samples
                if s.value
            }
            return by_state, sql

        by_state, sql = metrics()
        states, files, nbytes = scanned(sm.store)
        assert by_state == states and sum(states.values()) == 5000
        assert len(sql) <= 4, sql  # a few counter reads, however many sessions
        assert all("session_counts" in s or "snapshot_totals" in s for s in sql), sql
        st = sm.stats()
        assert (st.states, st.snapshots, st.snapshot_bytes) == (states, files, nbytes)
        statements.clear()
        facts = sm.facts()  # the admin table: the most recent sessions, an index read
        recent = next(s for _t, s in statements if "FROM sessions ORDER BY" in s)
        plan = " ".join(
            str(row[-1]) for row in sm.store.sql.reader().execute("EXPLAIN QUERY PLAN " + recent)
        )
        assert "USING INDEX sessions_recent" in plan and "TEMP B-TREE" not in plan, plan
        assert [f.id for f in facts] == [r["id"] for r in sm.store.all_sessions()[:200]]
        snaps = {r["session_id"]: r["bytes"] for r in sm.store.snapshots()}
        assert [f.snapshot_bytes for f in facts] == [snaps.get(f.id, 0) for f in facts]
        assert sm.find_sessions(rows[7]["id"]) == [rows[7]["id"]]
        assert sm.find_sessions(rows[7]["id"][:31]) == [rows[0]["id"], rows[1]["id"]]
        assert sm.find_sessions("zz") == [] and len(sm.find_sessions("0")) == 2
