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
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.crash_checks import read_db, snapshot_mismatch  # noqa: E402
from bench.crash_crowd import Crowd, Tally  # noqa: E402
from bench.crash_report import Run, brief, check, judge, summarize  # noqa: E402
from bench.server import ROOT, free_port  # noqa: E402

EXACT = ["--quant", "none", "--dtype", "float32"]  # restored == recomputed but at near ties
# small and quick: idle KV goes to disk within the run, a small pool makes evictions happen
FAST = "--idle-seconds 2 --max-tokens-per-turn 24 --kv-budget-mb 256 --tokens-per-minute 0"


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


def left_by_kill(data: Path) -> dict[str, int]:
    """What a kill left for the next start to clean up (files, rows, temp files)."""
    try:
        found = snapshot_mismatch(data, read_db(data / "crowdchat.db"))
    except sqlite3.Error:  # killed before the first start made its tables
        return {"db_unreadable": 1}
    return {k: len(v) for k, v in found.items()}


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
