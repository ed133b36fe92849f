"""Crash under load: users chat over the API and the page while crowdchat is SIGKILLed.

N users (`--users`, `--page-users` of them on the chat page through gradio_client, the rest
over the OpenAI API, each with its own `--api-keys` key and server-side sessions) chat with
short think times; sessions rotate every few turns and `--idle-seconds` is short, so idle KV
is written to snapshot files all through the run. At seeded random moments the server is
killed with SIGKILL (`--kills` times, some of them during start-up) and restarted on the same
data dir. After each restart, before the load resumes, it checks that:

- every acknowledged thing is in SQLite (crowdchat.db opened read-only): each session whose
  creation got its 200, each user message whose turn got its 200, and each reply whose stream
  ended (finish chunk and [DONE]: the commit comes before them), as a child of its message;
- snapshot files and rows match one for one and no temp file outlived the start-up sweep;
  no session is recorded `persisted` without a snapshot row, or `active`/`resident`;
- restored sessions continue as a recompute would: for `--exact-per-restart` sessions with a
  snapshot, a greedy turn over the session (it must come back from `disk`) is compared with a
  greedy one-off request of the same transcript by another key (nothing of the session's KV
  is cached for it: a recompute). In float32 without quantization (`--quant none --dtype
  float32`, the default here) the two are equal token for token except where the model's two
  best next tokens lie within float32 rounding noise of each other: the prompt's tokens are
  computed in other row counts, and the CPU's float32 matmul rounds differently below and
  above 16 rows. After the run each miss is judged against a float64 recompute
  (bench/near_tie.py); only one that leaves the float64 path at a clear margin fails. A
  control pair on a session whose KV stayed resident (no crash in between) checks the method
  itself.

Prints one JSON line per restart, then a summary; exits 1 if any invariant failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from gradio_client import Client

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.crash_checks import (  # noqa: E402
    Ack,
    Db,
    lost_acks,
    lying_states,
    read_db,
    snapshot_mismatch,
    transcript,
)
from bench.load import QUESTIONS, ROOT, ReplyCount, free_port, stream_body  # noqa: E402
from bench.mixed import cpu_name  # noqa: E402
from bench.near_tie import judge_misses, near_tie  # noqa: E402

EXACT = ["--quant", "none", "--dtype", "float32"]  # restored == recomputed but at near ties
# small and quick: idle KV goes to disk within the run, a small pool makes evictions happen
FAST = "--idle-seconds 2 --max-tokens-per-turn 24 --kv-budget-mb 256 --tokens-per-minute 0"


@dataclass
class Tally:
    """Everything the users sent and were told, shared by the asyncio and page threads."""

    acks: list[Ack] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    api_sessions: dict[str, str] = field(default_factory=dict)  # session id -> its key
    inflight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, *acks: Ack, count: str | None = None, error: str | None = None) -> None:
        with self.lock:
            self.acks.extend(acks)
            if count:
                self.counts[count] += 1
            if error:
                self.errors[error] += 1


class Crashable:
    """crowdchat in a subprocess on a fixed data dir, killed and restarted at will."""

    def __init__(self, data: Path, log: Path, args: list[str]) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            str(ROOT / "app.py"),
            "--data-dir",
            str(data),
            "--port",
            str(self.port),
            *args,
        ]
        self.log = log
        self.proc: subprocess.Popen | None = None

    def spawn(self) -> None:
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=out, stderr=out)

    def start(self) -> float:
        """Spawn and wait until /health answers; returns the seconds that took."""
        t0 = time.perf_counter()
        self.spawn()
        while time.perf_counter() - t0 < 300:
            if self.proc.poll() is not None:
                raise SystemExit(f"crowdchat exited with {self.proc.returncode}: see {self.log}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit("crowdchat did not start")

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.kill()


class Crowd:
    """The users: asyncio tasks over the API, threads on the page; they chat while `up`."""

    def __init__(self, base: str, keys: list[str], pages: int, args: argparse.Namespace) -> None:
        self.base, self.keys, self.pages, self.args = base, keys, pages, args
        self.tally = Tally()
        self.up = threading.Event()
        self.done = False

    async def wait_up(self) -> bool:
        while not self.up.is_set():
            if self.done:
                return False
            await asyncio.sleep(0.1)
        return True

    async def api_user(self, i: int, http: httpx.AsyncClient, rng: random.Random) -> None:
        auth = {"Authorization": f"Bearer {self.keys[i]}"}
        sid, turns, n, t = None, 0, 0, self.tally
        while await self.wait_up():
            try:
                if sid is None or turns >= self.args.turns_per_session:
                    r = await http.post("/v1/sessions", headers=auth)
                    if r.status_code != 200:
                        t.add(error=f"create_http_{r.status_code}")
                        await asyncio.sleep(0.5)
                        continue
                    sid, turns = r.json()["id"], 0
                    t.add(Ack(sid, "session"), count="sessions_created")
                    t.api_sessions[sid] = self.keys[i]
                n += 1
                text = f"{rng.choice(QUESTIONS)} (user {i}, message {n})"
                turns += 1
                await one_turn(http, {**auth, "X-Session-Id": sid}, text, self.args, t)
            except (httpx.HTTPError, json.JSONDecodeError) as e:
                t.add(error=type(e).__name__)
                await asyncio.sleep(0.2)
            await asyncio.sleep(rng.uniform(*self.args.think))

    def page_user(self, i: int, rng: random.Random) -> None:
        """A browser tab: a fresh gradio_client after each restart (Gradio's per-tab state
        dies with the server), the same signed cookie, so the same owner."""
        cookie, client, n, t = None, None, 0, self.tally
        while not self.done:
            if not self.up.wait(0.1):
                continue
            try:
                if client is None:
                    kwargs = {"cookies": {"crowdchat_id": cookie}} if cookie else {}
                    client = Client(self.base + "/", verbose=False, httpx_kwargs=kwargs)
                    cookie = client.cookies.get("crowdchat_id", cookie)
                n += 1
                text = f"{rng.choice(QUESTIONS)} (page user {i}, message {n})"
                t.add(count="page_sent")
                with t.lock:
                    t.inflight += 1
                try:
                    job = client.submit(text, "", 0.8, 0.9, 16, api_name="/on_send")
                    chat, status, _box, convos = job.result(timeout=self.args.page_timeout)
                finally:
                    with t.lock:
                        t.inflight -= 1
                shown = [(m["role"], "".join(p["text"] for p in m["content"])) for m in chat]
                if status.startswith("Error") or shown[-2:-1] != [("user", text)]:
                    t.add(error="page_refused")
                else:
                    sid = convos["value"]
                    t.add(Ack(sid, "session"), Ack(sid, "user", text), count="page_acked")
                    t.add(Ack(sid, "assistant", shown[-1][1], after=text, shown=True))
            except Exception as e:  # noqa: BLE001 - the server died under it: a new tab
                t.add(error=f"page_{type(e).__name__}")
                if client is not None:
                    client.close()
                client = None
                time.sleep(0.3)
            time.sleep(rng.uniform(*self.args.think))
        if client is not None:
            client.close()


async def one_turn(
    http: httpx.AsyncClient, headers: dict[str, str], text: str, args: argparse.Namespace, t: Tally
) -> None:
    """One streamed session turn; acknowledges the message at its 200, the reply at [DONE]."""
    body = stream_body([{"role": "user", "content": text}], args.new_tokens)
    t.add(count="sent")
    sid = headers["X-Session-Id"]
    with t.lock:
        t.inflight += 1
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                t.add(error=f"http_{r.status_code}")
                return
            t.add(Ack(sid, "user", text), count="acked")
            reply, done = ReplyCount(), False
            async for line in r.aiter_lines():
                reply.feed(line)
                done = done or line == "data: [DONE]"
            if done and not reply.failed:
                t.add(Ack(sid, "assistant", reply.text, after=text), count="replies")
    finally:
        with t.lock:
            t.inflight -= 1


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


def judge(args: argparse.Namespace, r: Run, data: Path) -> None:
    """A verdict for each continuation that differs from its recompute (bench/near_tie.py)."""
    misses = [e for c in r.cycles for e in [*c["exact"], c.get("control")] if e and not e["same"]]
    judge_misses(args.server_args, misses, data)


def left_by_kill(data: Path) -> dict[str, int]:
    """What a kill left for the next start to clean up (files, rows, temp files)."""
    try:
        found = snapshot_mismatch(data, read_db(data / "crowdchat.db"))
    except sqlite3.Error:  # killed before the first start made its tables
        return {"db_unreadable": 1}
    return {k: len(v) for k, v in found.items()}


def brief(result: dict) -> dict:
    """One restart's check as a line: counts, and each continuation's source and verdict."""
    out = {k: len(v) if isinstance(v, list) and k != "exact" else v for k, v in result.items()}
    out["exact"] = [(e["kv"], e["same"]) for e in result["exact"]]
    if "control" in result:
        out["control"] = (result["control"]["kv"], result["control"]["same"])
    return out


def metrics(base: str) -> dict[str, float]:
    """The counters a cycle ends with (they restart at zero with the process)."""
    want = {
        "crowdchat_session_persists_total": "persists",
        'crowdchat_session_restores_total{source="disk"}': "disk_restores",
        "crowdchat_session_evictions_total": "evictions",
    }
    try:
        text = httpx.get(base + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in want:
            out[want[name]] = float(value)
    return out


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


async def run(args: argparse.Namespace, work: Path) -> tuple[Run, Tally]:
    """Start, load, kill, restart, check, `args.kills` times; then a clean stop."""
    rng = random.Random(args.seed)
    data, log = work / "data", work / "server.log"
    api_users = args.users - args.page_users
    keys = [secrets.token_hex(16) for _ in range(api_users)]
    ref = secrets.token_hex(16)
    key_file = work / "api-keys.txt"
    key_file.write_text("".join(f"user{i}:{k}\n" for i, k in enumerate(keys)) + f"ref:{ref}\n")
    server = Crashable(data, log, [*args.server_args.split(), "--api-keys", str(key_file)])
    crowd = Crowd(server.base, keys, args.page_users, args)
    r = Run()
    wall0 = time.perf_counter()
    # no keep-alive: a pooled connection to a killed server would fail the next request
    limits = httpx.Limits(max_connections=args.users + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.base, timeout=120, limits=limits) as http:
        users = [
            asyncio.create_task(crowd.api_user(i, http, random.Random(rng.random())))
            for i in range(api_users)
        ]
        pages = [
            threading.Thread(target=crowd.page_user, args=(i, random.Random(rng.random())))
            for i in range(args.page_users)
        ]
        for p in pages:
            p.start()
        kills = 0
        while True:
            if 0 < kills < args.kills and rng.random() < args.startup_kills:
                server.spawn()  # killed while it loads, migrates, sweeps and reconciles
                time.sleep(rng.uniform(0.5, 0.9 * statistics.median(r.starts)))
                server.kill()
                kills += 1
                r.kinds["startup"] += 1
                r.left.update(left_by_kill(data))
                continue
            r.starts.append(server.start())
            result = await check(crowd, data, ref, rng, len(r.cycles))
            result["start_s"] = round(r.starts[-1], 1)
            if kills == args.kills:
                r.cycles.append(result)
                print(json.dumps(brief(result)), flush=True)
                break
            crowd.up.set()
            await asyncio.sleep(rng.uniform(*args.up))
            r.totals.update(metrics(server.base))
            result["inflight_at_kill"] = crowd.tally.inflight
            server.kill()
            crowd.up.clear()
            kills += 1
            r.kinds["load"] += 1
            result["left_by_kill"] = left_by_kill(data)
            r.left.update(result["left_by_kill"])
            r.cycles.append(result)
            print(json.dumps(brief(result)), flush=True)
            await asyncio.sleep(1.0)  # the users see their streams break
        crowd.done = True
        await asyncio.gather(*users)
        for p in pages:
            p.join()
    server.stop()  # a clean stop writes every resident KV: files and rows still one for one
    r.after_stop = snapshot_mismatch(data, read_db(data / "crowdchat.db"))
    r.wall_s = time.perf_counter() - wall0
    return r, crowd.tally


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--users", type=int, default=32, help="all users, the page's included")
    ap.add_argument("--page-users", type=int, default=4)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--up", default="4,30", help="seconds of load before each kill: MIN,MAX")
    ap.add_argument("--startup-kills", type=float, default=0.15, help="share killed at start-up")
    ap.add_argument("--think", default="0,3", help="seconds between a user's turns: MIN,MAX")
    ap.add_argument("--turns-per-session", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--exact-per-restart", type=int, default=3)
    ap.add_argument("--page-timeout", type=float, default=120)
    ap.add_argument("--server-args", default=" ".join([*EXACT, FAST]))
    ap.add_argument("--work-dir", help="where the data dir and server log go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir (data, server.log)")
    args = ap.parse_args()
    args.up = tuple(float(x) for x in args.up.split(","))
    args.think = tuple(float(x) for x in args.think.split(","))
    assert 0 <= args.page_users < args.users, "--page-users must leave an API user"
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="crowdchat-crash-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        r, tally = asyncio.run(run(args, work))
        judge(args, r, work / "data")
        summary = summarize(args, r, tally, (work / "server.log").read_text(errors="replace"))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary["work_dir"] = str(work) if args.keep else None
    print(json.dumps(summary, default=str))
    sys.exit(1 if summary["failed"] else 0)


if __name__ == "__main__":
    main()
