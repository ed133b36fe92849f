"""The one gate in front of every route. Each request is sorted to its door (health, the
OpenAI API, /metrics, /admin, the chat page), its caller identified once (`Identity`, left in
`scope["state"]["crowdchat_identity"]` for the routes), and refused here if that door wants
more; request bodies over the cap are cut off with 413 whatever route reads them."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import ApiError, error_response
from doors.browser_id import COOKIE, BrowserIds
from doors.config import AppConfig
from doors.identity import STATE_KEY, Identity, Resolver, address_owner, bearer, client_key
from doors.origin import cross_site, own_site_only
from doors.throttle import LOGIN_ADDRESS, Window
from ui.auth import same_text

log = logging.getLogger(__name__)
# what a browser fetches to render Gradio's sign-in form, open without signing in
STATIC_EXACT = frozenset({"/favicon.ico", "/theme.css", "/manifest.json", "/robots.txt"})
STATIC_PREFIXES = ("/assets/", "/static/", "/svelte/", "/gradio_api/static/", "/pwa_icon")
LOGIN_PAGE = frozenset({"/", "/config", "/login", "/logout", "/gradio_api/login_check"})
# where a conversations file comes in (the API's import, the chat page's upload): their bodies
# may be as large as --max-import-mb
IMPORT_PATHS = frozenset({"/v1/sessions/import", "/gradio_api/upload"})


@dataclass(frozen=True)
class Admit:
    """Let the request through as `identity`, setting the `cookie` header on its response."""

    identity: Identity | None
    cookie: bytes | None = None


class BodyTooLarge(ApiError):
    """Raised into the route that reads past the body cap (a chunked body has no length); an
    ApiError, so a route that turns errors into responses answers 413 without a traceback."""

    def __init__(self, limit: int, flag: str = "--max-body-bytes") -> None:
        super().__init__(
            f"Request body too large: the limit is {limit} bytes ({flag}).",
            status=413,
            code="request_too_large",
        )


def door_of(path: str) -> str:
    for door, prefix in (("api", "/v1"), ("metrics", "/metrics"), ("admin", "/admin")):
        if path == prefix or path.startswith(prefix + "/"):
            return door
    return "health" if path == "/health" else "chat"


def _is_static(path: str) -> bool:
    return path in STATIC_EXACT or path.startswith(STATIC_PREFIXES)


def _address(scope: Scope) -> str:
    """The client, as per-address limits count it (`client_key`): the connecting address, or
    the one a --trusted-proxy forwarded (uvicorn's ProxyHeadersMiddleware, in front of this
    one, has put it in the scope)."""
    client = scope.get("client")
    return client_key(client[0]) if client else "unknown"


def _replace_cookie(scope: Scope, value: str) -> None:
    """The request's Cookie header with `crowdchat_id` set to `value` (a freshly minted id,
    so the handlers of this very request already see it)."""
    parts = []
    for key, raw in scope["headers"]:
        if key == b"cookie":
            parts += [p.strip() for p in raw.decode("latin-1").split(";")]
    parts = [p for p in parts if p and p.split("=", 1)[0].strip() != COOKIE]
    parts.append(f"{COOKIE}={value}")
    headers = [(k, v) for k, v in scope["headers"] if k != b"cookie"]
    scope["headers"] = [*headers, (b"cookie", "; ".join(parts).encode("latin-1"))]


def _api_refusal(message: str, status: int = 401, code: str = "invalid_api_key") -> Response:
    response = error_response(ApiError(message, status=status, code=code))
    if status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


class Doors:
    """ASGI middleware: identity, the door's rule, the body cap and the anonymous cookie."""

    def __init__(
        self,
        app: ASGIApp,
        config: AppConfig,
        resolver: Resolver,
        browser_ids: BrowserIds,
        max_import_bytes: int = 0,
    ) -> None:
        self.app = app
        self.auth = config.auth_file is not None
        self.open_api = not self.auth and config.api_keys_file is None
        self.metrics_token = config.metrics_token
        self.max_body = config.max_body_bytes
        self.public_shares = config.share_links == "public"
        self.max_import = max(max_import_bytes, self.max_body)
        self.resolver = resolver
        self.browser_ids = browser_ids
        self.imports = Window(config.imports_per_minute)  # per identity, both doors together

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # no route speaks it: nothing unchecked gets through
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        door = door_of(scope["path"])
        foreign = cross_site(scope)
        if foreign is not None:
            await self._cross_site(door, foreign, scope, receive, send)
            return
        length = request.headers.get("content-length", "0")
        if not length.isdigit() or int(length) > self._cap(scope)[0]:
            await self._too_large(door, scope, receive, send)
            return
        verdict = await getattr(self, f"_{door}")(request)
        if isinstance(verdict, Response):
            await verdict(scope, receive, send)
            return
        if scope["method"] == "POST" and scope["path"] in IMPORT_PATHS:
            refusal = self._import_refusal(door, verdict)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        scope.setdefault("state", {})[STATE_KEY] = verdict.identity
        if scope["method"] == "POST" and scope["path"].rstrip("/").endswith("/login"):
            LOGIN_ADDRESS.set(_address(scope))  # for the throttled auth function
        await self._forward(door, verdict, scope, receive, send)

    async def _forward(
        self, door: str, verdict: Admit, scope: Scope, receive: Receive, send: Send
    ) -> None:
        received, cut, started = 0, False, False
        cap, flag = self._cap(scope)

        async def capped_receive() -> Message:
            nonlocal received, cut
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > cap:
                    cut = True
                    raise BodyTooLarge(cap, flag)
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if cut:  # whatever the route answers to a cut-off body: the 413 goes out instead
                return
            message = own_site_only(message)
            if message["type"] == "http.response.start":
                started = True
                if verdict.cookie is not None:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"set-cookie", verdict.cookie)]}  # fmt: skip
            await send(message)

        try:
            await self.app(scope, capped_receive, guarded_send)
        except Exception:
            if not cut:
                raise
        if cut and not started:
            await self._too_large(door, scope, receive, send)

    def _import_refusal(self, door: str, verdict: Admit) -> Response | None:
        """A conversations file (an upload, an import) needs an identity that existed before
        this request (not one minted for it: a cookieless client would be a new one every
        time) and counts against its `--imports-per-minute`."""
        identity = verdict.identity
        if identity is None or verdict.cookie is not None:
            return PlainTextResponse("Open the chat page first, then upload the file.", 401)
        if self.imports.take(identity.owner):
            return None
        message = (
            f"Too many conversation files: the limit is {self.imports.limit} a minute "
            "(--imports-per-minute); wait a minute."
        )
        if door == "api":
            response = _api_refusal(message, 429, "rate_limit_exceeded")
        else:
            response = PlainTextResponse(message, status_code=429)
        response.headers["Retry-After"] = "60"
        return response

    def _cap(self, scope: Scope) -> tuple[int, str]:
        """The largest body this request may send, and the flag that sets it."""
        if scope["method"] == "POST" and scope["path"] in IMPORT_PATHS:
            return self.max_import, "--max-import-mb"
        return self.max_body, "--max-body-bytes"

    async def _cross_site(
        self, door: str, why: str, scope: Scope, receive: Receive, send: Send
    ) -> None:
        message = f"Refused: a request from another site ({why}) changes nothing here."
        log.info("refused a cross-site %s %s: %s", scope["method"], scope["path"], why)
        if door == "api":
            response = _api_refusal(message, 403, "cross_site_request")
        else:
            response = PlainTextResponse(message, status_code=403)
        await response(scope, receive, send)

    async def _too_large(self, door: str, scope: Scope, receive: Receive, send: Send) -> None:
        message = str(BodyTooLarge(*self._cap(scope)))
        if door == "api":
            response = _api_refusal(message, 413, "request_too_large")
        else:
            response = PlainTextResponse(message, status_code=413)
        response.headers["Connection"] = "close"  # the rest of the body is not read
        await response(scope, receive, send)

    # -- one method per door: an Admit, or the refusal ---------------------------------
    async def _key(self, request: Request) -> Identity | None:
        token = bearer(request.headers)  # type: ignore[arg-type]
        return await asyncio.to_thread(self.resolver.by_key, token) if token else None

    async def _health(self, request: Request) -> Admit | Response:
        return Admit(None)

    async def _api(self, request: Request) -> Admit | Response:
        if self.open_api:
            return Admit(Identity(address_owner(_address(request.scope)), "address"))
        identity = await self._key(request)
        if identity is not None:
            return Admit(identity)
        if bearer(request.headers) is None:  # type: ignore[arg-type]
            return _api_refusal(
                "This server needs an API key: send 'Authorization: Bearer <key>'"
                + (" (signed-in users create keys on the chat page)." if self.auth else ".")
            )
        return _api_refusal("Invalid or revoked API key.")

    async def _metrics(self, request: Request) -> Admit | Response:
        token = bearer(request.headers)  # type: ignore[arg-type]
        if self.metrics_token and token and same_text(token, self.metrics_token):
            return Admit(None)
        if not self.auth:
            if not self.metrics_token:
                return Admit(None)
            return PlainTextResponse("/metrics needs the metrics token as a bearer.", 401)
        identity = await self._key(request)
        if identity is None:
            return PlainTextResponse(
                "/metrics needs an admin's API key or the metrics token as a bearer.", 401
            )
        if not identity.admin:
            return PlainTextResponse("/metrics is for admins only.", 403)
        return Admit(identity)

    async def _admin(self, request: Request) -> Admit | Response:
        if not self.auth:  # the admin password (Gradio's own sign-in form) guards it
            return Admit(None)
        identity = self.resolver.signed_in(request.cookies) or await self._key(request)
        if identity is None:
            return PlainTextResponse(
                "Sign in on the chat page (/) with an admin account first.", 401
            )
        if not identity.admin:
            return PlainTextResponse(
                f"{identity.name or 'this account'} is not an admin "
                "(python -m ui.auth USERS_FILE NAME --admin makes one).",
                403,
            )
        return Admit(identity)

    async def _chat(self, request: Request) -> Admit | Response:
        path = request.scope["path"]
        if _is_static(path):
            return Admit(None)
        if self.auth:
            identity = self.resolver.signed_in(request.cookies)
            if identity is None and path.rstrip("/") not in LOGIN_PAGE and path != "/":
                if self.public_shares and path.startswith("/share/") and request.method == "GET":
                    return Admit(None)  # --share-links public: a link reads without sign-in
                return JSONResponse({"detail": "Not authenticated: sign in first."}, 401)
            return Admit(identity)
        browser_id = self.browser_ids.verify(request.cookies.get(COOKIE))
        if browser_id is not None:
            return Admit(Identity(f"browser:{browser_id}", "cookie"))
        minted = self.browser_ids.mint(_address(request.scope))
        if minted is None:
            return PlainTextResponse(
                "Too many new visitors from your address in the last minute: wait a minute "
                "and reload (and let your browser keep cookies).",
                429,
                headers={"Retry-After": "60"},
            )
        browser_id, value = minted
        _replace_cookie(request.scope, value)
        secure = request.scope.get("scheme") == "https"
        return Admit(
            Identity(f"browser:{browser_id}", "cookie"),
            BrowserIds.set_cookie_header(value, secure),
        )
