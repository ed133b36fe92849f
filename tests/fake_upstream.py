"""A real HTTP server in a thread that speaks vLLM's OpenAI API as far as crowdchat uses it:
streaming `/v1/completions` with token-id prompts, `/v1/models`, `/health`, `/metrics`.

Each reply says which replica served it (`[name]` first) and every request body is kept in
`requests`, so tests see routing and the exact prompt ids. Faults: `fault = "500"` or
`"429"` (that status), `"400"` (vLLM's context-length error), `"die"` (the connection
drops after `die_after` chunks, then the replica is "unhealthy"), `"unhealthy"` (/health
and completions answer 503); `delay` slows every chunk.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from bench.server import free_port

MODEL = "/models/fake-smollm2"


class FakeReplica:
    """One fake vLLM server; `start()` serves it on a free loopback port, `stop()` kills it."""

    def __init__(self, name: str, words: int = 4, max_model_len: int = 2048) -> None:
        self.name = name
        self.words = words  # chunks after the "[name]" one, unless max_tokens is smaller
        self.max_model_len = max_model_len
        self.fault: str | None = None
        self.die_after = 2
        self.delay = 0.0
        self.requests: list[dict] = []
        self.ports: list[int] = []  # each request's client port: one port, one connection
        self.completed = 0
        self.aborted = 0  # streams whose client went away (or that we dropped) mid-way
        self.port = free_port()
        routes = [
            Route("/health", self.health),
            Route("/v1/models", self.models),
            Route("/metrics", self.metrics),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ]
        self.server: uvicorn.Server | None = None
        self.thread: threading.Thread | None = None
        self.app = Starlette(routes=routes)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def prompts(self) -> list[list[int]]:
        return [r["prompt"] for r in self.requests]

    def start(self) -> FakeReplica:
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="critical",
            lifespan="off",
            timeout_graceful_shutdown=1,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        """Kill it: open streams are cut, new connections refused."""
        if self.server is not None and self.thread is not None:
            self.server.should_exit = self.server.force_exit = True
            self.thread.join(10)
            self.server = None

    # -- routes ---------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.fault == "unhealthy" else 200)

    async def models(self, request: Request) -> Response:
        model = {"id": MODEL, "object": "model", "max_model_len": self.max_model_len}
        return JSONResponse({"object": "list", "data": [model]})

    async def metrics(self, request: Request) -> Response:
        queries = sum(len(p) for p in self.prompts())
        lines = [
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.25',
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="{MODEL}"}} 1.0',
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0',
            "# TYPE vllm:prefix_cache_queries counter",
            f'vllm:prefix_cache_queries_total{{model_name="{MODEL}"}} {queries}.0',
            "# TYPE vllm:prefix_cache_hits counter",
            f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}} {queries // 2}.0',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        self.ports.append(request.client.port if request.client else 0)
        if self.fault == "unhealthy":
            return Response(status_code=503)
        if self.fault in ("500", "429"):
            status = int(self.fault)
            return JSONResponse({"error": {"message": "boom", "code": status}}, status_code=status)
        prompt = body["prompt"]
        if self.fault == "400" or len(prompt) + body["max_tokens"] > self.max_model_len:
            message = (
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(prompt) + body['max_tokens']} tokens."
            )
            return JSONResponse(
                {"error": {"message": message, "type": "BadRequestError", "code": 400}},
                status_code=400,
            )
        return StreamingResponse(self._stream(body), media_type="text/event-stream")

    async def _stream(self, body: dict) -> AsyncIterator[str]:
        n = min(body["max_tokens"], self.words + 1)
        every = body.get("stream_interval") or 1  # tokens per chunk after the first, as vLLM
        done = False
        try:
            i = 0
            while i < n:
                if self.fault == "die" and i >= self.die_after:
                    self.fault = "unhealthy"  # like a crashed process: nothing answers now
                    raise ConnectionAbortedError("fake replica dies mid-stream")
                chunk = range(i, i + 1 if i == 0 else min(i + every, n))
                if self.delay:
                    await asyncio.sleep(self.delay * len(chunk))
                text = "".join(f"[{self.name}] " if j == 0 else f"w{j} " for j in chunk)
                ids = [100 + j for j in chunk]
                yield _event({"text": text, "token_ids": ids, "finish_reason": None})
                i = chunk.stop
            reason = "length" if n == body["max_tokens"] else "stop"
            yield _event({"text": "", "finish_reason": reason})
            usage = {
                "prompt_tokens": len(body["prompt"]),
                "completion_tokens": n,
                "total_tokens": len(body["prompt"]) + n,
                "prompt_tokens_details": {"cached_tokens": 3},
            }
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            done = True
            self.completed += 1
        finally:
            if not done:
                self.aborted += 1


def _event(choice: dict) -> str:
    event = {"id": "cmpl-fake", "object": "text_completion", "model": MODEL, "usage": None}
    event["choices"] = [{"index": 0, "logprobs": None, "stop_reason": None, **choice}]
    return f"data: {json.dumps(event)}\n\n"
