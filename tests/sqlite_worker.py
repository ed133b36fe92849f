"""Writes messages to a crowdchat store as fast as it can, printing each committed id, until
the SIGKILL test kills it. Usage: python -m tests.sqlite_worker DB_PATH"""

from __future__ import annotations

import sys

from sessions.store import Store


def main() -> None:
    store = Store(sys.argv[1])
    store.create_session("s" * 32, "owner", "t", "")
    i = 0
    while True:
        mid = store.add_message("s" * 32, "user", f"message {i} " + "x" * 2000)
        print(mid, i, flush=True)  # committed (synchronous=FULL) before this line is printed
        i += 1


if __name__ == "__main__":
    main()
