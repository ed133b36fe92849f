"""The server's config: where it listens and who may use which door."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from engine.errors import InvalidRequest
from engine.settings import Settings, setting

SHARE_LINKS = ("signed-in", "public", "off")
UI_CHOICES = ("on", "off")
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # RFC 9110's token


@dataclass(frozen=True)
class AppConfig(Settings):
    """How the server is reached and who may use which page."""

    section: ClassVar[str] = "server"

    host: str = setting("127.0.0.1", "address to listen on")
    port: int = setting(7860, "port to listen on")
    auth_file: Path | None = setting(
        None,
        "users file for sign-in with hashed passwords (python -m ui.auth FILE NAME [--admin] "
        "adds a user); off: every browser is its own anonymous user",
        flag="--auth",
    )
    admin_password: str | None = setting(
        None,
        "anonymous mode: enables /admin (user 'admin'); prefer the environment variable or "
        "--admin-password-file (a flag shows in ps)",
    )
    admin_password_file: Path | None = setting(
        None, "file whose first line is the admin password (instead of --admin-password)"
    )
    metrics_token: str | None = setting(
        None, "bearer token that may read /metrics (besides an admin's API key with --auth)"
    )
    api_keys_file: Path | None = setting(
        None,
        "file of API keys (one per line, or name:key); /v1 then requires one of them; off "
        "without --auth: /v1 is open",
        flag="--api-keys",
    )
    trusted_proxy: str = setting(
        "",
        "addresses or networks (comma-separated: 127.0.0.1,10.0.0.0/8) of reverse proxies whose "
        "X-Forwarded-For and X-Forwarded-Proto are believed; off: the connecting address is "
        "the client, whatever headers it sends",
    )
    end_user_header: str = setting(
        "",
        "a request header (X-End-User) by which a client (your app's backend, your gateway) "
        "names the end user it sends a request for, as OpenAI's `user` field does; the "
        "per-user limits then count that end user, and --tokens-per-minute-per-client all of "
        "the client's; off: the `user` field alone",
    )
    share_links: str = setting(
        "signed-in",
        "who may open a conversation's read-only share link: signed-in (with --auth a "
        "signed-in user; without, any browser of the chat page), public (anyone holding the "
        "link), off (no links are made or shown)",
        choices=SHARE_LINKS,
    )
    ui: str = setting(
        "on",
        "on: the chat page at / and the admin page at /admin (Gradio); off: an API server "
        "(as `vllm serve`): the OpenAI API, /metrics, export and share links only, Gradio "
        "never imported",
        choices=UI_CHOICES,
    )
    # uvicorn's own 5 s equals httpx's pool expiry: a client reusing a connection at 4.99 s
    # met the server closing it (a connection read error); longer than the clients and the
    # proxies in front keep one (httpx 5 s, aiohttp 15 s, nginx and AWS load balancers 60 s)
    keep_alive_s: int = setting(
        75, "seconds an idle kept-alive connection stays open (longer than clients' pools)"
    )
    max_body_bytes: int = setting(1 << 20, "largest accepted request body; beyond: HTTP 413")
    new_identities_per_minute: int = setting(
        20, "new anonymous browser identities per client address per minute; beyond: HTTP 429"
    )
    login_failures_per_name: int = setting(
        5,
        "failed sign-ins per user name from one client address per minute before that "
        "address is refused for the name a while; from all addresses together a name takes "
        "30x this in 10 minutes",
    )
    login_failures_per_address: int = setting(
        20, "failed sign-ins per client address per minute before sign-in is refused"
    )
    imports_per_minute: int = setting(
        6,
        "conversation files per identity per minute (the chat page's uploads and POST "
        "/v1/sessions/import together); beyond: HTTP 429",
    )
    upload_keep_s: int = setting(
        600, "an uploaded file is deleted this many seconds after it arrived, imported or not"
    )
    sign_in_hours: float = setting(
        24.0,
        "a browser's sign-in lasts this many hours, then the sign-in form again; changing a "
        "user's password ends their sign-ins at once",
    )

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequest(f"invalid server setting: {msg}")

        need(bool(self.host.strip()), "--host must not be empty")
        need(self.share_links in SHARE_LINKS, f"--share-links must be one of {SHARE_LINKS}")
        need(self.ui in UI_CHOICES, f"--ui must be one of {UI_CHOICES}")
        need(1 <= self.port <= 65535, f"--port must be in 1..65535, not {self.port}")
        for name, what in (
            ("auth_file", "--auth users file"),
            ("admin_password_file", "--admin-password-file"),
            ("api_keys_file", "--api-keys file"),
        ):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, Path(value))
                hint = (
                    f" (python -m ui.auth {value} NAME creates it)" if name == "auth_file" else ""
                )
                need(Path(value).is_file(), f"{what} not found: {value}{hint}")
        need(
            self.admin_password is None or self.admin_password != "",
            "--admin-password must not be empty (leave it out to disable /admin)",
        )
        need(self.metrics_token is None or len(self.metrics_token) >= 16,
             "--metrics-token must have at least 16 characters")  # fmt: skip
        need(0 < self.sign_in_hours <= 24 * 366, "--sign-in-hours must be in (0, 8784]")
        for proxy in self.proxies():
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                need(False, f"--trusted-proxy: {proxy!r} is not an address or network")
        need(
            self.end_user_header == "" or HEADER_NAME.fullmatch(self.end_user_header) is not None,
            f"--end-user-header: {self.end_user_header!r} is not a header name",
        )
        object.__setattr__(self, "end_user_header", self.end_user_header.lower())
        need(self.keep_alive_s >= 1, "--keep-alive-s must be at least 1")
        need(self.max_body_bytes >= 1024, "--max-body-bytes must be at least 1024")
        for name in ("new_identities_per_minute", "login_failures_per_name",
                     "login_failures_per_address", "imports_per_minute",
                     "upload_keep_s"):  # fmt: skip
            need(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be at least 1")

    def proxies(self) -> list[str]:
        """The --trusted-proxy addresses and networks, one string each."""
        return [p.strip() for p in self.trusted_proxy.split(",") if p.strip()]

    def admin_secret(self) -> str | None:
        """The admin password from the flag, the environment or the file (its first line)."""
        if self.admin_password_file is not None:
            lines = self.admin_password_file.read_text(encoding="utf-8").splitlines()
            password = lines[0].strip() if lines else ""
            if not password:
                raise InvalidRequest(f"--admin-password-file {self.admin_password_file} is empty")
            return password
        return self.admin_password
