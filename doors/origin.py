"""Requests from other sites. A page on another site can make a visitor's browser send
requests here with the visitor's cookies (a form, a `fetch` with credentials); every door that
changes something refuses them, the way Go's `http.CrossOriginProtection` does: the browser's
`Sec-Fetch-Site` header says where a request comes from, and where it is missing (an older
browser) the `Origin` header must name this server's host. A request with neither is no
browser's cross-site request (curl, an SDK) and goes through. GET and HEAD change nothing, so
they pass; OPTIONS (a CORS preflight) from another site is refused like the request it asks
for.

No response carries CORS headers: Gradio's CORS layer echoes a foreign Origin with
`Access-Control-Allow-Credentials: true` when the Host is not localhost, which would let a
foreign page read what it made a signed-in browser do. And every cookie set on the way out is
`SameSite=Lax` at least (Gradio's sign-in cookie is `SameSite=None`), so a browser does not
even send it with another site's requests."""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.types import Message, Scope

SAFE_METHODS = frozenset({"GET", "HEAD"})
# Sec-Fetch-Site values of a request this server's own pages made, or the user typed
OWN = frozenset({"same-origin", "none"})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def cross_site(scope: Scope) -> str | None:
    """Why the request is refused as another site's (None: it is not, or it changes
    nothing)."""
    if scope["method"] in SAFE_METHODS:
        return None
    fetch_site = _header(scope, b"sec-fetch-site")
    if fetch_site is not None:
        if fetch_site.strip().lower() in OWN:
            return None
        return f"Sec-Fetch-Site: {fetch_site[:40]}"
    origin = _header(scope, b"origin")
    if origin is None:
        return None
    host = (_header(scope, b"host") or "").strip().lower()
    try:
        netloc = urlsplit(origin.strip()).netloc.lower()
    except ValueError:
        netloc = ""
    if not host or netloc != host:  # "null" (a sandboxed frame, a file) has no netloc
        return f"Origin {origin[:100]!r} is not this server ({host[:100]!r})"
    return None


def _lax(cookie: bytes) -> bytes:
    """The Set-Cookie value with `SameSite=None` made `SameSite=Lax`, and Lax added where the
    cookie names no SameSite (browsers differ on that default)."""
    parts = [p.strip() for p in cookie.decode("latin-1").split(";")]
    kept = [p for p in parts if p.split("=", 1)[0].strip().lower() != "samesite"]
    same_site = [p.split("=", 1)[-1].strip().lower() for p in parts if p not in kept]
    value = "Strict" if same_site == ["strict"] else "Lax"
    return "; ".join([*kept, f"SameSite={value}"]).encode("latin-1")


def own_site_only(message: Message) -> Message:
    """A response start as it leaves: without CORS headers, its cookies SameSite=Lax or
    Strict."""
    if message["type"] != "http.response.start":
        return message
    headers = []
    for key, value in message.get("headers", []):
        name = key.lower()
        if name.startswith(b"access-control-"):
            continue
        headers.append((key, _lax(value) if name == b"set-cookie" else value))
    return {**message, "headers": headers}
