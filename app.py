"""crowdchat: many people chatting with one shared, quantized model. Composition root:
flags -> engine -> session manager -> chat page, admin page, OpenAI API, metrics -> serve."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from starlette.types import ASGIApp
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from api.downloads import build_download_router
from api.metrics import build_metrics_router
from api.openai_api import build_router
from api.shares import build_share_router
from api.starting import Starting
from doors.browser_id import BrowserIds, secret_file
from doors.config import AppConfig
from doors.identity import Resolver
from doors.middleware import Doors
from doors.sign_ins import SignIns
from doors.throttle import LoginThrottle
from engine import Backend, CrowdchatError, EngineConfig, Startup, open_backend
from sessions import SessionConfig, SessionManager
from sessions.api_keys import ApiKeys
from ui.auth import UsersFile
from ui.monitor import Monitor

__all__ = ["AppConfig", "build_app", "main", "parse_args"]

log = logging.getLogger("crowdchat")
STOP_GRACE_S = 5  # how long a stop lets the replies still streaming run on


def build_app(
    engine: Backend, sessions: SessionManager, config: AppConfig, data_dir: Path
) -> tuple[FastAPI, Monitor | None]:
    """One FastAPI server: API and metrics routes, and (unless --ui off) /admin and the chat
    page at /, all behind the Doors middleware (`app.state.doors`: its parts, for tests and
    operators). The monitor samples what the admin page shows; None with --ui off."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with engine.on_server_loop():
            yield

    app = FastAPI(
        title="crowdchat", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    users = UsersFile(config.auth_file) if config.auth_file else None
    keys = ApiKeys(sessions.store)
    doors = SimpleNamespace(
        users=users,
        keys=keys,
        throttle=LoginThrottle(config.login_failures_per_name, config.login_failures_per_address),
        browser_ids=BrowserIds(
            secret_file(data_dir / "cookie.key"), config.new_identities_per_minute
        ),
        resolver=Resolver(users, keys, config.api_keys_file),
        sharing=config.share_links != "off",
        sign_ins=SignIns(config.sign_in_hours * 3600),
    )
    sessions.share_links = doors.sharing  # every door that makes links asks the manager
    if users is not None:  # a disabled user's links read as gone (a user:NAME owner only)
        sessions.owner_active = functools.partial(_user_active, users)
    app.include_router(
        build_router(engine, sessions, engine.model_id, doors.sharing, config.end_user_header)
    )
    app.include_router(build_metrics_router(engine, sessions))
    app.include_router(build_download_router(sessions))  # the chat page's export links
    app.include_router(build_share_router(sessions, doors.sharing))  # share links' readers
    monitor: Monitor | None = None
    if config.ui == "on":
        from ui.pages import mount_pages  # Gradio: imported only where the pages are served

        app, monitor = mount_pages(app, engine, sessions, config, doors)
    else:
        if config.admin_secret():
            log.warning("the admin password is unused with --ui off: there is no admin page")
        _api_only_pages(app, engine.model_id)
    app.add_middleware(
        Doors,
        config=config,
        resolver=doors.resolver,
        browser_ids=doors.browser_ids,
        max_import_bytes=int(sessions.config.max_import_mb * 1e6),
    )
    if config.proxies():  # outside Doors: the client it sees is the forwarded one
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=config.proxies())
    app.state.doors = doors
    return app, monitor


def _user_active(users: UsersFile, owner: str) -> bool:
    if not owner.startswith("user:"):
        return True
    user = users.get(owner.removeprefix("user:"))
    return user is not None and not user.disabled


def _api_only_pages(app: FastAPI, model_id: str) -> None:
    """What --ui off answers at / and /admin: where the API is, and that the pages are off."""

    @app.get("/")
    def api_home() -> PlainTextResponse:
        return PlainTextResponse(
            f"crowdchat API server (--ui off), model {model_id}: POST /v1/chat/completions, "
            "GET /v1/models, GET /metrics\n"
        )

    @app.get("/admin")
    @app.get("/admin/{rest:path}")
    def admin_off(rest: str = "") -> PlainTextResponse:
        return PlainTextResponse(
            "the admin page is off (--ui off): the server's figures are at /metrics",
            status_code=404,
        )


def cap_malloc_arenas(arenas: int = 2) -> None:
    """glibc gives busy threads their own malloc arenas (up to 8 per core) and keeps what they
    freed; with a relay thread per streaming reply, that reads as RSS creeping up under load.
    Two arenas keep it flat. A no-op where glibc's mallopt is not available."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-8, arenas)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags of all three configs (each defaulting to its CROWDCHAT_* variable if set)."""
    ap = argparse.ArgumentParser(description="crowdchat: one model, a whole crowd of users")
    EngineConfig.add_arguments(ap)
    SessionConfig.add_arguments(ap)
    AppConfig.add_arguments(ap)
    return ap.parse_args(argv)


class Opening:
    """The engine, the sessions and the app, opened on a thread of their own while the server
    already answers (api.starting) with the step they are at; what it opened, for the end."""

    def __init__(self, args: argparse.Namespace, starting: Starting) -> None:
        self.engine_config = EngineConfig.from_namespace(args)
        self.session_config = SessionConfig.from_namespace(args)
        self.app_config = AppConfig.from_namespace(args)
        self.app_config.admin_secret()  # a missing password file stops the start at once
        self.starting = starting
        self.engine: Backend | None = None
        self.sessions: SessionManager | None = None
        self.monitor: Monitor | None = None
        self.error: BaseException | None = None

    def run(self, server: uvicorn.Server) -> None:
        startup = self.starting.startup
        try:
            self.engine = open_backend(self.engine_config, startup)
            with startup.step("opening the conversations"):
                data = self.engine_config.data_dir
                self.sessions = SessionManager(self.engine, self.session_config, data)
                app, self.monitor = build_app(self.engine, self.sessions, self.app_config, data)
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.should_exit:
                return
            self.starting.ready(app)
            startup.finish()
            c = self.app_config
            url = f"http://{c.host}:{c.port}"
            if c.ui == "off":
                print(f"crowdchat: API on {url}/v1 (--ui off: no chat or admin page)", flush=True)
            else:
                admin = f" · admin on {url}/admin" if c.auth_file or c.admin_secret() else ""
                print(f"crowdchat: chat on {url}/{admin}", flush=True)
        except BaseException as e:  # noqa: BLE001 - the server stops, main() says why
            self.error = e
            startup.fail(str(e))
            server.should_exit = True

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        if self.sessions is not None:
            self.sessions.shutdown()
        if self.engine is not None:
            self.engine.shutdown()


def serving(app: ASGIApp, c: AppConfig, **overrides: object) -> uvicorn.Config:
    """How uvicorn serves `app` under `c` (the tests' servers too, with their own port)."""
    settings: dict[str, object] = {
        "host": c.host,
        "port": c.port,
        "log_level": "warning",
        # uvicorn's own proxy headers off: it would believe any X-Forwarded-For from 127.0.0.1
        # (FORWARDED_ALLOW_IPS); --trusted-proxy says whom to believe (build_app)
        "proxy_headers": False,
        "timeout_keep_alive": c.keep_alive_s,
        "timeout_graceful_shutdown": STOP_GRACE_S,
    }
    return uvicorn.Config(app, **{**settings, **overrides})  # type: ignore[arg-type]


class Server(uvicorn.Server):
    """uvicorn's server, whose stop first ends the streams that never end by themselves: every
    open tab holds Gradio's heartbeat stream, and uvicorn waits for each connection to close
    (with a tab open a stop waited for ever). Replies still streaming get STOP_GRACE_S."""

    def __init__(self, config: uvicorn.Config, starting: Starting) -> None:
        super().__init__(config)
        self.starting = starting

    async def shutdown(self, sockets: list | None = None) -> None:
        for route in getattr(self.starting.app, "routes", []):
            stop = getattr(getattr(route, "app", None), "stop_event", None)  # a Gradio mount
            if stop is not None:
                stop.set()
        await super().shutdown(sockets)


def main(argv: list[str] | None = None) -> None:
    cap_malloc_arenas()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    args = parse_args(argv)
    starting = Starting(Startup())
    try:
        opening = Opening(args, starting)
    except CrowdchatError as e:
        sys.exit(f"crowdchat: {e}")
    c = opening.app_config
    server = Server(serving(starting, c), starting)
    # SIGTERM as Ctrl-C: uvicorn stops on either, then raises it again, and the default SIGTERM
    # ended the process there, before the conversations' KV was written
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    opener = threading.Thread(target=opening.run, args=(server,), name="crowdchat-open")
    opener.start()
    print(f"crowdchat: starting on http://{c.host}:{c.port}/ (it shows each step)", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass  # uvicorn has stopped, and said so again: the clean stop follows
    finally:
        server.should_exit = True
        opener.join()
        opening.close()
    log.info("stopped: every conversation's KV still in memory is on disk")
    if isinstance(opening.error, CrowdchatError):
        sys.exit(f"crowdchat: {opening.error}")
    if opening.error is not None:
        raise opening.error


if __name__ == "__main__":
    main()
