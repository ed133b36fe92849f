"""What the admin page, the monitor and /metrics may know about sessions: per-session facts
and one frozen summary, so none of them reaches into the offloader, the store or the limiter.
Both cost the same whatever the number of sessions: the summary reads counters the store
keeps, the facts cover the most recently active sessions only."""

from __future__ import annotations

import time
from collections.abc import Container
from dataclasses import dataclass, field

from engine import Backend
from sessions.admission import Admission
from sessions.residency import Residency
from sessions.store import Store


@dataclass(frozen=True)
class SessionFacts:
    """One row of the admin page's sessions table."""

    id: str
    owner: str
    title: str
    state: str
    tokens: int
    resident_blocks: int
    resident_bytes: int
    snapshot_bytes: int
    idle_s: float


@dataclass(frozen=True)
class SessionStats:
    """The session layer's counters and totals at one moment."""

    states: dict[str, int]  # sessions by state (SessionState values)
    snapshots: int  # snapshot files on disk
    snapshot_bytes: int
    disk_budget_bytes: int
    host_bytes: int  # evicted KV held in host RAM, not yet on disk
    restores: dict[str, int]  # source ('host', 'disk') -> restores into the pool
    recomputes: int  # turns whose earlier KV was gone and had to be recomputed
    persists: int
    persist_failures: int
    evictions: int  # idle sessions moved out of a full pool
    rate_limited: int  # requests refused by the per-user token budget or a per-user cap
    last_snapshot_error: str | None
    restore_errors: int = 0  # restores that failed unexpectedly (not a bad or stale file)
    last_restore_error: str | None = None
    kv_writer_healthy: bool = True  # the thread that makes evicted KV durable
    kv_writer_restarts: int = 0
    persist_backoff: dict[str, str] = field(default_factory=dict)  # session -> why, retry when
    refused_by: dict[str, int] = field(default_factory=dict)  # limit -> requests refused
    recomputes_chosen: int = 0  # recomputes that left a snapshot unread: recomputing was faster
    disk_read_mb_s: float | None = None  # snapshots' measured read pace (None: none read yet)


def session_facts(
    engine: Backend, store: Store, active: Container[str], limit: int
) -> list[SessionFacts]:
    """The `limit` most recently active sessions with their state and memory."""
    resident = engine.resident_kv()
    rows = store.recent_sessions(limit)
    snaps = store.snapshot_bytes([row["id"] for row in rows])
    per_block = engine.kv_bytes_per_token * engine.block_size
    now = time.time()
    out = []
    for row in rows:
        blocks = resident.get(row["id"], (0, 0, 0.0))[1]
        out.append(
            SessionFacts(
                id=row["id"],
                owner=row["owner"],
                title=row["title"],
                state=row["state"],
                tokens=row["token_count"],
                resident_blocks=blocks,
                resident_bytes=blocks * per_block,
                snapshot_bytes=snaps.get(row["id"], 0),
                idle_s=0.0 if row["id"] in active else now - row["last_active"],
            )
        )
    return out


def read_mb_s(engine: Backend) -> float | None:
    """The pace snapshots were read into the pool at, MB (2^20 bytes) a second (None before
    the first read)."""
    second = engine.read_s(2**20)
    return 1 / second if second else None


def session_stats(store: Store, residency: Residency, admission: Admission) -> SessionStats:
    """The summary for the admin page, the monitor's warnings and /metrics."""
    off = residency.offload
    files, nbytes = store.snapshot_totals()
    return SessionStats(
        states=store.session_counts(),
        snapshots=files,
        snapshot_bytes=nbytes,
        disk_budget_bytes=off.disk_budget,
        host_bytes=off.host_bytes(),
        restores=dict(off.restores),
        recomputes=residency.recomputes,
        recomputes_chosen=residency.recomputes_chosen,
        disk_read_mb_s=read_mb_s(residency.engine),
        persists=off.persists,
        persist_failures=off.failures,
        evictions=off.evictions,
        rate_limited=admission.refused,
        last_snapshot_error=off.last_error,
        restore_errors=off.restore_errors,
        last_restore_error=off.last_restore_error,
        kv_writer_healthy=off.healthy(),
        kv_writer_restarts=off.writer_restarts,
        persist_backoff={
            sid: f"{st.failures} failed write(s), last: {st.last_error}; next try "
            f"{time.strftime('%H:%M:%S', time.localtime(st.retry_at))}"
            for sid, st in off.persist_failing().items()
        },
        refused_by={
            "tokens": admission.limiter.refused,
            "tokens_per_client": admission.client_limiter.refused,
            **admission.caps.refused,
        },
    )
