"""The Gradio pages of the server: /admin and the chat page at /. `app.build_app` mounts them
unless --ui off, so that an API-only server never imports Gradio."""

from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qs, urlencode

import gradio as gr
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, RedirectResponse
from starlette.routing import Mount

from doors.config import AppConfig
from doors.identity import identity_of
from doors.sign_ins import SignIns
from engine import Backend
from sessions import SessionManager
from ui.admin_door import CHAT_FORM, SignInForm, add_admin_redirect
from ui.admin_page import build_admin_blocks
from ui.auth import admin_checker, users_checker
from ui.chat_blocks import build_chat_blocks
from ui.chat_page import ChatPage
from ui.keys_page import KeysSection
from ui.monitor import Monitor
from ui.queue_polling import poll_less
from ui.users_admin import UsersAdmin

log = logging.getLogger("crowdchat")
STATIC = Path(__file__).resolve().parent.parent / "static"
# Gradio's chrome is no part of the product, on any page: its footer ("Use via API" lists the
# pages' internal events, not the /v1 API; "Settings" is Gradio's developer panel) and its run
# history, which kept conversation text in the browser's localStorage for the next person at
# that computer (run_history=False also deletes what an older version left there)
NO_CHROME = {"footer_links": [], "run_history": False}
GRADIO_VIEWS = ("view",)  # ?view=settings opens Gradio's settings panel whatever the footer


def no_matplotlib_search() -> None:
    """Gradio wraps every call of a handler (each paint of a streamed reply too) in a switch
    of matplotlib's backend that imports matplotlib twice; where it is not installed, each of
    those imports searched sys.path again, and failed: 6% of the server's Python work at 8
    page users on the 2-core box (py-spy, GIL holders). A None in sys.modules makes them fail
    at once, as they would have anyway."""
    if "matplotlib" not in sys.modules and importlib.util.find_spec("matplotlib") is None:
        sys.modules["matplotlib"] = None  # type: ignore[assignment]


def unlisted(blocks: gr.Blocks) -> None:
    """Every event of `blocks` off Gradio's API listing (/gradio_api/info): they are the
    page's own wiring. Still callable, as the page itself calls them."""
    for fn in blocks.fns.values():
        if fn.api_visibility == "public":
            fn.api_visibility = "undocumented"


class NoGradioViews:
    """ASGI middleware: a page address with Gradio's `?view=` (its settings panel, its API
    page) is sent to the page itself."""

    def __init__(self, app: object) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: object, send: object) -> None:
        if scope["type"] == "http" and scope.get("method") == "GET":
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            if any(v in query for v in GRADIO_VIEWS) and not scope["path"].startswith(
                ("/gradio_api", "/admin/gradio_api")
            ):
                kept = urlencode({k: v for k, v in query.items() if k not in GRADIO_VIEWS}, True)
                where = scope.get("root_path", "") + scope["path"] + (f"?{kept}" if kept else "")
                await RedirectResponse(where, status_code=303)(scope, receive, send)
                return
        await self.app(scope, receive, send)  # type: ignore[operator]


def gradio_app(app: FastAPI, path: str) -> object:
    """The Gradio app that `gr.mount_gradio_app` mounted at `path` (holds its sign-ins)."""
    return next(r.app for r in app.routes if isinstance(r, Mount) and r.path == path)


def _admin_user(request: Request) -> str | None:
    """/admin with --auth: the signed-in user if an admin (the Doors middleware found them)."""
    identity = identity_of(request.scope)
    return identity.name if identity is not None and identity.admin else None


def mount_pages(
    app: FastAPI,
    engine: Backend,
    sessions: SessionManager,
    config: AppConfig,
    doors: SimpleNamespace,
) -> tuple[FastAPI, Monitor]:
    """`app` with the admin page and the chat page mounted; `doors` (users, keys, throttle,
    browser_ids, resolver, sharing) gets the chat page's sign-ins as `sign_ins`."""
    users, keys, throttle = doors.users, doors.keys, doors.throttle
    monitor = Monitor(engine, sessions)
    css = [STATIC / "crowdchat.css"]
    admin_password = config.admin_secret()
    admin_look = {
        "css_paths": [*css, STATIC / "admin.css"],
        "theme": "soft",
        "show_error": False,
        **NO_CHROME,
    }
    if users is not None and admin_password:
        log.warning("the admin password is ignored with --auth: /admin is for admin users")
    if users is not None or admin_password:
        add_admin_redirect(app)  # /admin, as the server prints it, before the chat's mount
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
        admin_app = gradio_app(app, "/admin")
        admin_app.add_middleware(SignInForm, gradio=admin_app)  # keeps the name on a refusal
    else:

        @app.get("/admin")
        @app.get("/admin/{rest:path}")
        def admin_disabled(rest: str = "") -> PlainTextResponse:
            return PlainTextResponse(
                "the admin page is disabled: start the server with --admin-password "
                "(or CROWDCHAT_ADMIN_PASSWORD, or --admin-password-file), or --auth",
                status_code=404,
            )

    page = ChatPage(sessions, auth_enabled=users is not None, browser_ids=doors.browser_ids)
    section = KeysSection(keys, page) if users is not None else None
    chat = build_chat_blocks(
        page, concurrency=engine.max_num_seqs, keys=section, share_links=doors.sharing
    )
    chat.queue(
        default_concurrency_limit=engine.max_num_seqs,
        max_size=engine.max_queue + engine.max_num_seqs,
    )
    poll_less(chat)
    unlisted(chat)
    no_matplotlib_search()
    # Gradio deletes uploads older than --upload-keep-s, imported or not (Blocks.delete_cache)
    chat.delete_cache = (min(60, config.upload_keep_s), config.upload_keep_s)
    # Gradio's sign-ins never end by themselves: each gets an age limit and is bound to the
    # credential epoch it was checked in (doors/sign_ins.py)
    max_age = config.sign_in_hours * 3600
    sign_ins = SignIns(max_age, users.epoch_of) if users is not None else SignIns(max_age)
    app = gr.mount_gradio_app(
        app,
        chat,
        path="",
        css_paths=[*css, STATIC / "chat.css"],
        js=(STATIC / "crowdchat.js").read_text(encoding="utf-8"),
        theme="soft",
        show_error=False,
        **NO_CHROME,
        auth=(
            sign_ins.bind(throttle.guard(users_checker(users, sessions.store.users.signed_in)))
            if users is not None
            else None
        ),
        max_file_size=int(sessions.config.max_import_mb * 1e6),  # uploads: imports only
    )
    doors.resolver.gradio = gradio_app(app, "")
    doors.resolver.gradio.tokens = sign_ins
    if users is not None:  # crowdchat's sign-in form: it keeps the name on a refusal
        doors.resolver.gradio.add_middleware(
            SignInForm, gradio=doors.resolver.gradio, form=CHAT_FORM
        )
    if users is None and admin_password:  # the admin page's own sign-in
        gradio_app(app, "/admin").tokens = SignIns(max_age)  # type: ignore[attr-defined]
    doors.sign_ins = sign_ins
    app.add_middleware(NoGradioViews)
    return app, monitor
