"""The chat page against the API on the same server: time from starting app.py to a usable page,
and first token and streamed tokens/s through the page (Gradio's queue and SSE, the page's own
handler, as a browser gets them; read here by a light client of Gradio's protocol: a browser's
rendering is its own machine's) against the OpenAI-compatible API,
at 1 and N users, alternated round by round so that a busy machine hurts both alike.

Prints one JSON object per round and a summary with the ranges (min-max over the rounds).
The page may add at most 50 ms to the first token and must not halve the API's tokens/s.
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
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script: bench/ is then first on the path, not the root

from bench.server import PROXY_ARGS, free_port  # noqa: E402
from bench.stream_client import ReplyCount, client_headers  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper and her cat."


def start(data: Path, port: int) -> tuple[subprocess.Popen, float, float]:
    """app.py on `port`; seconds until the API answers and until a browser has a usable page
    (the page's load handler ran: it marks the body)."""
    from playwright.sync_api import sync_playwright

    from tests.browser_rig import CHROMIUM, FLAGS

    t0 = time.monotonic()
    cmd = [sys.executable, str(ROOT / "app.py"), "--port", str(port), "--data-dir", str(data)]
    cmd += ["--new-identities-per-minute", "100000"]  # every page user is a new browser
    proc = subprocess.Popen(
        [*cmd, *PROXY_ARGS], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    api = None
    while api is None:
        if proc.poll() is not None:
            raise SystemExit("crowdchat exited while starting")
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                api = time.monotonic() - t0
        except httpx.HTTPError:
            time.sleep(0.2)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        page = browser.new_page()
        page.goto(base + "/")
        page.wait_for_function("() => document.body.dataset.crowdchatLoaded === '1'")
        usable = time.monotonic() - t0
        browser.close()
    return proc, api, usable


async def api_user(base: str, key: str, tokens: int) -> dict:
    body = {
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "max_tokens": tokens,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    count = ReplyCount()
    first = None
    async with httpx.AsyncClient(timeout=300) as http:
        t0 = time.perf_counter()
        async with http.stream(
            "POST", base + "/v1/chat/completions", json=body, headers=client_headers(key)
        ) as r:
            async for line in r.aiter_lines():
                if count.feed(line) and first is None:
                    first = time.perf_counter()
        end = time.perf_counter()
    return _point(t0, first, end, count.tokens)


class PageUser:
    """One browser on the page, speaking Gradio's queue protocol as the page's JavaScript does
    (a join per event, then the session's server-sent events), without a browser's or
    gradio_client's CPU on this 2-core machine beside the server."""

    def __init__(self, http: httpx.AsyncClient, base: str, config: dict) -> None:
        self.http, self.base = http, base + config.get("api_prefix", "/gradio_api")
        self.fns = {d.get("api_name"): d["id"] for d in config["dependencies"]}
        self.session = uuid.uuid4().hex

    async def event(self, name: str, data: list, on_message=None) -> dict:  # noqa: ANN001
        """Run event `name` to its end; `on_message(msg)` sees each message; its last one."""
        join = {"data": data, "fn_index": self.fns[name], "session_hash": self.session,
                "event_data": None, "trigger_id": None}  # fmt: skip
        (await self.http.post(self.base + "/queue/join", json=join)).raise_for_status()
        params = {"session_hash": self.session}
        async with self.http.stream("GET", self.base + "/queue/data", params=params) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                msg = json.loads(line[5:])
                if on_message is not None:
                    on_message(msg)
                if msg.get("msg") == "process_completed":
                    return msg
        raise RuntimeError(f"{name}: the stream ended before the event did")


async def page_users(base: str, users: int, tokens: int) -> list[dict]:
    """`users` new browsers open the page, then all send the same prompt at once."""
    async with httpx.AsyncClient(timeout=300) as probe:
        config = (await probe.get(base + "/config")).json()

    async def one(start: asyncio.Event) -> dict:
        async with httpx.AsyncClient(timeout=300) as http:
            await http.get(base + "/config")  # the page's identity cookie, as a browser gets it
            user = PageUser(http, base, config)
            await user.event("on_load", [None])
            await start.wait()
            seen: list[float] = []

            def look(msg: dict) -> None:
                generating = msg.get("msg") == "process_generating"
                if generating and len(seen) < 2 and msg["output"]["data"][0]:
                    seen.append(time.perf_counter())  # a paint that changed the chat

            t0 = time.perf_counter()
            end = await user.event(
                "on_send", [PROMPT, None, None, "", 0.0, 1.0, tokens, 1.0, None], look
            )
            done = time.perf_counter()
        if "data" not in end.get("output", {}):
            raise RuntimeError(f"the page's turn failed: {json.dumps(end)[:500]}")
        meta = end["output"]["data"][-1] or {}
        stats = ((meta.get("items") or [{}])[-1]).get("stats", "") if isinstance(meta, dict) else ""
        n = int(stats.split(" ")[0]) if stats[:1].isdigit() else 0
        first = seen[1] if len(seen) > 1 else None  # the first paint is the question
        return _point(t0, first, done, n)

    start = asyncio.Event()
    tasks = [asyncio.create_task(one(start)) for _ in range(users)]
    await asyncio.sleep(1.0)  # everyone's page is open
    start.set()
    return await asyncio.gather(*tasks)


def _point(t0: float, first: float | None, end: float, tokens: int) -> dict:
    ttft = (first - t0) if first else None
    speed = (tokens - 1) / (end - first) if first and tokens > 1 and end > first else None
    return {"ttft_ms": round(ttft * 1000, 1) if ttft else None, "tokens": tokens, "tps": speed}


def summarize(points: list[dict]) -> dict:
    ttfts = sorted(p["ttft_ms"] for p in points if p["ttft_ms"] is not None)
    tps = [p["tps"] for p in points if p["tps"]]
    return {
        "ttft_ms_median": ttfts[len(ttfts) // 2] if ttfts else None,
        "tokens_per_s_mean": round(sum(tps) / len(tps), 1) if tps else None,
        "tokens": sum(p["tokens"] for p in points),
    }


def round_of(base: str, users: int, tokens: int, path: str) -> dict:
    if path == "api":

        async def all_users() -> list[dict]:
            return await asyncio.gather(
                *(api_user(base, f"bench-{time.time_ns()}-{i}", tokens) for i in range(users))
            )

        points = asyncio.run(all_users())
    else:
        points = asyncio.run(page_users(base, users, tokens))
    return summarize(points)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--users", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="crowdchat-page-"))
    summary: dict[str, object] = {}
    try:
        for start_kind in ("first start (empty data dir)", "restart"):
            proc, api_s, page_s = start(data, free_port())
            summary[start_kind] = {"api_s": round(api_s, 1), "usable_page_s": round(page_s, 1)}
            print(json.dumps({start_kind: summary[start_kind]}), flush=True)
            if start_kind == "restart":
                break
            proc.terminate()
            proc.wait(60)
        base = f"http://127.0.0.1:{_port(proc)}"
        round_of(base, 2, 16, "api")  # warm-up: kernels, caches, first Gradio session
        round_of(base, 2, 16, "page")
        results: dict[str, dict[str, list[dict]]] = {}
        for users in args.users:
            for r in range(args.rounds):
                for path in ("api", "page") if r % 2 == 0 else ("page", "api"):
                    got = round_of(base, users, args.tokens, path)
                    results.setdefault(f"{users} users", {}).setdefault(path, []).append(got)
                    print(json.dumps({"users": users, "round": r, "path": path, **got}), flush=True)
        for label, paths in results.items():
            ranges = {}
            for path, rounds in paths.items():
                for key in ("ttft_ms_median", "tokens_per_s_mean"):
                    values = [x[key] for x in rounds if x[key] is not None]
                    ranges[f"{path}_{key}"] = [min(values), max(values)] if values else None
            summary[label] = ranges
        proc.terminate()
        proc.wait(60)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    print(json.dumps(summary), flush=True)


def _port(proc: subprocess.Popen) -> int:
    return int(proc.args[proc.args.index("--port") + 1])  # type: ignore[union-attr]


if __name__ == "__main__":
    main()
