"""Read-only share links, as their viewers reach them: GET /share/{token} shows the shared copy
(a small page of its own, or JSON with ?format=json) and POST /share/{token}/copy makes it a
conversation of the viewer's, to continue. They sit on the chat page's door: who may open a
link is --share-links (the door admits a public link's reader without a sign-in)."""

from __future__ import annotations

import base64
import hashlib
import html
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
)
from starlette.concurrency import run_in_threadpool

from api.markdown_html import markdown_html
from doors.identity import identity_of
from engine import CrowdchatError
from sessions import SessionManager, SessionNotFound
from sessions.shares import GONE

SPEAKERS = {"user": "User", "assistant": "Assistant"}
STATIC = Path(__file__).resolve().parent.parent / "static"


@cache
def page_assets() -> tuple[str, str, str]:
    """The page's stylesheet and script (static/share.*, inlined) and the Content-Security-
    Policy that allows those two and nothing else: no other script, style, frame or request
    to elsewhere, whatever a message holds."""
    css = (STATIC / "share.css").read_text(encoding="utf-8")
    js = (STATIC / "share.js").read_text(encoding="utf-8")

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    policy = (
        f"default-src 'none'; style-src {digest(css)}; script-src {digest(js)}; "
        "img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
    )
    return css, js, policy


def share_page(shared: dict, copy_action: str | None) -> str:
    """The shared copy as a page of its own: each message's markdown, code and LaTeX rendered
    and sanitized (api.markdown_html), nothing of the app's; with `copy_action`, a button that
    posts there to continue it."""
    css, js, _ = page_assets()
    title = html.escape(shared["title"] or "A shared conversation")
    when = datetime.fromtimestamp(shared["created"], UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{title}</title>",
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        '<meta name="robots" content="noindex">',
        f"<style>{css}</style></head><body>",
        f"<header><h1>{title}</h1><p>Shared from crowdchat on {when} · read-only</p></header>",
    ]
    for m in shared["messages"]:
        role = m["role"] if m["role"] in SPEAKERS else "assistant"
        parts.append(
            f'<div class="message {role}"><span class="speaker">{SPEAKERS[role]}</span>'
            f"{markdown_html(m['content'])}</div>"
        )
    if copy_action:
        parts.append(
            f'<form method="post" action="{html.escape(copy_action)}">'
            '<button id="continue" type="submit">Continue this conversation as my own</button>'
            "</form>"
        )
    return "".join(parts) + f"<script>{js}</script></body></html>"


def _same_origin(request: Request) -> bool:
    """A form POST from this server's own pages (Origin, else Referer, names its host): a
    page elsewhere cannot make a viewer's browser copy conversations."""
    source = request.headers.get("origin") or request.headers.get("referer")
    return source is not None and urlsplit(source).netloc == request.headers.get("host")


def build_share_router(sessions: SessionManager, enabled: bool) -> APIRouter:
    """The viewers' routes; with share links off, every link is a 404."""
    router = APIRouter()

    @router.get("/share/{token}")
    async def view(request: Request, token: str, format: str = "html") -> Response:
        if not enabled:
            return PlainTextResponse("Share links are off on this server.", 404)
        try:
            shared = await run_in_threadpool(sessions.read_share, token)
        except SessionNotFound:
            return PlainTextResponse(f"Not found: {GONE}.", 404)
        if format == "json":
            return JSONResponse({"object": "share", **shared})
        # relative (/share/{token}/copy), so a proxy's path prefix holds
        action = f"{token}/copy" if identity_of(request.scope) is not None else None
        page = await run_in_threadpool(share_page, shared, action)  # markdown: CPU work
        return HTMLResponse(
            page,
            headers={
                "Referrer-Policy": "same-origin",
                "X-Robots-Tag": "noindex",
                "Content-Security-Policy": page_assets()[2],
                "X-Content-Type-Options": "nosniff",
            },
        )

    @router.post("/share/{token}/copy")
    async def copy(request: Request, token: str) -> Response:
        identity = identity_of(request.scope)
        if not enabled:
            return PlainTextResponse("Share links are off on this server.", 404)
        if identity is None:
            return PlainTextResponse("Sign in on the chat page to continue it.", 401)
        if not _same_origin(request):
            return PlainTextResponse("Continue it from its page on this server.", 403)
        try:
            await run_in_threadpool(sessions.copy_share, identity.owner, token)
        except SessionNotFound:
            return PlainTextResponse(f"Not found: {GONE}.", 404)
        except CrowdchatError as e:
            return PlainTextResponse(str(e), 400)
        return RedirectResponse("../..", status_code=303)  # the chat page opens it (newest)

    return router
