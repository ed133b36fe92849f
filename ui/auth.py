"""Credentials: the users file (hashed passwords) and the admin password, checked in constant
time. `python -m ui.auth USERS_FILE NAME` adds or changes a user (password read from stdin)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sys
from collections.abc import Callable
from pathlib import Path

from engine.errors import InvalidRequest

ITERATIONS = 200_000


def hash_password(password: str, salt: str | None = None) -> str:
    """`pbkdf2_sha256$iterations$salt$hex` for the users file."""
    salt = salt or secrets.token_hex(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), ITERATIONS)
    return f"pbkdf2_sha256${ITERATIONS}${salt}${digest.hex()}"


def verify_password(password: str, stored: str) -> bool:
    try:
        algo, iterations, salt, want = stored.split("$")
    except ValueError:
        return False
    if algo != "pbkdf2_sha256":
        return False
    got = hashlib.pbkdf2_hmac("sha256", password.encode(), salt.encode(), int(iterations))
    return hmac.compare_digest(got.hex(), want)


def load_users(path: Path) -> dict[str, str]:
    """`name:hash` lines (blank lines and # comments ignored)."""
    if not path.is_file():
        raise InvalidRequest(f"users file not found: {path}")
    users = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, stored = line.partition(":")
            users[name.strip()] = stored.strip()
    return users


def users_checker(path: Path) -> Callable[[str, str], bool]:
    """A Gradio `auth` function over the users file (re-read on each login)."""
    load_users(path)  # fail at start, not at the first login

    def check(username: str, password: str) -> bool:
        stored = load_users(path).get(username)
        if stored is None:
            verify_password(password, hash_password("x"))  # same time for unknown names
            return False
        return verify_password(password, stored)

    return check


def admin_checker(admin_password: str) -> Callable[[str, str], bool]:
    """The admin login: user `admin`, the configured password, compared in constant time."""
    want = hashlib.sha256(admin_password.encode()).digest()

    def check(username: str, password: str) -> bool:
        got = hashlib.sha256(password.encode()).digest()
        return hmac.compare_digest(got, want) & hmac.compare_digest(username, "admin")

    return check


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        sys.exit("usage: python -m ui.auth USERS_FILE NAME  (password on stdin)")
    path, name = Path(argv[0]), argv[1]
    if not name or ":" in name:
        sys.exit("the user name must be non-empty and contain no ':'")
    password = sys.stdin.readline().rstrip("\n")
    if len(password) < 8:
        sys.exit("the password must have at least 8 characters")
    users = load_users(path) if path.is_file() else {}
    users[name] = hash_password(password)
    path.write_text("".join(f"{n}:{h}\n" for n, h in users.items()))
    print(f"user {name} saved in {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
