"""Run torch work on a short-lived thread, so no long-lived thread keeps an OpenMP team.

libgomp keeps an OpenMP thread team alive for every thread that has run a parallel region,
until that thread exits. While another thread's idle team exists, the engine thread's parallel
regions ran about 2x slower on the 2-core CPU (measured: a decode step 18 ms alone, 38 ms with
the main thread's team alive). So model loading and one-off model calls run on a fresh thread
that exits afterwards; the engine thread then has the cores to itself.

libgomp's waiting threads also spin (about 300,000 rounds) before they sleep. Alone on the
box that saves a wake-up per parallel region; with anything else runnable (the server's own
event loop, a load generator, a backup, a test suite) the spinning threads and the engine's
own thread fight for the cores and every region waits for a descheduled one. Measured on the
2-core AMD EPYC, 1 streaming user, one niced busy loop beside the server: 1.7 tokens/s with
libgomp's default, 12.3 with passive waits (quiet: 17.2 and 14.1). crowdchat shares its box by
design (web front end, SQLite and KV writers), so the engine asks for passive waits unless the
operator chose a policy (`prefer_passive_omp_waits`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)
OMP_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def prefer_passive_omp_waits() -> bool:
    """Set `OMP_WAIT_POLICY=PASSIVE` unless the environment already says how OpenMP threads
    wait (`GOMP_SPINCOUNT=300000` restores libgomp's default spinning). libgomp reads it once,
    when torch loads it, so this runs before torch's import (from `engine/__init__.py`).
    Returns whether it applies."""
    if any(k in os.environ for k in OMP_SETTINGS):
        return False
    if "torch" in sys.modules:
        log.debug("torch is already loaded: OpenMP keeps its wait policy")
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


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
