"""The users of `bench/crash_load.py`: asyncio tasks over the OpenAI API and threads on the chat
page (gradio_client), chatting while the server is up; each thing the server acknowledged is
recorded, for the checks after each restart."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from gradio_client import Client

from bench.crash_checks import Ack
from bench.load import QUESTIONS
from bench.stream_client import ReplyCount, stream_body


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
