"""Run torch work on a short-lived thread, so no long-lived thread keeps an OpenMP team.

libgomp keeps an OpenMP thread team alive for every thread that has run a parallel region,
until that thread exits. While another thread's idle team exists, the engine thread's parallel
regions ran about 2x slower on the 2-core CPU (measured: a decode step 18 ms alone, 38 ms with
the main thread's team alive). So model loading and one-off model calls run on a fresh thread
that exits afterwards; the engine thread then has the cores to itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_in_fresh_thread(fn: Callable[[], T], name: str = "crowdchat-torch") -> T:
    """Call `fn` on a new thread, wait for it, and return its result or raise its error."""
    box: dict[str, object] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller below
            box["error"] = e

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
