"""The server while the model loads. It listens at once, so a first start (converting the GGUF,
quantizing, building the kernels, sizing the KV pool) shows what it is doing instead of
refusing connections: the chat page a small page that says the step and reloads itself, the API
a 503 with the step and Retry-After, /health a 503 with the step. Once the app is ready, every
request goes to it."""

from __future__ import annotations

import asyncio
import html
import json
from contextlib import AbstractAsyncContextManager

from starlette.types import ASGIApp, Receive, Scope, Send

from engine.startup import Startup

RETRY_S = 3


def starting_page(said: str, seconds: float) -> str:
    text = html.escape(said)
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f'<meta http-equiv="refresh" content="{RETRY_S}"><title>crowdchat is starting</title>'
        "<style>body{font:18px/1.5 system-ui,sans-serif;max-width:36rem;margin:20vh auto;"
        "padding:0 1rem;color:#1f2937}p{color:#6b7280}</style></head><body>"
        f'<h1>crowdchat is starting</h1><div id="starting">starting: {text}</div>'
        f"<p>{seconds:.0f} s so far; this page reloads by itself.</p></body></html>"
    )


class Starting:
    """ASGI: answers from `startup` until `ready(app)`, then passes everything to `app`
    (whose lifespan it enters then, on the server's loop, and leaves at shutdown)."""

    def __init__(self, startup: Startup) -> None:
        self.startup = startup
        self.app: ASGIApp | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lifespan: AbstractAsyncContextManager | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan_events(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await self._starting(scope, send)
        else:  # a websocket: nothing speaks it before the app is up
            await send({"type": "websocket.close", "code": 1013})

    def ready(self, app: ASGIApp) -> None:
        """From any thread: enter `app`'s lifespan on the server's loop, then serve it."""
        assert self.loop is not None, "the server has not started"
        asyncio.run_coroutine_threadsafe(self._enter(app), self.loop).result()

    async def _enter(self, app: ASGIApp) -> None:
        router = getattr(app, "router", None)
        if router is not None:
            self._lifespan = router.lifespan_context(app)
            await self._lifespan.__aenter__()
        self.app = app

    async def _lifespan_events(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.loop = asyncio.get_running_loop()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._lifespan is not None:
                    await self._lifespan.__aexit__(None, None, None)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _starting(self, scope: Scope, send: Send) -> None:
        said, seconds = self.startup.describe(), self.startup.seconds()
        path = scope["path"]
        headers = [(b"retry-after", str(RETRY_S).encode()), (b"cache-control", b"no-store")]
        if path == "/v1" or path.startswith("/v1/"):
            error = {
                "message": f"crowdchat is starting: {said}; try again in a few seconds",
                "type": "service_unavailable_error",
                "param": None,
                "code": "starting",
            }
            body, kind = json.dumps({"error": error}).encode(), b"application/json"
        elif path == "/health":
            state = {"status": "starting", "step": said, "seconds": round(seconds, 1)}
            body, kind = json.dumps(state).encode(), b"application/json"
        else:
            body, kind = starting_page(said, seconds).encode(), b"text/html; charset=utf-8"
        await send(
            {
                "type": "http.response.start",
                "status": 503,
                "headers": [(b"content-type", kind), *headers],
            }
        )
        await send({"type": "http.response.body", "body": body})
