"""The pages' front doors: /admin without its slash, and crowdchat's sign-in form shown in
place of Gradio's (the chat page's with --auth, the admin page's in admin password mode).

Starlette's mount at /admin matches /admin/... only; /admin itself, the address the server
prints at start, fell through to the chat page's mount at "" and was a 404. And Gradio's own
sign-in form empties the user name after a wrong password (its Login component clears both
fields on a 400), so the form here is a page of its own that posts to the same /login."""

from __future__ import annotations

import html
from functools import cache
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, RedirectResponse
from starlette._utils import get_route_path
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

STATIC = Path(__file__).resolve().parent.parent / "static"


def add_admin_redirect(app: FastAPI) -> None:
    """GET /admin answers with a redirect to /admin/ (before the chat page's catch-all mount,
    so call it before mounting the chat page)."""

    @app.get("/admin", include_in_schema=False)
    @app.head("/admin", include_in_schema=False)
    def admin_without_slash() -> RedirectResponse:
        # relative, so that a proxy's path prefix holds
        return RedirectResponse("admin/", status_code=307)


ADMIN_FORM = (
    "crowdchat admin",
    "Sign in as user <b>admin</b> with the server's admin password.",
    "admin",
)
CHAT_FORM = ("crowdchat", "Sign in with your user name and password.", "")


@cache
def sign_in_html(title: str, hint: str, user: str) -> str:
    """static/sign_in.html with its CSS and script inlined (one request, no asset routes
    behind the door): `title` and the `user` name filled in (text), `hint` (HTML)."""
    page = (STATIC / "sign_in.html").read_text(encoding="utf-8")
    css = (STATIC / "sign_in.css").read_text(encoding="utf-8")
    js = (STATIC / "sign_in.js").read_text(encoding="utf-8")
    page = page.replace("{title}", html.escape(title)).replace("{hint}", hint)
    page = page.replace("{user}", html.escape(user))
    return page.replace("/*CSS*/", css).replace("/*JS*/", js)


class SignInForm:
    """ASGI middleware on a page's Gradio app: its page, asked for without a valid sign-in, is
    crowdchat's sign-in form (`form`: its title, hint and user name, as sign_in_html takes
    them) instead of Gradio's. Everything else (/login, the page once signed in, its API)
    goes on to Gradio unchanged."""

    def __init__(
        self, app: ASGIApp, gradio: object, form: tuple[str, str, str] = ADMIN_FORM
    ) -> None:
        self.app = app
        self.gradio = gradio  # the gradio App: its cookie_id and its tokens (doors.SignIns)
        self.form = form

    def signed_in(self, scope: Scope) -> bool:
        cookies = Request(scope).cookies
        cookie_id = self.gradio.cookie_id  # type: ignore[attr-defined]
        token = cookies.get(f"access-token-{cookie_id}") or cookies.get(
            f"access-token-unsecure-{cookie_id}"
        )
        return token is not None and self.gradio.tokens.get(token) is not None  # type: ignore[attr-defined]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] in ("GET", "HEAD")
            and get_route_path(scope) in ("", "/")
            and not self.signed_in(scope)
        ):
            page = HTMLResponse(
                sign_in_html(*self.form),
                headers={"Cache-Control": "no-store", "X-Frame-Options": "DENY"},
            )
            await page(scope, receive, send)
            return
        await self.app(scope, receive, send)
