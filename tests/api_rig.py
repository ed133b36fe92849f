"""The OpenAI-compatible API and /metrics served by uvicorn over a real engine and session
manager, for the API tests; the `live` fixture (one such server a module) is in
tests/conftest.py."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Callable

import openai
import uvicorn
from fastapi import FastAPI

from api.metrics import build_metrics_router
from api.openai_api import build_router

MODEL = "smollm2-135m-instruct"
HI = [{"role": "user", "content": "Say hello."}]
LONG = {"model": MODEL, "messages": HI, "max_tokens": 2000, "ignore_eos": True}


class LiveServer:
    """A uvicorn server on a free loopback port, in a background thread."""

    def __init__(self, engine: object, sessions: object) -> None:
        self.engine, self.sessions = engine, sessions
        app = FastAPI()
        app.include_router(build_router(engine, sessions, MODEL))  # type: ignore[arg-type]
        app.include_router(build_metrics_router(engine, sessions))  # type: ignore[arg-type]
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2)
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        wait_for(lambda: self.server.started, 20)

    def client(self, key: str = "k1") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=60)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def wait_for(cond: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def owner(key: str) -> str:
    return "api:" + hashlib.sha256(key.encode()).hexdigest()[:16]
