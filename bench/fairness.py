"""Does one heavy user starve the others? Each scenario under --schedule fcfs and fair, over HTTP.

crowdchat is started by this script (bench/server.py's `Server`), once per policy and scenario,
with the same flags but `--schedule`; the per-identity caps are raised (those of
`--tokens-per-minute`, `--max-turns-per-user`, ... that this build has) so the scheduler, not
the caps, is measured. Each owner is a client of its own (anonymous mode: a client is its
address, `stream_client.client_headers`); requests are one-off completions (no session),
streamed, EOS ignored.

- Protection: 4 light users in a closed loop (one request at a time, ~100-token prompt, 64 new
  tokens), first alone, then beside one heavy owner keeping 8 requests in flight (~1,500-token
  prompts, 256 new tokens). `light_ttft_p95_fair_over_fcfs` (target <= 0.25) and
  `light_ttft_p95_ratio_vs_alone` (fair; target <= 3.0).
- Share: `--max-num-seqs 8`; owners A, B, C keep 16, 4 and 1 requests outstanding (~200-token
  prompts, 128 new tokens). Tokens streamed to each owner in the window against the max-min fair
  share of the 8 batch slots (3.5 : 3.5 : 1): `share_error_max` = max |served share - fair
  share| / fair share (fair; target <= 0.15) and `share_error_max_fcfs`.
- `throughput_vs_fcfs`: tokens/s over both loaded phases, fair over fcfs (target >= 0.9).

Prints one JSON object per phase, then a summary JSON object (last line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.load import pct  # noqa: E402
from bench.mixed import cpu_name  # noqa: E402
from bench.server import ROOT, Server  # noqa: E402
from bench.stream_client import ReplyCount, client_headers, stream_body  # noqa: E402
from engine.core.fair_share import max_min_share  # noqa: E402

# Per-identity caps off (0) where this build has the flag: the scheduler is what is measured.
CAPS_OFF = (
    "--tokens-per-minute",
    "--max-turns-per-user",
    "--max-requests-per-user",
    "--max-sessions-per-user",
)
WORDS = (
    "the sun rose over a quiet town and people went to work in the fields near the river "
    "while children played by the old stone bridge and birds sang in tall green trees"
).split()
SHARE_OUTSTANDING = {"A": 16, "B": 4, "C": 1}


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


def light_ttfts(lights: list[Owner], t0: float, t1: float) -> list[float]:
    """TTFTs of requests sent in [t0, t1]; one still without a token when the phase ended
    counts as its wait so far (a lower bound), so a starved user is not left out."""
    done = [ttft for o in lights for sent, ttft in o.ttft if t0 <= sent <= t1]
    return done + [t1 - sent for o in lights for sent in o.unanswered if t0 <= sent <= t1]


def protection(server: Server, args: argparse.Namespace, policy: str) -> dict:
    lights = [Owner(f"light{i}") for i in range(4)]
    light_load = [(o, 1, args.light_prompt, args.light_new, 0.0) for o in lights]
    t0, t1 = asyncio.run(run_loads(server.base, light_load, args.alone_seconds))
    alone = light_ttfts(lights, t0, t1)
    wait_idle(server)
    lights = [Owner(f"light{i}") for i in range(4)]
    heavy = Owner("heavy")
    head = args.heavy_head_start  # the heavy owner is already busy when the light ones come
    loads = [
        (heavy, 8, args.heavy_prompt, args.heavy_new, 0.0),
        *[(o, 1, args.light_prompt, args.light_new, head) for o in lights],
    ]
    before = server.metrics().get("crowdchat_preemptions_total", 0)
    m0, m1 = asyncio.run(run_loads(server.base, loads, head + args.mixed_seconds))
    wait_idle(server)
    mixed = light_ttfts(lights, m0, m1)
    preempted = server.metrics().get("crowdchat_preemptions_total", 0) - before
    tokens = sum(o.tokens_between(m0, m1) for o in [heavy, *lights])
    out = {
        "scenario": "protection",
        "schedule": policy,
        "light_ttft_alone_p50_s": pct(alone, 50),
        "light_ttft_alone_p95_s": pct(alone, 95),
        "light_requests_alone": len(alone),
        "light_ttft_mixed_p50_s": pct(mixed, 50),
        "light_ttft_mixed_p95_s": pct(mixed, 95),
        "light_requests_mixed": len(mixed),
        "light_unanswered_mixed": sum(len(o.unanswered) for o in lights),
        "heavy_requests_started": len(heavy.ttft),
        "heavy_prompt_tokens": pct([float(x) for x in heavy.prompt_tokens], 50),
        "light_prompt_tokens": pct([float(x) for o in lights for x in o.prompt_tokens], 50),
        "mixed_tokens": round(tokens),
        "mixed_wall_s": round(m1 - m0, 2),
        "preemptions": preempted,
        "errors": sum(o.errors for o in [heavy, *lights]),
    }
    print(json.dumps(out), flush=True)
    return out


def share(server: Server, args: argparse.Namespace, policy: str) -> dict:
    owners = {name: Owner(name) for name in SHARE_OUTSTANDING}
    loads = [
        (owners[n], k, args.share_prompt, args.share_new, 0.0) for n, k in SHARE_OUTSTANDING.items()
    ]
    before = server.metrics().get("crowdchat_preemptions_total", 0)
    t0, t1 = asyncio.run(run_loads(server.base, loads, args.share_warmup + args.share_seconds))
    wait_idle(server)
    w0 = t0 + args.share_warmup
    served = {n: o.tokens_between(w0, t1) for n, o in owners.items()}
    total = sum(served.values()) or 1.0
    fair = max_min_share(SHARE_OUTSTANDING, args.share_slots)
    errors = {
        n: abs(served[n] / total - fair[n] / args.share_slots) / (fair[n] / args.share_slots)
        for n in owners
    }
    out = {
        "scenario": "share",
        "schedule": policy,
        "served_tokens": {n: round(v) for n, v in served.items()},
        "served_share": {n: round(v / total, 4) for n, v in served.items()},
        "fair_share": {n: round(f / args.share_slots, 4) for n, f in fair.items()},
        "share_error": {n: round(e, 4) for n, e in errors.items()},
        "share_error_max": round(max(errors.values()), 4),
        "tokens": round(total),
        "wall_s": round(t1 - w0, 2),
        "preemptions": server.metrics().get("crowdchat_preemptions_total", 0) - before,
        "errors": sum(o.errors for o in owners.values()),
    }
    print(json.dumps(out), flush=True)
    return out


def caps_off() -> list[str]:
    """The per-identity cap flags this build has, each set to 0 (off)."""
    help_text = subprocess.run(
        [sys.executable, str(ROOT / "app.py"), "--help"], capture_output=True, text=True, cwd=ROOT
    ).stdout
    return [x for flag in CAPS_OFF if flag in help_text for x in (flag, "0")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--alone-seconds", type=float, default=15.0)
    ap.add_argument("--mixed-seconds", type=float, default=60.0)
    ap.add_argument("--heavy-head-start", type=float, default=10.0)
    ap.add_argument("--share-seconds", type=float, default=60.0)
    ap.add_argument("--share-warmup", type=float, default=5.0)
    ap.add_argument("--share-slots", type=int, default=8)
    ap.add_argument("--light-prompt", type=int, default=100)
    ap.add_argument("--light-new", type=int, default=64)
    ap.add_argument("--heavy-prompt", type=int, default=1500)
    ap.add_argument("--heavy-new", type=int, default=256)
    ap.add_argument("--share-prompt", type=int, default=200)
    ap.add_argument("--share-new", type=int, default=128)
    ap.add_argument("--policies", default="fcfs,fair")
    ap.add_argument(
        "--server-args",
        default="--kv-budget-mb 1536",
        help="flags for every crowdchat it starts (the same for both policies), "
        "e.g. '--target-itl-ms 300'",
    )
    args = ap.parse_args()
    data = tempfile.mkdtemp(prefix="crowdchat-fair-")  # one converted model for all starts
    common = [*args.server_args.split(), *caps_off(), "--data-dir", data]
    results: dict[str, dict[str, dict]] = {}
    for policy in args.policies.split(","):
        results[policy] = {}
        for scenario, run, extra in (
            ("protection", protection, []),
            ("share", share, ["--max-num-seqs", str(args.share_slots)]),
        ):
            server = Server(None, [*common, *extra, "--schedule", policy])
            try:
                warm_up(server)
                results[policy][scenario] = run(server, args, policy)
            finally:
                server.stop()
    summary: dict[str, object] = {
        "machine": f"{cpu_name()} {platform.machine()}",
        "server_args": " ".join(common[:-2]),
    }
    fair, fcfs = results.get("fair"), results.get("fcfs")
    if fair:
        p = fair["protection"]
        summary["light_ttft_p95_ratio_vs_alone"] = round(
            p["light_ttft_mixed_p95_s"] / p["light_ttft_alone_p95_s"], 3
        )
        summary["share_error_max"] = fair["share"]["share_error_max"]
    if fcfs:
        summary["share_error_max_fcfs"] = fcfs["share"]["share_error_max"]
    if fair and fcfs:
        summary["light_ttft_p95_fair_over_fcfs"] = round(
            fair["protection"]["light_ttft_mixed_p95_s"]
            / fcfs["protection"]["light_ttft_mixed_p95_s"],
            3,
        )

        def rate(r: dict) -> float:
            p, s = r["protection"], r["share"]
            return (p["mixed_tokens"] + s["tokens"]) / (p["mixed_wall_s"] + s["wall_s"])

        summary["throughput_vs_fcfs"] = round(rate(fair) / rate(fcfs), 3)
    for policy, r in results.items():
        summary[f"light_ttft_mixed_p95_s_{policy}"] = r["protection"]["light_ttft_mixed_p95_s"]
        summary[f"light_ttft_alone_p95_s_{policy}"] = r["protection"]["light_ttft_alone_p95_s"]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
