"""crowdchat in front of fake vLLM replicas (real HTTP servers, tests/fake_upstream.py): the
server, and the calls the upstream tests make to it. The fixtures live in tests/conftest.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import uvicorn

from app import AppConfig, build_app
from bench.server import free_port
from engine import (
    EngineConfig,
)
from engine.upstream.backend import UpstreamBackend
from sessions import SessionConfig, SessionManager
from tests.fake_upstream import FakeReplica

SESSION_HEADER = "x-session-id"


def wait_for(cond, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "condition not met in time"
        time.sleep(0.02)


@contextmanager
def upstream_server(
    replicas: list[FakeReplica],
    data_dir: Path,
    local: tuple,
    app: dict | None = None,
    **overrides: object,
) -> Iterator[tuple[str, UpstreamBackend, SessionManager, object]]:
    """crowdchat with --engine-url over `replicas`: (base url, backend, sessions, monitor).
    `app`: AppConfig fields (e.g. the admin password); `overrides`: EngineConfig fields."""
    settings: dict[str, object] = {
        "data_dir": data_dir,
        "engine_url": ",".join(r.url for r in replicas),
        "health_interval_s": 0.2,
        "upstream_wait_s": 5.0,
        # a token per chunk: the fakes stream so fast that the automatic choice (0) would
        # gather their tokens; the stream-interval tests below set it
        "upstream_stream_interval": 1,
    }
    settings.update(overrides)
    backend = UpstreamBackend(EngineConfig(**settings), local=local)  # type: ignore[arg-type]
    sm = SessionManager(backend, SessionConfig(idle_seconds=3600.0), data_dir)
    app_settings = {"new_identities_per_minute": 10_000, **(app or {})}
    server_app, monitor = build_app(backend, sm, AppConfig(**app_settings), data_dir)  # type: ignore[arg-type]
    port = free_port()
    config = uvicorn.Config(
        server_app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30)
    try:
        yield f"http://127.0.0.1:{port}", backend, sm, monitor
    finally:
        server.should_exit = True
        thread.join(10)
        monitor.stop()
        sm.shutdown()
        backend.shutdown()


def served_by(replicas: list[FakeReplica], n: int) -> list[str]:
    """Names of the replicas that got the requests, in order (each got `n` in all)."""
    return [r.name for r in replicas for _ in r.requests][:n]


def new_session(url: str) -> str:
    got = httpx.post(f"{url}/v1/sessions", json={}, headers={"authorization": "Bearer t1"})
    assert got.status_code == 200, got.text
    return got.json()["id"]


def ask(
    url: str, text: str, sid: str | None = None, key: str = "t1", **extra: object
) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}", **({SESSION_HEADER: sid} if sid else {})}
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 16, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=30)
