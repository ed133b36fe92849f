"""Anonymous browsers' identity: a random 128-bit id in a cookie signed with a server key
(HMAC-SHA256), HttpOnly and SameSite=Lax, so page scripts cannot read it and nobody can
make one up; new ids are rationed per client address."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import tempfile
from pathlib import Path

from doors.throttle import Window
from engine.errors import InvalidRequest

COOKIE = "crowdchat_id"
MAX_AGE_S = 400 * 24 * 3600  # the most browsers keep a cookie (Chrome caps at 400 days)
ID = re.compile(r"^[0-9a-f]{32}$")
MIN_SECRET_BYTES = 32  # the HMAC key is the file's text (ours: 64 hex characters)


def secret_file(path: Path, nbytes: int = 32) -> str:
    """A random hex secret kept in `path` (0600, never world-readable), made on first use.

    It is written whole to a temp file and then linked into place, so `path` never exists
    half-written (a crash or a full disk leaves no key, and the next start makes one) and,
    when two servers start at once, the first link wins and both read its key."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:  # mkstemp made it 0600
                f.write(secrets.token_hex(nbytes))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # unlike a rename, never replaces a key another made
            except FileExistsError:
                pass  # another server made it first: its key is the one
            except OSError:  # a filesystem without hard links (some network mounts)
                os.replace(tmp, path)  # still whole; two starts in one instant may differ
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    secret = path.read_text().strip()
    if len(secret.encode()) < MIN_SECRET_BYTES:
        # an empty or short key makes what it signs forgeable: refuse to start instead
        raise InvalidRequest(
            f"the secret in {path} has {len(secret.encode())} bytes, fewer than "
            f"{MIN_SECRET_BYTES} (left by a crash or a full disk, or written by hand): delete it "
            "and start again to have a new one made (browsers then get new anonymous ids)"
        )
    return secret


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
