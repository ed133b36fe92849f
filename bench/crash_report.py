"""`bench/crash_load.py`'s verdicts: the invariants checked on each freshly restarted server
before the load resumes (nothing acknowledged lost, snapshot files and rows one for one, no lying
state, restored sessions continuing as a recompute would), each restart's line, and the run's
summary with the invariants that failed."""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.crash_checks import (
    Ack,
    Db,
    lost_acks,
    lying_states,
    read_db,
    snapshot_mismatch,
    transcript,
)
from bench.crash_crowd import Crowd, Tally
from bench.mixed import cpu_name
from bench.near_tie import judge_misses, near_tie
from bench.stream_client import ReplyCount, stream_body


@dataclass
class Run:
    """What the kill loop saw: each restart's check, how the kills fell, start-up times."""

    cycles: list[dict] = field(default_factory=list)
    kinds: Counter[str] = field(default_factory=Counter)  # startup / load
    left: Counter[str] = field(default_factory=Counter)  # what the kills left behind
    totals: Counter[str] = field(default_factory=Counter)  # server counters, summed
    starts: list[float] = field(default_factory=list)
    after_stop: dict[str, list[str]] = field(default_factory=dict)
    wall_s: float = 0.0


async def greedy(
    http: httpx.AsyncClient, headers: dict[str, str], messages: list[dict], n: int
) -> tuple[str | None, str]:
    """A greedy streamed request: (X-Crowdchat-KV, reply text)."""
    body = {**stream_body(messages, n), "temperature": 0}
    r = await http.post("/v1/chat/completions", json=body, headers=headers)
    r.raise_for_status()
    reply = ReplyCount()
    for line in r.text.splitlines():
        reply.feed(line)
    assert not reply.failed, r.text[-300:]
    return r.headers.get("x-crowdchat-kv"), reply.text


async def continue_exactly(
    http: httpx.AsyncClient, db: Db, sid: str, key: str, ref: str, probe: str, n: int, t: Tally
) -> dict:
    """The session's greedy next turn and a recompute of it by another key."""
    convo = transcript(db, sid)
    turn = {"role": "user", "content": probe}
    auth = {"Authorization": f"Bearer {key}", "X-Session-Id": sid}
    (kv, mine), (_, theirs) = await asyncio.gather(
        greedy(http, auth, [turn], n),
        greedy(http, {"Authorization": f"Bearer {ref}"}, [*convo, turn], n),
    )
    t.add(Ack(sid, "user", probe), Ack(sid, "assistant", mine, after=probe))
    return {
        "sid": sid,
        "kv": kv,
        "same": mine == theirs,
        "session": mine,
        "recompute": theirs,
        "messages": [*convo, turn],
        "n": n,
    }


async def check(crowd: Crowd, data: Path, ref: str, rng: random.Random, cycle: int) -> dict:
    """The invariants on a freshly started server, before the load resumes."""
    t, args = crowd.tally, crowd.args
    db = read_db(data / "crowdchat.db")
    out: dict = {"cycle": cycle, "lost": [a.__dict__ for a in lost_acks(db, t.acks)]}
    out.update(snapshot_mismatch(data, db))
    out["lying_states"] = lying_states(db)
    with_snapshot = sorted(s for s in t.api_sessions if s in db.snapshots)
    picked = rng.sample(with_snapshot, min(args.exact_per_restart, len(with_snapshot)))
    async with httpx.AsyncClient(base_url=crowd.base, timeout=300) as http:
        runs = [
            continue_exactly(
                http, db, sid, t.api_sessions[sid], ref, f"Check {cycle}.{j}: go on.", 16, t
            )
            for j, sid in enumerate(picked)
        ]
        out["exact"] = list(await asyncio.gather(*runs))
        if picked:  # its KV now resident, never crashed: the reference method's own check
            again = read_db(data / "crowdchat.db")
            sid = picked[0]
            probe = f"Check {cycle}: and then?"
            out["control"] = await continue_exactly(
                http, again, sid, t.api_sessions[sid], ref, probe, 16, t
            )
    return out


def brief(result: dict) -> dict:
    """One restart's check as a line: counts, and each continuation's source and verdict."""
    out = {k: len(v) if isinstance(v, list) and k != "exact" else v for k, v in result.items()}
    out["exact"] = [(e["kv"], e["same"]) for e in result["exact"]]
    if "control" in result:
        out["control"] = (result["control"]["kv"], result["control"]["same"])
    return out


def judge(args: argparse.Namespace, r: Run, data: Path) -> None:
    """A verdict for each continuation that differs from its recompute (bench/near_tie.py)."""
    misses = [e for c in r.cycles for e in [*c["exact"], c.get("control")] if e and not e["same"]]
    judge_misses(args.server_args, misses, data)


INVARIANTS = (
    "lost_acknowledged",
    "orphaned_snapshot_files",
    "orphaned_snapshot_rows",
    "leftover_temp_files",
    "lying_states",
    "byte_exact_failed",
    "control_failed",
)


def detail(e: dict) -> dict:
    """A miss as the summary shows it: the replies and the verdict, not the transcript."""
    return {k: v for k, v in e.items() if k != "messages"}


def summarize(args: argparse.Namespace, r: Run, t: Tally, server_log: str) -> dict:
    """The run's JSON summary; `failed` names every invariant that did not hold."""
    exact = [e for c in r.cycles for e in c["exact"]]
    restored = [e for e in exact if e["kv"] == "disk"]
    controls = [c["control"] for c in r.cycles if "control" in c]
    s = {
        "machine": cpu_name(),
        "seed": args.seed,
        "users_api": args.users - args.page_users,
        "users_page": args.page_users,
        "server_args": args.server_args,
        "kills": sum(r.kinds.values()),
        "kills_during_startup": r.kinds["startup"],
        "kills_under_load": r.kinds["load"],
        "restarts_checked": len(r.cycles),
        "requests_sent": t.counts["sent"] + t.counts["page_sent"],
        "requests_acknowledged": t.counts["acked"] + t.counts["page_acked"],
        "api_sent": t.counts["sent"],
        "api_acknowledged": t.counts["acked"],
        "api_replies_finished": t.counts["replies"],
        "page_sent": t.counts["page_sent"],
        "page_acknowledged": t.counts["page_acked"],
        "sessions_created_api": t.counts["sessions_created"],
        "acks_checked_each_restart": len(t.acks),
        "errors": dict(t.errors),
        "inflight_at_kills": sum(c.get("inflight_at_kill", 0) for c in r.cycles),
        "left_by_kills": dict(r.left),
        "snapshot_writes": r.totals["persists"],
        "disk_restores": r.totals["disk_restores"],
        "evictions": r.totals["evictions"],
        "snapshots_ignored_in_log": len(re.findall(r"snapshot \S+: ignored", server_log)),
        "reconciles_in_log": len(re.findall(r"reconcile: deleted", server_log)),
        "lost_acknowledged": sum(len(c["lost"]) for c in r.cycles),
        "lost_examples": [a for c in r.cycles for a in c["lost"]][:5],
        "orphaned_snapshot_files": sum(len(c["files_without_row"]) for c in r.cycles),
        "orphaned_snapshot_rows": sum(len(c["rows_without_file"]) for c in r.cycles),
        "leftover_temp_files": sum(len(c["temp_files"]) for c in r.cycles),
        "lying_states": sum(len(c["lying_states"]) for c in r.cycles),
        "after_clean_stop": {k: len(v) for k, v in r.after_stop.items()},
        "byte_exact_checked": len(restored),
        "byte_exact_near_tie": sum(near_tie(e) for e in restored),
        "byte_exact_failed": sum(not e["same"] and not near_tie(e) for e in restored),
        "snapshot_not_restored": dict(Counter(str(e["kv"]) for e in exact if e["kv"] != "disk")),
        "control_checked": len(controls),
        "control_near_tie": sum(near_tie(c) for c in controls),
        "control_failed": sum(not c["same"] and not near_tie(c) for c in controls),
        "failures_detail": [detail(e) for e in exact + controls if not e["same"]][:5],
        "start_s_median": round(statistics.median(r.starts), 1),
        "start_s_max": round(max(r.starts), 1),
        "wall_s": round(r.wall_s, 1),
    }
    failed = [k for k in INVARIANTS if s[k]]
    failed += [f"after_clean_stop.{k}" for k, v in s["after_clean_stop"].items() if v]
    if not restored:
        failed.append("no restored session was checked byte-exact")
    s["failed"] = failed
    return s
