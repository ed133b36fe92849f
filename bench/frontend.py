"""crowdchat's front-end CPU per streamed token, against fast fake vLLM replicas.

Two fake replicas (tests/fake_upstream.py, threads of this process: their CPU and the load
client's are not crowdchat's) stream long replies, paced (`--delay`); crowdchat runs in its
own process over them (`--engine-url`), and N closed-loop streaming users (bench/load.py's
run_point) talk to it over the API, one-off requests and session turns. Per point:
`frontend_cpu_s_per_1k_tokens` (crowdchat's user + system CPU from psutil, per 1,000 relayed
tokens) and `frontend_tokens_per_core_s` (1000 / that; the target is >= 2,000). Prints one
JSON object per point, the summary last. `--profile`: py-spy records crowdchat meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: bench/ is then first on the path, not the root

from bench.load import run_point  # noqa: E402
from bench.peers import provenance  # noqa: E402
from bench.scale import Front, add_stream_interval, emit  # noqa: E402
from bench.server import Server  # noqa: E402
from bench.vllm_cpu import CACHE, prepare_lock, prepare_model  # noqa: E402
from tests.fake_upstream import FakeReplica  # noqa: E402


def measure(front: Front, users: int, turns: int, tokens: int, stateless: bool) -> dict:
    """One closed-loop point; crowdchat's CPU seconds over it."""
    server = Server(front.base, [])
    asyncio.run(run_point(server, 4, 1, 16, (0, 0), stateless=stateless))  # warm-up
    before, t0 = front.cpu_s(), time.perf_counter()
    p = asyncio.run(run_point(server, users, turns, tokens, (0, 0), stateless=stateless))
    cpu, wall = front.cpu_s() - before, time.perf_counter() - t0
    per_1k = cpu / max(p["tokens"], 1) * 1000
    out = {
        "frontend_cpu_s_per_1k_tokens": round(per_1k, 4),
        "frontend_tokens_per_core_s": round(1000 / per_1k, 1) if per_1k else None,
        "frontend_cpu_ms_per_turn": round(cpu / max(users * turns, 1) * 1000, 2),
        "cpu_share": round(cpu / wall, 2),  # of one core
    }
    emit("oneoff" if stateless else "sessions", p, **out)
    return out


def profile(pid: int, seconds: float, out: Path) -> subprocess.Popen | None:
    """py-spy (if installed) records `pid` for `seconds` into `out` (raw, collapsed stacks),
    GIL holders only: a thread blocked in C (a queue's get) would otherwise look busy."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print(json.dumps({"profile": "py-spy not installed"}), flush=True)
        return None
    cmd = [spy, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "200"]
    cmd += ["-f", "raw", "--gil", "-o", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per fake reply")
    # paced like a real engine (vLLM-CPU here: ~8 tok/s per user at 32 users), so a token
    # mostly arrives alone: an unpaced fake lets every layer merge them and hides their cost
    ap.add_argument("--delay", type=float, default=0.03, help="seconds between fake tokens")
    add_stream_interval(ap)
    ap.add_argument("--profile", type=Path, help="py-spy raw output file (sessions point)")
    ap.add_argument("--cache", type=Path, default=CACHE)
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="crowdchat-frontend-logs-"))
    with prepare_lock(args.cache):
        _, model = prepare_model(args.cache)
    # the fake sends `words + 1` chunks: max_tokens caps each reply at exactly `tokens`
    fakes = [FakeReplica(f"fake{i}", words=args.tokens).start() for i in range(2)]
    for f in fakes:
        f.delay = args.delay
    summary: dict[str, object] = {}
    try:
        with Front(
            [f.url for f in fakes], model, logs, "crowdchat-frontend", args.stream_interval
        ) as front:
            summary["oneoff"] = measure(front, args.users, args.turns, args.tokens, True)
            spy = profile(front.app.proc.pid, 15, args.profile) if args.profile else None
            summary["sessions"] = measure(front, args.users, args.turns, args.tokens, False)
            if spy is not None:
                spy.wait()
    finally:
        for f in fakes:
            f.stop()
    summary.update(
        workload={"users": args.users, "turns": args.turns, "tokens": args.tokens},
        fake_delay_s=args.delay,
        stream_interval=args.stream_interval or "auto",
        logs=str(logs),
        **provenance(),
    )
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
