"""Credentials: the users file (hashed passwords, an optional role) and the admin password,
checked in constant time.

    python -m ui.auth USERS_FILE NAME [--admin]    add or change a user (password on stdin)
    python -m ui.auth keys DATA_DIR create NAME [LABEL] | list [NAME] | revoke KEY_ID
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InvalidRequest

ITERATIONS = 200_000


FLAGS = ("admin", "disabled")  # what the third field of a line may hold, comma-separated


@dataclass(frozen=True)
class User:
    """One line of the users file: `name:hash`, `name:hash:admin`, `name:hash:disabled` or
    `name:hash:admin,disabled`. A disabled user cannot sign in, and their sign-ins and API
    keys stop working at once."""

    name: str
    hash: str
    role: str = "user"
    disabled: bool = False

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    @property
    def line(self) -> str:
        flags = [f for f, on in (("admin", self.admin), ("disabled", self.disabled)) if on]
        return f"{self.name}:{self.hash}" + (f":{','.join(flags)}" if flags else "")


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


def same_text(a: str, b: str) -> bool:
    """Constant-time equality of any two strings (compare_digest refuses non-ASCII str)."""
    return hmac.compare_digest(
        hashlib.sha256(a.encode()).digest(), hashlib.sha256(b.encode()).digest()
    )


def load_users(path: Path) -> dict[str, User]:
    """`name:hash[:role]` lines (blank lines and # comments ignored); UTF-8."""
    if not path.is_file():
        raise InvalidRequest(f"users file not found: {path}")
    return parse_users(path.read_bytes(), path)


def parse_users(data: bytes, path: Path) -> dict[str, User]:
    users = {}
    for line in data.decode("utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, rest = line.partition(":")
            stored, _, third = rest.partition(":")
            flags = {f.strip() for f in third.split(",") if f.strip()} - {"user"}
            if flags - set(FLAGS):
                what = ",".join(sorted(flags - set(FLAGS)))
                raise InvalidRequest(f"{path}: user {name.strip()!r} has unknown role {what!r}")
            role = "admin" if "admin" in flags else "user"
            users[name.strip()] = User(name.strip(), stored.strip(), role, "disabled" in flags)
    return users


def write_users(path: Path, users: dict[str, User]) -> None:
    """The users file, whole: a new file renamed over the old one, so a running server reads
    the old or the new, never a half-written one (which would sign everybody out)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(u.line + "\n" for u in users.values()), encoding="utf-8")
    os.replace(tmp, path)


def check_name(name: str) -> str | None:
    """What is wrong with a new user name, or None."""
    if not name or ":" in name or "," in name or name != name.strip():
        return "the user name must be non-empty, contain no ':' or ',' and no outer spaces"
    return None


def check_password(password: str) -> str | None:
    """What is wrong with a new password, or None."""
    return "the password must have at least 8 characters" if len(password) < 8 else None


class UsersFile:
    """The users file, read again on every lookup and parsed again whenever its bytes change
    (so a removed user, a new role or a new password counts at once, without a restart; its
    bytes, not its mtime: two writes within one timestamp tick must not look the same)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._data: bytes | None = None
        self._users: dict[str, User] = {}
        self.get("")  # fail at start, not at the first login

    def get(self, name: str) -> User | None:
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise InvalidRequest(f"users file not found: {self.path}") from e
        if data != self._data:
            self._users, self._data = parse_users(data, self.path), data
        return self._users.get(name)

    def all(self) -> dict[str, User]:
        """Every user, as the file says now."""
        self.get("")
        return dict(self._users)

    def password_of(self, name: str) -> str | None:
        """`name`'s stored password hash (None: no such user): a sign-in made with another
        one has ended (doors/sign_ins.py)."""
        user = self.get(name)
        return user.hash if user is not None else None


def users_checker(
    users: UsersFile | Path, on_sign_in: Callable[[str], None] | None = None
) -> Callable[[str, str], bool]:
    """A Gradio `auth` function over the users file; `on_sign_in(name)` after each success."""
    users = users if isinstance(users, UsersFile) else UsersFile(users)
    # an unknown name is checked against this, made once: the same one PBKDF2 run a known
    # name costs, so the time of a refusal does not tell which names exist
    unknown = hash_password(secrets.token_hex(16))

    def check(username: str, password: str) -> bool:
        user = users.get(username)
        ok = verify_password(password, user.hash if user is not None else unknown)
        if ok and user is not None and not user.disabled:
            if on_sign_in is not None:
                on_sign_in(user.name)
            return True
        return False

    return check


def admin_checker(admin_password: str) -> Callable[[str, str], bool]:
    """The admin login: user `admin`, the configured password, compared in constant time."""

    def check(username: str, password: str) -> bool:
        return same_text(password, admin_password) & same_text(username, "admin")

    return check


def add_user(path: Path, name: str, password: str, role: str) -> None:
    problem = check_name(name) or check_password(password)
    if problem:
        sys.exit(problem)
    users = load_users(path) if path.is_file() else {}
    was = users.get(name)
    users[name] = User(name, hash_password(password), role, was is not None and was.disabled)
    write_users(path, users)
    print(f"user {name} saved in {path}" + (" (admin)" if role == "admin" else ""))


def keys_main(argv: list[str]) -> None:
    """`keys DATA_DIR create NAME [LABEL] | list [NAME] | revoke KEY_ID`."""
    from sessions.api_keys import ApiKeys
    from sessions.store import Store

    ap = argparse.ArgumentParser(prog="python -m ui.auth keys")
    ap.add_argument("data_dir", type=Path)
    sub = ap.add_subparsers(dest="cmd", required=True)
    create = sub.add_parser("create", help="issue a key for user NAME (printed once)")
    create.add_argument("user")
    create.add_argument("label", nargs="?", default="cli")
    listing = sub.add_parser("list", help="keys (of user NAME), with their last use")
    listing.add_argument("user", nargs="?")
    revoke = sub.add_parser("revoke", help="revoke the key KEY_ID")
    revoke.add_argument("key_id")
    args = ap.parse_args(argv)
    if args.cmd == "create" and (":" in args.user or not args.user.strip()):
        # owners are `user:NAME`, and no user name holds a ':' (add_user): such a key could
        # never sign anyone in
        sys.exit(f"no key made: {args.user!r} cannot be a user name (empty, or with a ':')")
    with Store(args.data_dir / "crowdchat.db") as store:
        keys = ApiKeys(store)
        if args.cmd == "create":
            row, key = keys.issue(f"user:{args.user}", args.label)
            print(f"key {row['id']} for {args.user} ({args.label}); shown once:\n{key}")
        elif args.cmd == "list":
            for row in keys.list(f"user:{args.user}" if args.user else None):
                used = row["last_used"] and time.strftime("%F %T", time.gmtime(row["last_used"]))
                state = "revoked" if row["revoked"] else "active"
                fields = (
                    row["id"],
                    row["owner"],
                    row["name"],
                    state,
                    f"last used {used or 'never'}",
                )
                print("\t".join(fields))
        elif not keys.revoke(None, args.key_id):
            sys.exit(f"no active key {args.key_id}")
        else:
            print(f"key {args.key_id} revoked")


def main(argv: list[str]) -> None:
    if argv[:1] == ["keys"]:
        keys_main(argv[1:])
        return
    ap = argparse.ArgumentParser(prog="python -m ui.auth", description="add or change a user")
    ap.add_argument("users_file", type=Path)
    ap.add_argument("name")
    ap.add_argument("--admin", action="store_true", help="may open /admin and read /metrics")
    args = ap.parse_args(argv)
    password = sys.stdin.readline().rstrip("\n")
    add_user(args.users_file, args.name, password, "admin" if args.admin else "user")


if __name__ == "__main__":
    main(sys.argv[1:])
