"""crowdchat as a front end over vLLM (`--engine-url`): what it costs and how it spreads.

One run, one box, ratios within it:
- `frontend_overhead`: 1 - tok/s of N stateless users through crowdchat over one vLLM / the
  same users straight to that vLLM (bench/load.py's run_point on each), and crowdchat's own
  CPU seconds per 1,000 relayed tokens (psutil), `frontend_tokens_per_core_s` = 1000 / that.
- `replicas_2_vs_1`: session users' tok/s through crowdchat over two replicas, each pinned to
  its own core (taskset + VLLM_CPU_OMP_THREADS_BIND), over one replica on one core.
- `sticky_fraction`: over two replicas, the share of each session's turns served by the
  replica its first turn went to, read from the replicas' request logs (each session sends its
  own `seed`, which vLLM logs with every request).
- `frontend_requests_per_s`: short session turns through crowdchat against fast fake vLLM
  replicas (tests/fake_upstream.py), so the front end and its SQLite writer are the limit.
Prints one JSON object per measurement, the summary last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: bench/ is then first on the path, not the root

from bench.load import run_point  # noqa: E402
from bench.peers import provenance  # noqa: E402
from bench.server import PROXY_ARGS, Server, free_port  # noqa: E402
from bench.stream_client import client_headers  # noqa: E402
from bench.vllm_cpu import (  # noqa: E402
    CACHE,
    VLLM_PIN,
    Launched,
    VllmSpec,
    add_vllm_dtype,
    crowdchat_command,
    prepare_lock,
    prepare_model,
    prepare_vllm,
    serving_vllm,
)

SEED_BASE = 7_000_000  # sticky sessions send seeds from here: unique in the replicas' logs
# crowdchat's per-identity limits are for crowds of people; a benchmark's users are one box
NO_LIMITS = ["--tokens-per-minute", "0", "--max-turns-per-user", "0"]
NO_LIMITS += ["--max-requests-per-user", "0", "--max-pending-creates", "0"]
NO_LIMITS += ["--max-pending-creates-per-user", "0", "--new-identities-per-minute", "100000"]


def add_stream_interval(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--stream-interval",
        type=int,
        default=0,
        help="crowdchat's --upstream-stream-interval (0: its automatic choice; 1: every token)",
    )


class Front:
    """crowdchat over `urls` in its own process, with its CPU time readable."""

    def __init__(
        self, urls: list[str], model: Path, logs: Path, name: str, stream_interval: int = 0
    ) -> None:
        self.data = Path(tempfile.mkdtemp(prefix="crowdchat-scale-"))
        port = free_port()
        flags = [*NO_LIMITS, *PROXY_ARGS, "--upstream-stream-interval", str(stream_interval)]
        cmd = crowdchat_command(urls, model, port, self.data, *flags)
        self.app = Launched(name, cmd, port, logs)
        self.base = self.app.wait_ready("/health", timeout=300)
        self.ps = psutil.Process(self.app.proc.pid)

    def cpu_s(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def __enter__(self) -> Front:
        return self

    def __exit__(self, *exc: object) -> None:
        self.app.stop()


def point(base: str, users: int, args: argparse.Namespace, stateless: bool) -> dict:
    """One closed-loop point (after a short warm-up) against `base`."""
    server = Server(base, [])
    asyncio.run(run_point(server, 2, 1, 8, (0, 0), stateless=stateless))
    return asyncio.run(
        run_point(server, users, args.turns, args.new_tokens, (0, 0), stateless=stateless)
    )


def emit(name: str, p: dict, **extra: object) -> None:
    keys = ("users", "wall_s", "tokens", "tokens_per_s", "ttft_p50_s", "errors")
    print(json.dumps({"point": name, **{k: p[k] for k in keys}, **extra}), flush=True)


def overhead(vllm: str, model: Path, args: argparse.Namespace) -> dict:
    """Direct vs through crowdchat, alternating rounds; crowdchat's CPU per relayed token."""
    direct, via, cpu, relayed = [], [], 0.0, 0
    with Front([vllm], model, args.logs, "crowdchat-overhead", args.stream_interval) as front:
        for r in range(args.rounds):
            d = point(vllm, args.users, args, stateless=True)
            emit("direct", d, round=r)
            before = front.cpu_s()
            v = point(front.base, args.users, args, stateless=True)
            cpu += front.cpu_s() - before
            relayed += v["tokens"]
            emit("via_crowdchat", v, round=r)
            direct.append(d["tokens_per_s"])
            via.append(v["tokens_per_s"])
    per_1k = cpu / max(relayed, 1) * 1000  # warm-ups excluded: only the measured points' CPU
    return {
        "direct_tokens_per_s": round(sum(direct) / len(direct), 2),
        "via_crowdchat_tokens_per_s": round(sum(via) / len(via), 2),
        "frontend_overhead": round(1 - sum(via) / sum(direct), 3),
        "frontend_cpu_s_per_1k_tokens": round(per_1k, 4),
        "frontend_tokens_per_core_s": round(1000 / per_1k, 1) if per_1k else None,
    }


async def sticky_users(base: str, sessions: int, turns: int) -> None:
    """`sessions` conversations at once, each `turns` short turns with its own seed."""

    async def one(i: int, http: httpx.AsyncClient) -> None:
        auth = client_headers(f"sticky-{i}")
        made = await http.post("/v1/sessions", headers=auth)
        headers = {**auth, "X-Session-Id": made.json()["id"]}
        for t in range(turns):
            body = {
                "messages": [{"role": "user", "content": f"Say one word about the number {t}."}],
                "max_tokens": 8,
                "seed": SEED_BASE + i,
            }
            r = await http.post("/v1/chat/completions", json=body, headers=headers)
            r.raise_for_status()

    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        await asyncio.gather(*(one(i, http) for i in range(sessions)))


def sticky_fraction(logs: list[Path], sessions: int) -> tuple[float | None, list[int]]:
    """Per session, the share of its turns on the replica of its first turn (mean over
    sessions); plus how many sessions each replica owned. From vLLM's request log lines."""
    pattern = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d).*Received request .*?seed=(\d+)")
    order: dict[int, list[int]] = {}  # seed -> the replica of each of its turns
    first_seen: dict[int, tuple[str, int]] = {}
    for index, log in enumerate(logs):
        for line in log.read_text(errors="replace").splitlines():
            m = pattern.search(line)
            if m and SEED_BASE <= int(m.group(2)) < SEED_BASE + sessions:
                seed = int(m.group(2))
                order.setdefault(seed, []).append(index)
                # to the second: turns of one session are sequential, seconds apart here
                first_seen[seed] = min(
                    first_seen.get(seed, (m.group(1), index)), (m.group(1), index)
                )
    if not order:
        return None, []
    shares = [Counter(v)[first_seen[s][1]] / len(v) for s, v in order.items()]
    owners = Counter(first_seen[s][1] for s in order)
    return round(sum(shares) / len(shares), 3), [owners.get(i, 0) for i in range(len(logs))]


def replicas(servers: list[Launched], model: Path, args: argparse.Namespace) -> dict:
    """Session users over one pinned replica, then over both; stickiness over both."""
    out: dict[str, object] = {}
    tps = {}
    for n in (1, 2):
        urls = [s.base for s in servers[:n]]
        with Front(
            urls, model, args.logs, f"crowdchat-{n}-replicas", args.stream_interval
        ) as front:
            p = point(front.base, args.users, args, stateless=False)
            emit(f"replicas_{n}", p)
            tps[n] = p["tokens_per_s"]
            if n == 2:
                asyncio.run(sticky_users(front.base, args.sticky_sessions, args.sticky_turns))
    frac, owners = sticky_fraction([s.log_path for s in servers], args.sticky_sessions)
    out.update(
        replicas_1_tokens_per_s=tps[1],
        replicas_2_tokens_per_s=tps[2],
        replicas_2_vs_1=round(tps[2] / tps[1], 2) if tps[1] else None,
        sticky_fraction=frac,
        sticky_sessions_per_replica=owners,
    )
    return out


def requests_per_s(model: Path, args: argparse.Namespace) -> dict:
    """Short session turns through crowdchat over two fast fake vLLM replicas (threads of
    this process, so their CPU is not crowdchat's)."""
    from tests.fake_upstream import FakeReplica

    fakes = [FakeReplica(f"fake{i}", words=args.fake_tokens).start() for i in range(2)]
    try:
        with Front(
            [f.url for f in fakes], model, args.logs, "crowdchat-fake", args.stream_interval
        ) as front:
            server = Server(front.base, [])
            asyncio.run(run_point(server, 4, 1, 8, (0, 0)))  # warm-up
            warm = sum(f.completed for f in fakes)
            before, t0 = front.cpu_s(), time.perf_counter()
            until = time.perf_counter() + args.rps_seconds
            p = asyncio.run(
                run_point(server, args.rps_users, 0, args.fake_tokens, (0, 0), until=until)
            )
            wall, cpu = time.perf_counter() - t0, front.cpu_s() - before
            turns = sum(f.completed for f in fakes) - warm
    finally:
        for f in fakes:
            f.stop()
    emit("fake_upstream", p, turns=turns)
    return {
        "frontend_requests_per_s": round(turns / wall, 1),
        "frontend_requests_cpu_ms_each": round(cpu / max(turns, 1) * 1000, 2),
        "frontend_fake_tokens_per_s": p["tokens_per_s"],
        "frontend_fake_errors": sum(p["errors"].values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--turns", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="direct/via pairs for the overhead")
    ap.add_argument("--sticky-sessions", type=int, default=16)
    ap.add_argument("--sticky-turns", type=int, default=3)
    ap.add_argument("--rps-users", type=int, default=64)
    ap.add_argument("--rps-seconds", type=float, default=20)
    ap.add_argument("--fake-tokens", type=int, default=16, help="tokens per fake reply")
    ap.add_argument("--kv-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE per replica")
    ap.add_argument("--eager", action="store_true", help="vLLM --enforce-eager (fast start)")
    add_vllm_dtype(ap)
    add_stream_interval(ap)
    ap.add_argument("--skip", default="", help="comma-separated: overhead,replicas,rps")
    ap.add_argument("--cache", type=Path, default=CACHE)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    args.logs = Path(tempfile.mkdtemp(prefix="crowdchat-scale-logs-"))
    with prepare_lock(args.cache):
        python = prepare_vllm(args.cache)
        _, model = prepare_model(args.cache)
    summary: dict[str, object] = {}
    if not {"overhead", "replicas"} <= skip:
        extra = ("--enable-prefix-caching", "--enable-log-requests")
        extra += ("--enforce-eager",) if args.eager else ()
        cores = [str(i % (os.cpu_count() or 1)) for i in range(2)]
        specs = [
            VllmSpec(python, model, free_port(), args.kv_gb, c, args.vllm_dtype, 2048, extra)
            for c in cores
        ]
        with serving_vllm(specs, args.logs) as servers:
            if "overhead" not in skip:
                summary.update(overhead(servers[0].base, model, args))
            if "replicas" not in skip:
                summary.update(replicas(servers, model, args))
    if "rps" not in skip:
        summary.update(requests_per_s(model, args))
    summary.update(
        workload={"users": args.users, "turns": args.turns, "new_tokens": args.new_tokens},
        vllm=VLLM_PIN,
        vllm_eager=args.eager,
        stream_interval=args.stream_interval or "auto",
        logs=str(args.logs),
        **provenance(),
    )
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
