"""crowdchat: many people chatting with one shared, quantized model. Composition root:
flags -> engine -> session manager -> chat page, admin page, OpenAI API, metrics -> serve."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import gradio as gr
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from starlette.routing import Mount
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from api.downloads import build_download_router
from api.metrics import build_metrics_router
from api.openai_api import build_router
from api.shares import build_share_router
from api.starting import Starting
from doors.browser_id import BrowserIds, secret_file
from doors.config import AppConfig
from doors.identity import Resolver, identity_of
from doors.middleware import Doors
from doors.sign_ins import SignIns
from doors.throttle import LoginThrottle
from engine import Backend, CrowdchatError, EngineConfig, Startup, open_backend
from sessions import SessionConfig, SessionManager
from sessions.api_keys import ApiKeys
from ui.admin_page import build_admin_blocks
from ui.auth import UsersFile, admin_checker, users_checker
from ui.chat_blocks import build_chat_blocks
from ui.chat_page import ChatPage
from ui.keys_page import KeysSection
from ui.monitor import Monitor
from ui.queue_polling import poll_less
from ui.users_admin import UsersAdmin

__all__ = ["AppConfig", "build_app", "main", "parse_args"]

log = logging.getLogger("crowdchat")
STATIC = Path(__file__).resolve().parent / "static"


def _gradio_app(app: FastAPI, path: str) -> object:
    """The Gradio app that `gr.mount_gradio_app` mounted at `path` (holds its sign-ins)."""
    return next(r.app for r in app.routes if isinstance(r, Mount) and r.path == path)


def _admin_user(request: Request) -> str | None:
    """/admin with --auth: the signed-in user if an admin (the Doors middleware found them)."""
    identity = identity_of(request.scope)
    return identity.name if identity is not None and identity.admin else None


def build_app(
    engine: Backend, sessions: SessionManager, config: AppConfig, data_dir: Path
) -> tuple[FastAPI, Monitor]:
    """One FastAPI server: API and metrics routes, /admin and the chat page at /, all behind
    the Doors middleware (`app.state.doors`: its parts, for tests and operators)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        async with engine.on_server_loop():
            yield

    app = FastAPI(
        title="crowdchat", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    users = UsersFile(config.auth_file) if config.auth_file else None
    keys = ApiKeys(sessions.store)
    resolver = Resolver(users, keys, config.api_keys_file)
    throttle = LoginThrottle(config.login_failures_per_name, config.login_failures_per_address)
    browser_ids = BrowserIds(secret_file(data_dir / "cookie.key"), config.new_identities_per_minute)
    sharing = config.share_links != "off"
    app.include_router(build_router(engine, sessions, engine.model_id, sharing))
    app.include_router(build_metrics_router(engine, sessions))
    app.include_router(build_download_router(sessions))  # the chat page's export links
    app.include_router(build_share_router(sessions, sharing))  # share links' readers
    monitor = Monitor(engine, sessions)
    css = [STATIC / "crowdchat.css"]
    admin_password = config.admin_secret()
    admin_look = {"css_paths": css, "theme": "soft", "show_error": False}
    if users is not None and admin_password:
        log.warning("the admin password is ignored with --auth: /admin is for admin users")
    if users is not None:  # admins are users with the admin role, signed in on the chat page
        app = gr.mount_gradio_app(
            app,
            build_admin_blocks(monitor, sessions, UsersAdmin(users, keys, sessions)),
            path="/admin",
            auth_dependency=_admin_user,
            **admin_look,
        )
    elif admin_password:
        app = gr.mount_gradio_app(
            app,
            build_admin_blocks(monitor, sessions),
            path="/admin",
            auth=throttle.guard(admin_checker(admin_password)),
            auth_message="crowdchat admin: user 'admin'",
            **admin_look,
        )
    else:

        @app.get("/admin")
        @app.get("/admin/{rest:path}")
        def admin_disabled(rest: str = "") -> PlainTextResponse:
            return PlainTextResponse(
                "the admin page is disabled: start the server with --admin-password "
                "(or CROWDCHAT_ADMIN_PASSWORD, or --admin-password-file), or --auth",
                status_code=404,
            )

    page = ChatPage(
        sessions,
        auth_enabled=users is not None,
        browser_ids=browser_ids,
    )
    section = KeysSection(keys, page) if users is not None else None
    chat = build_chat_blocks(
        page, concurrency=engine.max_num_seqs, keys=section, share_links=sharing
    )
    chat.queue(
        default_concurrency_limit=engine.max_num_seqs,
        max_size=engine.max_queue + engine.max_num_seqs,
    )
    poll_less(chat)
    app = gr.mount_gradio_app(
        app,
        chat,
        path="",
        css_paths=css,
        theme="soft",
        show_error=False,
        auth=(
            throttle.guard(users_checker(users, sessions.store.users.signed_in))
            if users is not None
            else None
        ),
        max_file_size=int(sessions.config.max_import_mb * 1e6),  # uploads: imports only
    )
    resolver.gradio = _gradio_app(app, "")
    # Gradio's sign-ins never end by themselves: each gets an age limit (doors/sign_ins.py)
    max_age = config.sign_in_hours * 3600
    sign_ins = SignIns(max_age, users.password_of) if users is not None else SignIns(max_age)
    resolver.gradio.tokens = sign_ins  # type: ignore[attr-defined]
    if users is None and admin_password:  # the admin page's own sign-in
        _gradio_app(app, "/admin").tokens = SignIns(max_age)  # type: ignore[attr-defined]
    app.add_middleware(
        Doors,
        config=config,
        resolver=resolver,
        browser_ids=browser_ids,
        max_import_bytes=int(sessions.config.max_import_mb * 1e6),
    )
    if config.proxies():  # outside Doors: the client it sees is the forwarded one
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=config.proxies())
    app.state.doors = SimpleNamespace(
        keys=keys,
        throttle=throttle,
        browser_ids=browser_ids,
        resolver=resolver,
        sign_ins=sign_ins,
    )
    return app, monitor


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
    # uvicorn's own proxy headers off: it would believe any X-Forwarded-For from 127.0.0.1
    # (FORWARDED_ALLOW_IPS); --trusted-proxy says whom to believe (build_app)
    server = uvicorn.Server(
        uvicorn.Config(starting, host=c.host, port=c.port, log_level="warning", proxy_headers=False)
    )
    opener = threading.Thread(target=opening.run, args=(server,), name="crowdchat-open")
    opener.start()
    print(f"crowdchat: starting on http://{c.host}:{c.port}/ (it shows each step)", flush=True)
    try:
        server.run()
    finally:
        server.should_exit = True
        opener.join()
        opening.close()
    if isinstance(opening.error, CrowdchatError):
        sys.exit(f"crowdchat: {opening.error}")
    if opening.error is not None:
        raise opening.error


if __name__ == "__main__":
    main()
