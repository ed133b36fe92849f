"""Credentials: the users file (hashed passwords, an optional role) and the admin password,
checked in constant time.

    python -m ui.auth USERS_FILE NAME [--admin]    add or change a user (password on stdin)
    python -m ui.auth keys DATA_DIR create NAME [LABEL] | list [NAME] | revoke KEY_ID
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import secrets
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ui.users_file import (  # noqa: F401 - where the rest of the code imports them
    User,
    UsersFile,
    check_name,
    edit_users,
    load_users,
    parse_users,
    write_users,
)

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


def same_text(a: str, b: str) -> bool:
    """Constant-time equality of any two strings (compare_digest refuses non-ASCII str)."""
    return hmac.compare_digest(
        hashlib.sha256(a.encode()).digest(), hashlib.sha256(b.encode()).digest()
    )


def check_password(password: str) -> str | None:
    """What is wrong with a new password, or None."""
    return "the password must have at least 8 characters" if len(password) < 8 else None


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
    hashed = hash_password(password)

    def change(users: dict[str, User]) -> str:
        was = users.get(name)
        users[name] = User(name, hashed, role, was is not None and was.disabled)
        return f"user {name} saved in {path}" + (" (admin)" if role == "admin" else "")

    try:
        print(edit_users(path, change))
    except ValueError as e:
        sys.exit(f"nothing saved: {e}")


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
    if args.cmd == "create" and check_name(args.user):
        # such a key could never sign anyone in
        sys.exit(f"no key made: {args.user!r} cannot be a user name ({check_name(args.user)})")
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
