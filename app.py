"""crowdchat: many people chatting with one shared, quantized model. Composition root:
flags -> engine -> session manager -> chat page, admin page, OpenAI API, metrics -> serve."""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import gradio as gr
import uvicorn
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from api.metrics import build_metrics_router
from api.openai_api import build_router
from engine import CrowdchatError, Engine, EngineConfig
from engine.errors import InvalidRequest
from engine.settings import Settings, setting
from sessions import SessionConfig, SessionManager
from ui.admin_page import build_admin_blocks
from ui.auth import admin_checker, users_checker
from ui.chat_blocks import build_chat_blocks
from ui.chat_page import ChatPage
from ui.monitor import Monitor

log = logging.getLogger("crowdchat")
STATIC = Path(__file__).resolve().parent / "static"


@dataclass(frozen=True)
class AppConfig(Settings):
    """How the server is reached and who may use which page."""

    section: ClassVar[str] = "server"

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(7860, "port to listen on")
    auth_file: Path | None = setting(
        None,
        "users file for sign-in with hashed passwords (python -m ui.auth FILE NAME adds "
        "a user); off: every browser is its own anonymous user",
        flag="--auth",
    )
    admin_password: str | None = setting(
        None, "enables /admin (user 'admin'); off: /admin is disabled"
    )

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequest(f"invalid server setting: {msg}")

        need(bool(self.host.strip()), "--host must not be empty")
        need(1 <= self.port <= 65535, f"--port must be in 1..65535, not {self.port}")
        if self.auth_file is not None:
            object.__setattr__(self, "auth_file", Path(self.auth_file))
            need(
                self.auth_file.is_file(),
                f"--auth users file not found: {self.auth_file} (python -m ui.auth "
                f"{self.auth_file} NAME creates it)",
            )
        need(
            self.admin_password is None or self.admin_password != "",
            "--admin-password must not be empty (leave it out to disable /admin)",
        )


def browser_secret(data_dir: Path) -> str:
    """The key that encrypts each browser's stored identity; kept so ids survive restarts."""
    path = data_dir / "browser.secret"
    if not path.is_file():
        data_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip()


def build_app(
    engine: Engine, sessions: SessionManager, config: AppConfig, data_dir: Path
) -> tuple[FastAPI, Monitor]:
    """One FastAPI server: API and metrics routes, /admin and the chat page at /."""
    app = FastAPI(title="crowdchat", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(build_router(engine, sessions, engine.loaded.model_id))
    app.include_router(build_metrics_router(engine, sessions))
    monitor = Monitor(engine, sessions)
    css = [STATIC / "crowdchat.css"]
    if config.admin_password:
        app = gr.mount_gradio_app(
            app,
            build_admin_blocks(monitor, sessions),
            path="/admin",
            auth=admin_checker(config.admin_password),
            auth_message="crowdchat admin: user 'admin'",
            css_paths=css,
            theme="soft",
            show_error=False,
        )
    else:

        @app.get("/admin")
        @app.get("/admin/{rest:path}")
        def admin_disabled(rest: str = "") -> PlainTextResponse:
            return PlainTextResponse(
                "the admin page is disabled: start the server with --admin-password",
                status_code=404,
            )

    page = ChatPage(
        sessions, auth_enabled=config.auth_file is not None, browser_secret=browser_secret(data_dir)
    )
    chat = build_chat_blocks(page, concurrency=engine.config.max_num_seqs)
    chat.queue(
        default_concurrency_limit=engine.config.max_num_seqs,
        max_size=engine.config.max_queue + engine.config.max_num_seqs,
    )
    app = gr.mount_gradio_app(
        app,
        chat,
        path="",
        css_paths=css,
        theme="soft",
        show_error=False,
        auth=users_checker(config.auth_file) if config.auth_file else None,
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


def main(argv: list[str] | None = None) -> None:
    cap_malloc_arenas()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    args = parse_args(argv)
    try:
        engine_config = EngineConfig.from_namespace(args)
        session_config = SessionConfig.from_namespace(args)
        app_config = AppConfig.from_namespace(args)
        engine = Engine(engine_config)
    except CrowdchatError as e:
        sys.exit(f"crowdchat: {e}")
    s = engine.stats()
    log.info(
        "model %.1f MB; KV pool %.1f MB = %d blocks x %d tokens (%d tokens, %d bytes/token)",
        s.model_bytes / 2**20,
        s.kv_bytes / 2**20,
        s.blocks_total,
        s.block_size,
        s.blocks_total * s.block_size,
        s.kv_bytes_per_token,
    )
    sessions = SessionManager(engine, session_config, engine_config.data_dir)
    try:
        app, monitor = build_app(engine, sessions, app_config, engine_config.data_dir)
        url = f"http://{app_config.host}:{app_config.port}"
        print(
            f"crowdchat: chat on {url}/"
            + (f" · admin on {url}/admin" if app_config.admin_password else ""),
            flush=True,
        )
        uvicorn.run(app, host=app_config.host, port=app_config.port, log_level="warning")
        monitor.stop()
    except CrowdchatError as e:
        sys.exit(f"crowdchat: {e}")
    finally:
        sessions.shutdown()
        engine.shutdown()


if __name__ == "__main__":
    main()
