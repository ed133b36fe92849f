"""The admin page's tables and time series, and the two things every one of them shares: who
a user is (the same name in the sessions, served-tokens and users tables) and what a clock
time is (the server's time zone, named on the page)."""

from __future__ import annotations

import time

import pandas as pd

from engine import Backend
from engine.served import owner_label
from sessions import SessionFacts

MB = 2**20
SESSION_COLUMNS = ["id", "user", "title", "state", "tokens", "resident KV MB", "snapshot MB"]
SESSION_COLUMNS += ["idle s"]


def who(owner: str) -> str:
    """A user as every table shows them: a signed-in user by name (as in the users table),
    anyone else by their kind and the short hash that the served-tokens table and /metrics
    show (a browser id or an API key is a bearer credential: never shown, not even in part)."""
    if owner.startswith("user:"):
        return owner.removeprefix("user:")
    kind = owner.split(":", 1)[0] if ":" in owner else "id"
    return f"{kind} {owner_label(owner)}"


def clock(timestamp: float | None, seconds: bool = False) -> str:
    """A moment as the server's clock reads it (its local time zone)."""
    if not timestamp:
        return "never"
    return time.strftime(
        "%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M", time.localtime(timestamp)
    )


def zone_note() -> str:
    """Which zone the page's clock times are in, said once on the page."""
    now = time.localtime()
    offset = time.strftime("%z", now)
    return f"Times are the server's clock: {now.tm_zone} (UTC{offset[:3]}:{offset[3:]})."


def series(samples: list[dict[str, float]], columns: list[str]) -> pd.DataFrame:
    """The samples as seconds before now (no clock times: the browser would draw those in its
    own time zone, not the server's)."""
    now = time.time()
    rows = [
        {"seconds ago": round(r["time"] - now, 1), "metric": c, "value": r[c]}
        for r in samples
        for c in columns
    ]
    return pd.DataFrame(rows, columns=["seconds ago", "metric", "value"])


def sessions_table(facts: list[SessionFacts]) -> pd.DataFrame:
    """The most recently active sessions (`SessionManager.facts`); a row is selected to act
    on it."""
    rows = [
        [f.id[:12], who(f.owner), f.title[:40], f.state, f.tokens]
        + [round(f.resident_bytes / MB, 2), round(f.snapshot_bytes / MB, 2), round(f.idle_s)]
        for f in facts
    ]
    return pd.DataFrame(rows, columns=SESSION_COLUMNS)


def served_table(engine: Backend, owners: list[str]) -> pd.DataFrame:
    """Tokens computed per user, most served first, each user named as `who` names them
    where the user is one of `owners` (the users file's, the sessions table's), else by the
    hash alone."""
    names = {owner_label(o): who(o) for o in owners}
    rows = engine.stats().served
    total = sum(p + g for _, p, g in rows) or 1
    return pd.DataFrame(
        [[names.get(label, label), p, g, round(100 * (p + g) / total, 1)] for label, p, g in rows],
        columns=["user", "prompt tokens", "generated tokens", "share %"],
    )


def replicas_table(engine: Backend) -> pd.DataFrame:
    """Upstream replicas: health, turns, and what each one's /metrics says (vLLM names)."""
    columns = ["url", "state", "turns", "failed", "in flight", "KV cache %", "running"]
    columns += ["waiting", "prefix hit %", "last error"]
    rows = []
    for r in engine.stats().replicas:
        u = r.upstream
        queries = u.get("prefix_cache_queries")
        hits = u.get("prefix_cache_hits")
        usage = u.get("kv_cache_usage_perc")
        rows.append(
            {
                "url": r.url,
                "state": "draining" if r.draining and r.healthy else "up" if r.healthy else "down",
                "turns": r.served,
                "failed": r.failures,
                "in flight": r.in_flight,
                "KV cache %": "–" if usage is None else round(100 * usage, 1),
                "running": u.get("num_requests_running", "–"),
                "waiting": u.get("num_requests_waiting", "–"),
                "prefix hit %": round(100 * hits / queries, 1) if queries and hits else "–",
                "last error": r.last_error or "",
            }
        )
    return pd.DataFrame(rows, columns=columns)
