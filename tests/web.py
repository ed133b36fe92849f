"""Run the real crowdchat server in-process on a free loopback port, for the web tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn

from app import AppConfig, build_app, serving
from bench.server import free_port
from bench.stream_client import client_address
from engine.model.loader import LoadedModel
from tests.rig import close_sessions, make_sessions

ADMIN_PASSWORD = "correct horse battery"
PROXY = "127.0.0.1"  # trusted_proxy=PROXY: the suite's clients come through a proxy on loopback


def client_at(name: str) -> dict[str, str]:
    """The headers of API client `name` at an address of its own (bench.stream_client's
    `client_address`), forwarded by the proxy of a server started with `trusted_proxy=PROXY`:
    in the open API a client is its address."""
    return {"X-Forwarded-For": client_address(name)}


def bearer(key: str) -> dict[str, str]:
    """The Authorization header of API key `key`."""
    return {"Authorization": f"Bearer {key}"}


@contextmanager
def running_server(
    loaded: LoadedModel,
    data_dir: Path,
    engine_overrides: dict | None = None,
    apps: list | None = None,
    session_overrides: dict | None = None,
    **app_overrides: object,
) -> Iterator[tuple[str, object, object]]:
    """Yields (base url, engine, session manager) of a live server; stops it afterwards.
    `apps`: gets the FastAPI app appended (its `state.doors` has the throttle, the keys...).
    `session_overrides`: SessionConfig fields (limits, caps).
    The new-identities cap is raised: the suites open many clients from one address."""
    engine, sm = make_sessions(loaded, data_dir, engine_overrides, **(session_overrides or {}))
    settings: dict[str, object] = {
        "admin_password": ADMIN_PASSWORD,
        "new_identities_per_minute": 10_000,
    }
    settings.update(app_overrides)
    config = AppConfig(**settings)  # type: ignore[arg-type]
    app, monitor = build_app(engine, sm, config, data_dir)
    if apps is not None:
        apps.append(app)
    port = free_port()
    # as app.main serves it: uvicorn believes no X-Forwarded-For (--trusted-proxy does)
    # a client's open stream (gradio_client's SSE) held each stop for thread.join's 10 s
    settings = serving(app, config, host="127.0.0.1", port=port, timeout_graceful_shutdown=1)
    server = uvicorn.Server(settings)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", engine, sm
    finally:
        server.should_exit = True
        thread.join(10)
        if monitor is not None:
            monitor.stop()
        close_sessions(engine, sm)
