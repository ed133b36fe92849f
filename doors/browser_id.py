"""Anonymous browsers' identity: a random 128-bit id in a cookie signed with a server key
(HMAC-SHA256), HttpOnly and SameSite=Lax, so page scripts cannot read it and nobody can
make one up; new ids are rationed per client address."""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

from doors.throttle import Window

COOKIE = "crowdchat_id"
MAX_AGE_S = 400 * 24 * 3600  # the most browsers keep a cookie (Chrome caps at 400 days)
ID = re.compile(r"^[0-9a-f]{32}$")


def secret_file(path: Path, nbytes: int = 32) -> str:
    """A random hex secret kept in `path` (created 0600, never world-readable)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another process made it first
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(nbytes))
    return path.read_text().strip()


class BrowserIds:
    """Mints and checks `crowdchat_id` cookies: `<32 hex id>.<64 hex HMAC of the id>`."""

    def __init__(self, key: str, per_minute: int) -> None:
        self._key = key.encode()
        self.new_per_address = Window(per_minute)

    def _mac(self, browser_id: str) -> str:
        return hmac.new(
            self._key, b"crowdchat_id:" + browser_id.encode(), hashlib.sha256
        ).hexdigest()

    def verify(self, value: str | None) -> str | None:
        """The browser id in a cookie value this server signed, else None."""
        browser_id, _, mac = (value or "").partition(".")
        if not ID.match(browser_id) or not hmac.compare_digest(
            mac.encode(), self._mac(browser_id).encode()
        ):
            return None
        return browser_id

    def mint(self, address: str) -> tuple[str, str] | None:
        """(id, cookie value) for a new browser, or None if `address` made too many lately."""
        if not self.new_per_address.take(address):
            return None
        browser_id = secrets.token_hex(16)
        return browser_id, f"{browser_id}.{self._mac(browser_id)}"

    @staticmethod
    def set_cookie_header(value: str, secure: bool) -> bytes:
        parts = [f"{COOKIE}={value}", "Path=/", f"Max-Age={MAX_AGE_S}", "HttpOnly", "SameSite=Lax"]
        return "; ".join(parts + (["Secure"] if secure else [])).encode()
