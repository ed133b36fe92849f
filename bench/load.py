"""Closed-loop simulated users over the OpenAI-compatible HTTP API (streaming).

Each user owns a server-side session (its own API key) and has a multi-turn conversation:
the next turn is sent when the previous reply has ended (plus a think time in --think mode).
With --stateless a user keeps its history client-side and sends all of it each turn (the
one-off OpenAI way), so any OpenAI-compatible server can be loaded (bench/peers.py does).
Without --base it starts crowdchat itself on a free loopback port and watches its memory.
Prints one JSON object per point, then (with --soak-seconds) the soak, then a summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.server import Server  # noqa: E402
from bench.stream_client import ReplyCount, client_headers, stream_body  # noqa: E402

QUESTIONS = [
    "Tell me about the history of the bicycle.",
    "What makes a good cup of tea?",
    "Describe a walk through a forest in autumn.",
    "How do airplanes stay in the air?",
    "Write a short story about a lighthouse keeper.",
    "Explain how rain forms.",
]


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 4) if xs else None


class Stats:
    def __init__(self) -> None:
        self.tokens = 0
        self.ttft: list[float] = []
        self.ttft_by_kv: dict[str, list[float]] = {}
        self.errors: Counter[str] = Counter()
        self.user_rates: list[float] = []


async def one_turn(
    http: httpx.AsyncClient,
    headers: dict[str, str],
    messages: list[dict[str, str]],
    new_tokens: int,
    stats: Stats,
    model: str | None = None,
) -> tuple[int, str]:
    """Send one request, stream the reply; returns the tokens generated and the reply text."""
    body = stream_body(messages, new_tokens)
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    first = None
    reply = ReplyCount()
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            stats.errors[f"http_{r.status_code}"] += 1
            return 0, ""
        kv = r.headers.get("x-crowdchat-kv", "")
        async for line in r.aiter_lines():
            if reply.feed(line):
                first = first or time.perf_counter()
            if reply.failed:
                stats.errors["stream_error"] += 1
                return 0, ""
    if first is not None:
        stats.ttft.append(first - t0)
        stats.ttft_by_kv.setdefault(kv, []).append(first - t0)
    stats.tokens += reply.tokens
    return reply.tokens, reply.text


async def user(
    http: httpx.AsyncClient,
    turns: int,
    new_tokens: int,
    think: tuple[float, float],
    stats: Stats,
    until: float | None = None,
    stateless: bool = False,
    model: str | None = None,
) -> None:
    auth = client_headers(secrets.token_hex(8))
    history: list[dict[str, str]] = []  # --stateless: the conversation lives here

    async def new_conversation() -> dict[str, str]:
        history.clear()
        if stateless:
            return auth
        made = await http.post("/v1/sessions", headers=auth)
        return {**auth, "X-Session-Id": made.json()["id"]}

    headers = await new_conversation()
    started, mine, n = time.perf_counter(), 0, 0
    while (n < turns) if until is None else (time.perf_counter() < until):
        question = {"role": "user", "content": random.choice(QUESTIONS)}
        try:
            sent = [*history, question] if stateless else [question]
            tokens, reply = await one_turn(http, headers, sent, new_tokens, stats, model)
            mine += tokens
            if stateless and tokens:
                history.extend([question, {"role": "assistant", "content": reply}])
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            stats.errors[type(e).__name__] += 1
        n += 1
        if until is not None and n % 4 == 0:  # soak: fresh conversations, bounded contexts
            headers = await new_conversation()
        if think[1] > 0 and (until is None and n < turns or until is not None):
            await asyncio.sleep(random.uniform(*think))
    stats.user_rates.append(mine / max(time.perf_counter() - started, 1e-6))


async def run_point(
    server: Server,
    users: int,
    turns: int,
    new_tokens: int,
    think: tuple[float, float],
    until: float | None = None,
    rss_every: float = 0.0,
    stateless: bool = False,
) -> dict:
    stats = Stats()
    before = server.metrics()
    peak = {"rss": server.rss_mb() or 0.0, "blocks": 0.0}
    series: list[tuple[float, float]] = []  # (seconds in, RSS MB) every `rss_every` seconds
    start = time.perf_counter()

    async def watch() -> None:
        while True:
            now = time.perf_counter() - start
            if rss_every and (not series or now - series[-1][0] >= rss_every):
                series.append((round(now), round(server.rss_mb() or 0.0, 1)))
                print(json.dumps({"t_s": series[-1][0], "rss_mb": series[-1][1]}), flush=True)
            peak["rss"] = max(peak["rss"], server.rss_mb() or 0.0)
            peak["blocks"] = max(
                peak["blocks"], server.metrics().get("crowdchat_kv_blocks_used", 0)
            )
            await asyncio.sleep(1.0)

    limits = httpx.Limits(max_connections=users + 8, max_keepalive_connections=users + 8)
    async with httpx.AsyncClient(base_url=server.base, timeout=600, limits=limits) as http:
        # Some servers (vLLM) answer only to the model name they serve.
        model = (await http.get("/v1/models")).json()["data"][0]["id"] if stateless else None
        watcher = asyncio.create_task(watch())
        t0 = time.perf_counter()
        await asyncio.gather(
            *(
                user(http, turns, new_tokens, think, stats, until, stateless, model)
                for _ in range(users)
            )
        )
        wall = time.perf_counter() - t0
        watcher.cancel()
    after = server.metrics()

    def delta(prefix: str) -> float:
        return sum(v - before.get(k, 0) for k, v in after.items() if k.startswith(prefix))

    return {
        "users": users,
        "wall_s": round(wall, 2),
        "tokens": stats.tokens,
        "tokens_per_s": round(stats.tokens / wall, 2),
        "per_user_tokens_per_s": round(float(np.mean(stats.user_rates)), 2),
        "ttft_p50_s": pct(stats.ttft, 50),
        "ttft_p95_s": pct(stats.ttft, 95),
        "ttft_p99_s": pct(stats.ttft, 99),
        "ttft_p50_by_kv_s": {k: pct(v, 50) for k, v in stats.ttft_by_kv.items()},
        "turns_by_kv": {k: len(v) for k, v in stats.ttft_by_kv.items()},
        "errors": dict(stats.errors),
        "peak_rss_mb": round(peak["rss"], 1),
        "rss_series_mb": series,
        "kv_blocks_peak": peak["blocks"],
        "persists": delta("crowdchat_session_persists_total"),
        "restores": delta("crowdchat_session_restores_total"),
        "evictions": delta("crowdchat_session_evictions_total"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--base", help="an OpenAI-compatible server to load (default: start one)")
    ap.add_argument("--users", default="1,8,16,32,64")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--think", default="0,0", help="seconds between turns: MIN,MAX (e.g. 5,30)")
    ap.add_argument("--soak-seconds", type=float, default=0)
    ap.add_argument("--soak-users", type=int, default=16)
    ap.add_argument(
        "--rss-every",
        type=float,
        default=300.0,
        help="during the soak, print the server's RSS every this many seconds",
    )
    ap.add_argument(
        "--server-args",
        default="",
        help="flags for the crowdchat it starts, e.g. '--idle-seconds 3'",
    )
    ap.add_argument(
        "--stateless",
        action="store_true",
        help="no server sessions: each user sends its whole history each turn (any OpenAI server)",
    )
    args = ap.parse_args()
    think = tuple(float(x) for x in args.think.split(","))
    server = Server(args.base, args.server_args.split())
    summary: dict[str, object] = {"base": server.base}
    try:
        asyncio.run(run_point(server, 2, 1, 8, (0, 0), stateless=args.stateless))  # warm-up
        points = {}
        for n in [int(u) for u in args.users.split(",")]:
            points[n] = asyncio.run(
                run_point(server, n, args.turns, args.new_tokens, think, stateless=args.stateless)
            )
            print(json.dumps(points[n]), flush=True)
            summary[f"users_{n}_tokens_per_s"] = points[n]["tokens_per_s"]
            summary[f"users_{n}_ttft_p50_s"] = points[n]["ttft_p50_s"]
        errors = sum(c for p in points.values() for k, c in p["errors"].items() if k != "http_429")
        if 1 in points and 32 in points:
            summary["ratio_32_vs_1"] = round(
                points[32]["tokens_per_s"] / points[1]["tokens_per_s"], 2
            )
        summary["errors"] = errors
        summary["rejected_429"] = sum(p["errors"].get("http_429", 0) for p in points.values())
        summary["restores"] = sum(p["restores"] for p in points.values())
        summary["persists"] = sum(p["persists"] for p in points.values())
        if args.soak_seconds > 0:
            start_rss = server.rss_mb()
            soak = asyncio.run(
                run_point(
                    server,
                    args.soak_users,
                    0,
                    args.new_tokens,
                    think,
                    until=time.perf_counter() + args.soak_seconds,
                    rss_every=args.rss_every,
                    stateless=args.stateless,
                )
            )
            end_rss = server.rss_mb()
            soak.update(
                {
                    "soak_seconds": args.soak_seconds,
                    "rss_start_mb": start_rss,
                    "rss_end_mb": end_rss,
                }
            )
            print(json.dumps({"soak": soak}), flush=True)
            summary["errors"] = errors + sum(
                c for k, c in soak["errors"].items() if k != "http_429"
            )
            if start_rss is not None and end_rss is not None:
                summary["rss_growth_mb"] = round(end_rss - start_rss, 1)
    finally:
        server.stop()
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
