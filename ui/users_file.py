"""The users file: one `name:hash[:flags]` line a user. One validator for user names (the CLI,
the admin page and the reader all use `check_name`), one locked door for every change
(`UsersFile.edit`: the last admin stays), a write that keeps the file's mode and owner (0600
when it is made), and a credential epoch per user that a sign-in is bound to."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.errors import InvalidRequest

FLAGS = ("admin", "disabled")  # what the third field of a line may hold, comma-separated
# letters and digits of any script, then those or `. _ @ + -` and inner spaces; no line break,
# ':' or ',' (the file's separators), at most 64 characters
NAME = re.compile(r"\w(?:[\w.@+ -]{0,62}[\w.@+-])?")
NAME_RULE = (
    "a user name is 1 to 64 letters, digits, '.', '_', '@', '+', '-' or inner spaces, starting "
    "with a letter or digit"
)


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


def check_name(name: object) -> str | None:
    """What is wrong with a user name, or None."""
    if not isinstance(name, str) or NAME.fullmatch(name) is None:
        return NAME_RULE
    return None


def load_users(path: Path) -> dict[str, User]:
    """`name:hash[:role]` lines (blank lines and # comments ignored); UTF-8."""
    if not path.is_file():
        raise InvalidRequest(f"users file not found: {path}")
    return parse_users(path.read_bytes(), path)


def parse_users(data: bytes, path: Path) -> dict[str, User]:
    """The users of a file's bytes; InvalidRequest naming the line of a bad or repeated name,
    an empty hash or an unknown flag (the server refuses to start on such a file)."""
    users: dict[str, User] = {}
    for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition(":")
        stored, _, third = rest.partition(":")
        where = f"{path} line {number}"
        problem = check_name(name)
        if problem:
            raise InvalidRequest(f"{where}: {problem}; fix or remove that line")
        if name in users:
            raise InvalidRequest(f"{where}: user {name!r} is there twice; keep one line")
        if not stored.strip():
            raise InvalidRequest(f"{where}: user {name!r} has no password hash")
        flags = {f.strip() for f in third.split(",") if f.strip()} - {"user"}
        if flags - set(FLAGS):
            what = ",".join(sorted(flags - set(FLAGS)))
            raise InvalidRequest(f"{where}: user {name!r} has unknown role {what!r}")
        role = "admin" if "admin" in flags else "user"
        users[name] = User(name, stored.strip(), role, "disabled" in flags)
    return users


def write_users(path: Path, users: dict[str, User]) -> None:
    """The users file, whole: a new file renamed over the old one, so a running server reads
    the old or the new, never a half-written one (which would sign everybody out). The new
    file has the old one's mode and owner (0600 for a new file): password hashes are never
    left readable to others by a change."""
    try:
        st: os.stat_result | None = path.stat()
    except FileNotFoundError:
        st = None
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # mkstemp made it 0600
            if st is not None:
                if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                    os.fchown(f.fileno(), st.st_uid, st.st_gid)  # root editing a user's file
                os.fchmod(f.fileno(), st.st_mode & 0o777)
            f.write("".join(u.line + "\n" for u in users.values()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def active_admins(users: dict[str, User]) -> set[str]:
    return {n for n, u in users.items() if u.admin and not u.disabled}


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on the users file's folder, held by every writer of the file (the
    server's threads, the CLI, a second server): one read-change-write at a time."""
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def edit_users(path: Path, change: Callable[[dict[str, User]], str]) -> str:
    """Apply `change` to the users as the file holds them now and write the result, all under
    one lock (threads and processes): what `change` says. ValueError (nothing written) if it
    raises one, or if it would leave no active admin where there was one."""
    with locked(path):
        users = load_users(path) if path.exists() else {}
        had = active_admins(users)
        said = change(users)
        if had and not active_admins(users):
            raise ValueError(
                f"{', '.join(sorted(had))} is the last active admin: make another user an "
                "admin first"
            )
        write_users(path, users)
    return said


class UsersFile:
    """The users file, read again on every lookup and parsed again whenever its bytes change
    (so a removed user, a new role or a new password counts at once, without a restart; its
    bytes, not its mtime: two writes within one timestamp tick must not look the same).

    Each user has a credential epoch: it grows whenever the server sees their hash or their
    disabled flag change (a reset, a disable, a re-enable), and a sign-in is valid only in the
    epoch it was checked in (doors/sign_ins.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._data: bytes | None = None
        self._users: dict[str, User] = {}
        self._epochs: dict[str, int] = {}
        self._lock = threading.Lock()  # the parse and the epochs: the loop and threads read
        self._edit_lock = threading.Lock()
        self.get("")  # fail at start, not at the first login

    def get(self, name: str) -> User | None:
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise InvalidRequest(f"users file not found: {self.path}") from e
        with self._lock:
            if data != self._data:
                users = parse_users(data, self.path)
                for n in users.keys() | self._users.keys():
                    old, new = self._users.get(n), users.get(n)
                    if (
                        old is None
                        or new is None
                        or (old.hash, old.disabled)
                        != (
                            new.hash,
                            new.disabled,
                        )
                    ):
                        self._epochs[n] = self._epochs.get(n, 0) + 1
                self._users, self._data = users, data
            return self._users.get(name)

    def all(self) -> dict[str, User]:
        """Every user, as the file says now."""
        self.get("")
        with self._lock:
            return dict(self._users)

    def epoch_of(self, name: str) -> int | None:
        """`name`'s credential epoch (None: no such user, or disabled: nobody is signed in)."""
        user = self.get(name)
        if user is None or user.disabled:
            return None
        with self._lock:
            return self._epochs.get(name, 0)

    def edit(self, change: Callable[[dict[str, User]], str]) -> str:
        """`edit_users` on this file; the epochs move at once, before anyone signs in."""
        with self._edit_lock:
            said = edit_users(self.path, change)
        self.get("")
        return said
