"""The crowd's load: conversations that arrive as a Poisson process, each of several rounds with
an exponential think time between them, over one shared system prompt, against any
OpenAI-compatible server. Two modes: `stateless` resends the whole history each round (any
server), `sessions` keeps it on a crowdchat server (`X-Session-Id`, only the new message sent).
Every conversation names its person in OpenAI's `user` field (`Load.end_users`), as an app's
backend serving its users from one address would. Every request is timed (time to first token,
time per output token, reply latency) and judged against an SLO; bench/crowd.py sweeps arrival
rates over this and finds each server's capacity."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from bench.stream_client import ReplyCount, stream_body

# ~300 tokens of one operator's system prompt, shared by every conversation (a prefix cache's
# chance, as in a real deployment)
SYSTEM_PREFIX = (
    "You are the help desk assistant of Northwind Outfitters, a shop that sells hiking, camping "
    "and climbing gear online and in twelve stores. Answer in plain, friendly English. Keep "
    "answers short unless the customer asks for detail. Our return policy: unused items within "
    "60 days with the receipt, worn items within 30 days if faulty; sale items are final. "
    "Shipping is free over 50 euros inside the EU and takes two to four working days; express "
    "delivery costs 9 euros and arrives the next working day if ordered before 2 pm. We repair "
    "tents, sleeping bags and jackets in our workshop in Leipzig; a repair takes about two "
    "weeks and the first one for each item is free. Members of the Trail Club collect one point "
    "per euro and get 10 euros off for every 200 points; membership is free. Never promise a "
    "delivery date we cannot keep, never ask for a full card number, and hand over to a person "
    "when a customer asks for one or is upset. Stores open 9 am to 8 pm on weekdays and 10 am "
    "to 6 pm on Saturdays; they are closed on Sundays and public holidays. If you do not know "
    "an answer, say so and offer to find out. Prices include VAT. We do not sell firearms, "
    "knives longer than 12 cm, or gas canisters by post."
)

OPENERS = [
    "Hi, I bought a tent from you last month and one of the poles cracked on the first night.",
    "Hello! I'm planning a three-day hike in the Alps in October and need advice on layers.",
    "Can you help me choose a sleeping bag for winter camping in Norway?",
    "I ordered climbing shoes two weeks ago and they still haven't arrived.",
    "What's the difference between your two cheapest rain jackets?",
    "My son is starting a scouting group; what should a first backpack for a 10-year-old have?",
    "Is it possible to return a stove I used once? It doesn't light reliably.",
    "I want to join the Trail Club. How do the points work exactly?",
    "Do you ship to Switzerland, and if so, how long does it take and what does it cost?",
    "I need a gift for a friend who loves bouldering, budget around 60 euros.",
]
FOLLOW_UPS = [
    "Thanks. And what if the receipt got lost?",
    "Could you explain that in a bit more detail, please?",
    "How much would that cost in total, including delivery?",
    "Okay. Is there anything similar that is lighter?",
    "What would you recommend for someone who has never done this before?",
    "I also read somewhere that the warranty is two years. Is that right for all products?",
    "That sounds good. Can I pick it up in the store in Dresden instead?",
    "Sorry, one more question: do you also repair zips on backpacks, or only tents and bags?",
    "My partner is much taller than me, about 1.95 m. Does that change your advice?",
    "Great, and if it doesn't fit, can I exchange it for a different size at no cost?",
    "Let me give you more context: we will be camping near a lake, nights around zero degrees, "
    "two adults and a dog, and we will carry everything about eight kilometres from the car.",
    "Please list the three options you think are best, with one sentence on each.",
]


def conversation_script(rng: random.Random, rounds: int) -> list[str]:
    """One conversation's user messages: an opener, then follow-ups (sometimes two joined)."""
    lines = [rng.choice(OPENERS)]
    for _ in range(rounds - 1):
        picked = rng.sample(FOLLOW_UPS, 2 if rng.random() < 0.3 else 1)
        lines.append(" ".join(picked))
    return lines


@dataclass(frozen=True)
class Load:
    """One load point: `rate` new conversations a second for `seconds`, each of `rounds`."""

    rate: float
    seconds: float
    rounds: int = 6
    think_mean_s: float = 5.0
    reply_tokens: int = 64
    mode: str = "stateless"  # or "sessions" (crowdchat only)
    seed: int = 0
    # each conversation names its person in OpenAI's `user` field, as an app's backend would:
    # a crowdchat server's per-user limits then count each of them, not this one client
    end_users: bool = True


@dataclass
class Sample:
    """One request: its round (0: the conversation's first), times in seconds."""

    round: int
    ok: bool
    ttft: float | None = None
    latency: float | None = None
    tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.latency is None or self.tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.tokens - 1)


@dataclass
class Crowd:
    """Everything one load point's requests recorded."""

    samples: list[Sample] = field(default_factory=list)
    conversations: int = 0
    finished: int = 0


async def one_request(
    http: httpx.AsyncClient, body: dict, headers: dict[str, str], rnd: int
) -> tuple[Sample, str]:
    """Stream one reply; the sample and the reply's text."""
    t0 = time.perf_counter()
    first = None
    reply = ReplyCount()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                return Sample(rnd, False, error=f"http_{r.status_code}"), ""
            async for line in r.aiter_lines():
                if reply.feed(line) and first is None:
                    first = time.perf_counter()
                if reply.failed:
                    return Sample(rnd, False, error="stream_error"), ""
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return Sample(rnd, False, error=type(e).__name__), ""
    done = time.perf_counter()
    if first is None:
        return Sample(rnd, False, error="empty_reply"), ""
    return Sample(rnd, True, first - t0, done - t0, reply.tokens), reply.text


async def conversation(
    http: httpx.AsyncClient, load: Load, model: str | None, rng: random.Random, crowd: Crowd
) -> None:
    """One user's conversation: every round, then gone (think time between rounds)."""
    crowd.conversations += 1
    user_id = f"crowd-{load.seed}-{crowd.conversations}"
    headers: dict[str, str] = {}
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM_PREFIX}]
    if load.mode == "sessions":
        made = await http.post("/v1/sessions", json={"system_prompt": SYSTEM_PREFIX})
        if made.status_code != 200:
            crowd.samples.append(Sample(0, False, error=f"session_http_{made.status_code}"))
            return
        headers["X-Session-Id"] = made.json()["id"]
    for rnd, text in enumerate(conversation_script(rng, load.rounds)):
        message = {"role": "user", "content": text}
        sent = [*history, message] if load.mode == "stateless" else [message]
        body = stream_body(sent, load.reply_tokens)
        if load.end_users:
            body["user"] = user_id
        if model:
            body["model"] = model
        sample, reply = await one_request(http, body, headers, rnd)
        crowd.samples.append(sample)
        if not sample.ok:
            return  # a user whose turn failed leaves, as a person would
        history += [message, {"role": "assistant", "content": reply}]
        if rnd < load.rounds - 1:
            await asyncio.sleep(rng.expovariate(1 / load.think_mean_s))
    crowd.finished += 1


async def run_load(base: str, load: Load, drain_s: float = 300) -> tuple[Crowd, float]:
    """Conversations start as a Poisson process for `load.seconds`; every one started runs to
    its end (at most `drain_s` more). Returns what they recorded and the wall time."""
    rng = random.Random(load.seed)
    crowd = Crowd()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
        models = (await http.get("/v1/models")).json()
        model = models["data"][0]["id"] if models.get("data") else None
        tasks = []
        t0 = time.perf_counter()
        at = rng.expovariate(load.rate)
        while at < load.seconds:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            own = random.Random(rng.getrandbits(64))
            tasks.append(asyncio.create_task(conversation(http, load, model, own, crowd)))
            at += rng.expovariate(load.rate)
        done, late = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
        for task in late:
            task.cancel()
        crowd.samples += [Sample(0, False, error="drain_timeout") for _ in late]
        return crowd, time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float | None:
    return round(float(np.percentile(xs, q)), 4) if xs else None


def judge(crowd: Crowd, wall_s: float, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """A load point's figures: TTFT, TPOT and latency p50/p95/p99, errors, and goodput (the
    requests a second that met the SLO: TTFT and TPOT both within bounds, and no error)."""
    ok = [s for s in crowd.samples if s.ok]
    met = [
        s
        for s in ok
        if s.ttft is not None and s.ttft <= slo_ttft_s and (s.tpot is None or s.tpot <= slo_tpot_s)
    ]
    errors: dict[str, int] = {}
    for s in crowd.samples:
        if not s.ok:
            errors[s.error] = errors.get(s.error, 0) + 1
    returning = [s.ttft for s in ok if s.round > 0 and s.ttft is not None]
    out: dict[str, object] = {
        "requests": len(crowd.samples),
        "conversations": crowd.conversations,
        "wall_s": round(wall_s, 2),
        "requests_per_s": round(len(crowd.samples) / wall_s, 3) if wall_s else None,
        "tokens_per_s": round(sum(s.tokens for s in ok) / wall_s, 2) if wall_s else None,
        "goodput_rps": round(len(met) / wall_s, 3) if wall_s else None,
        "slo_attainment": round(len(met) / len(crowd.samples), 4) if crowd.samples else None,
        "errors": errors,
        "refused": errors.get("http_429", 0),
        "returning_ttft_p50_s": pct(returning, 50),
        "returning_ttft_p95_s": pct(returning, 95),
    }
    for name, xs in (
        ("ttft", [s.ttft for s in ok if s.ttft is not None]),
        ("tpot", [t for s in ok if (t := s.tpot) is not None]),
        ("latency", [s.latency for s in ok if s.latency is not None]),
    ):
        for q in (50, 95, 99):
            out[f"{name}_p{q}_s"] = pct(xs, q)
    return out
