"""Engine statistics for the admin page: batch, queue, blocks, throughput and latencies."""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np

WINDOW_S = 10.0  # tokens/s is measured over this trailing window
SAMPLES = 2048  # latency samples kept for percentiles
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ADMISSION_WINDOW_S = 60.0  # the queue's wait estimate uses admissions over this window
SERVED_TOP = 10  # users listed one by one in served tokens (the rest: "other")
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    """Cumulative latency buckets (Prometheus style) that never forget, unlike the samples."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        for i, b in enumerate(self.bounds):
            if value <= b:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def observe_all(self, values: list[float]) -> None:
        """`observe` each value, in order (one step's rows at once: mostly one value, the
        rows' tokens having come at the same steps)."""
        total = self.sum
        for value in values:
            total += value
        self.sum = total
        counts, bounds = self.counts, self.bounds
        if len(values) < 16:  # few: a Counter costs more than it saves
            for value in values:
                counts[bisect.bisect_left(bounds, value)] += 1  # the first bound >= value, or +Inf
            return
        for value, n in Counter(values).items():
            counts[bisect.bisect_left(bounds, value)] += n

    def cumulative(self) -> list[tuple[str, int]]:
        """[(upper bound, observations <= it)], ending with '+Inf'."""
        out, total = [], 0
        for b, c in zip((*map(str, self.bounds), "+Inf"), self.counts, strict=True):
            total += c
            out.append((b, total))
        return out


@dataclass(frozen=True)
class ReplicaStats:
    """One upstream replica as the admin page and /metrics show it."""

    url: str
    healthy: bool
    draining: bool
    served: int  # turns it answered (to the end or not)
    failures: int  # turns it failed (refused, 5xx, died mid-stream)
    in_flight: int
    last_error: str | None
    upstream: dict[str, float]  # what its /metrics said (vLLM names, without "vllm:")


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of the engine, safe to read from any thread."""

    running: int
    waiting: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    block_size: int
    resident_owners: int
    resident_blocks: int
    kv_bytes: int
    kv_bytes_per_token: int
    model_bytes: int
    max_model_len: int
    tokens_per_s: float
    prompt_tokens_total: int
    generated_tokens_total: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None
    step_ms_p50: float | None
    token_budget: int
    requests_finished: int
    requests_failed: int
    requests_rejected: int
    preemptions: int
    resident_dropped: int
    steps: int
    max_batch_seen: int
    blocks_cached: int = 0  # free blocks that still hold a cached chain's KV
    blocks_shared: int = 0  # blocks held by two or more sequences or sessions
    prefix_cache_queries: int = 0  # prompt tokens admitted
    prefix_cache_hits: int = 0  # of them, tokens whose KV was already in the pool
    schedule: str = "fcfs"  # the admission policy (--schedule)
    kv_dtype: str = ""  # the KV pool's elements (--kv-dtype); "" without a pool
    # (owner label, prompt tokens computed, tokens generated): the most served users, "other"
    served: tuple[tuple[str, int, int], ...] = ()
    alive: bool = True  # False once the engine thread has died or was shut down
    failure: str | None = None  # why the engine thread died
    replicas: tuple[ReplicaStats, ...] = ()  # upstream backends only: one row per replica
    graph_bytes: int = 0  # device memory the captured CUDA graphs keep (engine.model.static_decode)
    cuda_graphs: int = 0  # decode buckets captured as CUDA graphs (0: every step eager)
    cuda_graph_error: str | None = None  # why capture failed, where it did (then eager)
    runs_ahead: bool = False  # steps launched before the last one's tokens are read (CUDA)


def percentile(samples: deque[float], q: float) -> float | None:
    return float(np.percentile(np.fromiter(samples, float), q)) if samples else None


class Metrics:
    """Counters and latency samples, written by the engine thread, read by anyone."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft: deque[float] = deque(maxlen=SAMPLES)
        self.ttft_hist = Histogram(TTFT_BUCKETS)
        self.itl_hist = Histogram(ITL_BUCKETS)
        self.itl: deque[float] = deque(maxlen=SAMPLES)
        self.step_ms: deque[float] = deque(maxlen=256)
        self.token_times: deque[tuple[float, int]] = deque()  # (when, tokens), last WINDOW_S
        self._window_tokens = 0  # the sum of token_times' tokens
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.finished = 0
        self.failed = 0
        self.rejected = 0
        self.steps = 0
        self.max_batch = 0
        self.admissions: deque[float] = deque()

    def served(self, now: float) -> dict[str, float | int | None]:
        """The `EngineStats` fields every backend counts: rate, totals, latencies, outcomes
        (the caller holds `lock`)."""
        return {
            "tokens_per_s": self.tokens_per_s(now),
            "prompt_tokens_total": self.prompt_tokens,
            "generated_tokens_total": self.generated_tokens,
            "ttft_p50_s": percentile(self.ttft, 50),
            "ttft_p95_s": percentile(self.ttft, 95),
            "itl_p50_s": percentile(self.itl, 50),
            "itl_p95_s": percentile(self.itl, 95),
            "requests_finished": self.finished,
            "requests_failed": self.failed,
            "requests_rejected": self.rejected,
        }

    def record_admission(self, now: float) -> None:
        with self.lock:
            self.admissions.append(now)
            while self.admissions[0] < now - ADMISSION_WINDOW_S:
                self.admissions.popleft()

    def admission_rate(self, now: float) -> float:
        """Requests admitted per second over the recent window (0.0 without any)."""
        with self.lock:
            recent = [t for t in self.admissions if t >= now - ADMISSION_WINDOW_S]
        if not recent:
            return 0.0
        return len(recent) / min(ADMISSION_WINDOW_S, max(now - recent[0], 1.0))

    def record_step(
        self, now: float, ms: float, batch: int, new_tokens: int, prompt_tokens: int
    ) -> None:
        with self.lock:
            self.steps += 1
            self.step_ms.append(ms)
            self.max_batch = max(self.max_batch, batch)
            self.prompt_tokens += prompt_tokens
            self._add_tokens(now, new_tokens)

    def record_tokens(self, now: float, new_tokens: int) -> None:
        """Tokens that arrived outside a step (an upstream's stream)."""
        with self.lock:
            self._add_tokens(now, new_tokens)

    def tokens_per_s(self, now: float) -> float:
        """Tokens generated per second over the trailing window, from a running sum (the
        caller holds `lock`: the window moves while another thread records)."""
        self._expire(now)
        if not self.token_times:
            return 0.0
        return self._window_tokens / min(WINDOW_S, max(now - self.token_times[0][0], 1e-3))

    def recent_itl(self, n: int = 64) -> float | None:
        """The mean of the last `n` inter-token latencies (None before any)."""
        with self.lock:
            last = list(itertools.islice(reversed(self.itl), n))
        return sum(last) / len(last) if last else None

    def _add_tokens(self, now: float, n: int) -> None:
        """Count `n` new tokens (the caller holds the lock)."""
        self.generated_tokens += n
        if n:
            self.token_times.append((now, n))
            self._window_tokens += n
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self.token_times and self.token_times[0][0] < now - WINDOW_S:
            self._window_tokens -= self.token_times.popleft()[1]


# EngineStats fields without meaning for an upstream backend (its pool is vLLM's: `replicas`)
NO_POOL = (
    "waiting",
    "blocks_total",
    "blocks_used",
    "blocks_free",
    "resident_owners",
    "resident_blocks",
    "kv_bytes",
    "kv_bytes_per_token",
    "model_bytes",
    "token_budget",
    "preemptions",
    "resident_dropped",
    "steps",
    "max_batch_seen",
)


def stream_stats(m: Metrics, **facts: object) -> EngineStats:
    """Stats of a backend without a pool of its own: latencies and counters from `m`, the
    rest from `facts` (running, block_size, max_model_len, alive, failure, replicas)."""
    now = time.monotonic()
    with m.lock:
        return EngineStats(  # type: ignore[arg-type]
            **dict.fromkeys(NO_POOL, 0),
            **m.served(now),
            step_ms_p50=None,
            schedule="upstream",
            **facts,
        )
