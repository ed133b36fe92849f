"""The owners of `bench/fairness.py`: each an API key of its own (a client of its own), keeping
a number of streamed one-off requests in flight and recording when its tokens arrived; a server
warmed up before and drained between the phases."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from bench.server import Server
from bench.stream_client import ReplyCount, client_headers, stream_body

WORDS = (
    "the sun rose over a quiet town and people went to work in the fields near the river "
    "while children played by the old stone bridge and birds sang in tall green trees"
).split()


def text_of(tokens: int, rng: random.Random) -> str:
    """About `tokens` prompt tokens once the chat template is around it (one word ~ a token)."""
    return " ".join(rng.choice(WORDS) for _ in range(max(tokens - 30, 1)))


@dataclass
class Owner:
    """One API key's requests: their TTFTs and the times its tokens arrived."""

    name: str
    key: str = field(default_factory=lambda: f"bench-{random.getrandbits(64):016x}")
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (sent at, TTFT)
    tokens: list[tuple[float, float]] = field(default_factory=list)  # (arrival, tokens)
    prompt_tokens: list[int] = field(default_factory=list)
    unanswered: list[float] = field(default_factory=list)  # sent at, no token when dropped
    errors: int = 0

    def tokens_between(self, t0: float, t1: float) -> float:
        return sum(n for t, n in self.tokens if t0 <= t <= t1)


async def one_request(http: httpx.AsyncClient, owner: Owner, prompt: str, new_tokens: int) -> None:
    body = stream_body([{"role": "user", "content": prompt}], new_tokens)
    headers = client_headers(owner.key)
    t0 = time.perf_counter()
    reply, stamps = ReplyCount(), []
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                owner.errors += 1
                return
            async for line in r.aiter_lines():
                if reply.feed(line):
                    stamps.append(time.perf_counter())
                    if len(stamps) == 1:  # counted even if the phase ends before the reply
                        owner.ttft.append((t0, stamps[0] - t0))
                elif line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage") or {}
                    if usage.get("prompt_tokens"):
                        owner.prompt_tokens.append(usage["prompt_tokens"])
            owner.errors += reply.failed
    except httpx.HTTPError:
        owner.errors += 1
    finally:
        # a chunk may carry several tokens: spread the reply's count over its chunks
        per = reply.tokens / len(stamps) if stamps and reply.usage else 1.0
        owner.tokens += [(t, per) for t in stamps]
        if not stamps:
            owner.unanswered.append(t0)


async def closed_loop(
    http: httpx.AsyncClient,
    owner: Owner,
    prompt_tokens: int,
    new_tokens: int,
    until: float,
    delay: float,
) -> None:
    rng = random.Random(owner.key)
    await asyncio.sleep(delay)
    while time.perf_counter() < until:
        await one_request(http, owner, text_of(prompt_tokens, rng), new_tokens)


async def run_loads(
    base: str, loads: list[tuple[Owner, int, int, int, float]], seconds: float
) -> tuple[float, float]:
    """Each (owner, streams, prompt tokens, new tokens, delay) keeps `streams` requests in
    flight from `delay` seconds in until `seconds`; then every open request is dropped (the
    server cancels it). Returns (t0, t1)."""
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=base, timeout=900, limits=limits) as http:
        t0 = time.perf_counter()
        until = t0 + seconds
        tasks = [
            asyncio.create_task(closed_loop(http, owner, p, n, until, delay))
            for owner, streams, p, n, delay in loads
            for _ in range(streams)
        ]
        await asyncio.sleep(seconds)
        t1 = time.perf_counter()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return t0, t1


def wait_idle(server: Server, timeout: float = 120) -> None:
    """Until the server has nothing running or queued (dropped requests are cancelled)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = server.metrics()
        if not m.get("crowdchat_running_requests") and not m.get("crowdchat_queue_length"):
            return
        time.sleep(0.5)


def warm_up(server: Server) -> None:
    """The first steps of a fresh server are slow (lazy kernels, the dense copy): not measured."""
    owner, rng = Owner("warm-up"), random.Random(0)

    async def go() -> None:
        async with httpx.AsyncClient(base_url=server.base, timeout=900) as http:
            await asyncio.gather(
                *(one_request(http, owner, text_of(n, rng), 4) for n in (100, 100, 20))
            )

    asyncio.run(go())
