"""What a starting server is doing: its steps in order, each logged when it starts and with the
time it took when it ends, with a percentage where the step knows one (quantizing, layer by
layer). The app shows `describe()` on the page and the API while the model loads."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("crowdchat.startup")

STEPS = (
    "loading the CPU kernels",
    "converting the GGUF file",
    "loading the model",
    "quantizing the model",
    "sizing the KV pool",
    "opening the conversations",
)


class Startup:
    """Thread-safe progress of one start; `step` as a context manager times each step."""

    def __init__(self, steps: tuple[str, ...] = STEPS) -> None:
        self.steps = steps
        self.began = time.monotonic()
        self.current: str | None = None
        self.percent: float | None = None
        self.took: dict[str, float] = {}
        self.failed: str | None = None
        self.done = False
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[None]:
        """The step `name` (one of `steps`) runs inside the block."""
        assert name in self.steps, name
        with self._lock:
            self.current, self.percent = name, None
        log.info("starting: %s", self.describe())
        t0 = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - t0
            with self._lock:
                self.took[name] = self.took.get(name, 0.0) + took
            log.info("starting: %s took %.1f s", name, took)

    def progress(self, fraction: float) -> None:
        """How far the current step is (0..1); logged at every tenth."""
        pct = max(0.0, min(100.0, 100 * fraction))
        with self._lock:
            before, self.percent = self.percent, pct
        if before is None or int(pct // 10) > int(before // 10):
            log.info("starting: %s", self.describe())

    def finish(self) -> None:
        with self._lock:
            self.done, self.current, self.percent = True, None, None
        log.info("started in %.1f s", time.monotonic() - self.began)

    def fail(self, why: str) -> None:
        with self._lock:
            self.failed = why

    def describe(self) -> str:
        """`quantizing the model (3/6, 40%)`, or what the start came to."""
        with self._lock:
            if self.failed:
                return f"failed: {self.failed}"
            if self.done:
                return "ready"
            if self.current is None:
                return "starting"
            number = f"{self.steps.index(self.current) + 1}/{len(self.steps)}"
            pct = "" if self.percent is None else f", {self.percent:.0f}%"
            return f"{self.current} ({number}{pct})"

    def seconds(self) -> float:
        return time.monotonic() - self.began
