"""Who a request comes from: a signed-in user (Gradio's login cookie), an API key (issued
per user, or from the --api-keys file), an anonymous browser (signed cookie), or, in the open
API (no --auth, no --api-keys), the client's address: a bearer string there names nobody, as
anyone can send a new one with every request and so escape every per-user limit."""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InvalidRequest
from sessions.api_keys import ApiKeys
from ui.auth import UsersFile

STATE_KEY = "crowdchat_identity"  # where the Doors middleware leaves it in the ASGI scope


@dataclass(frozen=True)
class Identity:
    """The caller. `owner` is what sessions are keyed by: `user:NAME`, `api:...`, `browser:ID`."""

    owner: str
    via: str  # "sign-in", "api key", "cookie", "address"
    name: str | None = None
    admin: bool = False


def identity_of(scope: dict) -> Identity | None:
    """The caller the Doors middleware found for this request (None where none is needed)."""
    return scope.get("state", {}).get(STATE_KEY)


def bearer(headers: dict[str, str]) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, if any."""
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def client_key(address: str) -> str:
    """What per-address limits and the open API's identity count by: an IPv4 address, or an
    IPv6 address's /64 (one host is given a whole /64 and may send from any address in it);
    an IPv4-mapped IPv6 address is its IPv4 address. Anything else (a Unix socket's peer,
    "unknown") as it is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def address_owner(address: str) -> str:
    """The open API's owner: the client's address (`client_key`)."""
    return f"address:{client_key(address)}"


def token_owner(token: str | None) -> str:
    """The owner of a bare key in an --api-keys file (a hash of it), and the API router's
    when it is mounted without the Doors middleware (tests of the routes alone)."""
    if not token:
        return "api:anonymous"
    return "api:" + hashlib.sha256(token.encode()).hexdigest()[:16]


def load_key_file(path: Path) -> dict[str, str]:
    """sha256(key) -> owner for a `--api-keys` file: `key` or `name:key` lines (# comments)."""
    keys = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.count(":") > 1:
            # `a:b:key` could be the name `a` or `a:b`: refused, not guessed
            raise InvalidRequest(
                f"{path} line {number}: a key name and a key cannot contain ':' (a line is "
                "`name:key` or a bare key): change that line, then start again"
            )
        name, sep, key = line.rpartition(":")
        key = key.strip()
        if len(key) < 16:
            raise InvalidRequest(f"{path}: an API key must have at least 16 characters")
        owner = f"api:{name.strip()}" if sep and name.strip() else token_owner(key)
        keys[hashlib.sha256(key.encode()).hexdigest()] = owner
    if not keys:
        raise InvalidRequest(f"--api-keys file {path} holds no key")
    return keys


class Resolver:
    """Turns credentials into an Identity. `gradio` (the chat page's Gradio app, set once it
    is mounted) holds the sign-in tokens that Gradio's /login handed out."""

    def __init__(
        self, users: UsersFile | None, api_keys: ApiKeys, key_file: Path | None = None
    ) -> None:
        self.users = users
        self.api_keys = api_keys
        self.file_keys = load_key_file(key_file) if key_file else {}
        self.gradio: object | None = None

    def signed_in(self, cookies: dict[str, str]) -> Identity | None:
        """The user behind Gradio's login cookie, if they are still in the users file."""
        if self.users is None or self.gradio is None:
            return None
        cookie_id = self.gradio.cookie_id  # type: ignore[attr-defined]
        token = cookies.get(f"access-token-{cookie_id}") or cookies.get(
            f"access-token-unsecure-{cookie_id}"
        )
        name = self.gradio.tokens.get(token) if token else None  # type: ignore[attr-defined]
        user = self.users.get(name) if name else None
        if user is None or user.disabled:
            return None
        return Identity(f"user:{user.name}", "sign-in", user.name, user.admin)

    def by_key(self, token: str | None) -> Identity | None:
        """The identity of an API key (blocking: a SQLite read, now and then a write)."""
        if not token:
            return None
        owner = self.file_keys.get(hashlib.sha256(token.encode()).hexdigest())
        if owner is not None:
            return Identity(owner, "api key")
        if self.users is None:  # per-user keys exist only with sign-in
            return None
        owner = self.api_keys.verify(token)
        if owner is None or not owner.startswith("user:"):
            return None
        user = self.users.get(owner.removeprefix("user:"))
        if user is None or user.disabled:  # removed or disabled: their keys stop working
            return None
        return Identity(owner, "api key", user.name, user.admin)
