"""Which upstream replica serves a turn: rendezvous hashing over the healthy ones, health checks,
and what each replica's Prometheus /metrics says. Pure bookkeeping plus two async probes."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.errors import InvalidRequest
from engine.metrics import ReplicaStats

log = logging.getLogger(__name__)
# vLLM's names; llama-server and SGLang differ, and a missing one is simply not shown
UPSTREAM_METRICS = (
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)


@dataclass
class Replica:
    """One upstream server and what crowdchat knows of it (guarded by the router's lock)."""

    url: str
    healthy: bool = True
    draining: bool = False
    served: int = 0
    failures: int = 0
    in_flight: int = 0
    last_error: str | None = None
    down_since: float | None = None
    upstream: dict[str, float] = field(default_factory=dict)


def score(key: str, url: str) -> int:
    """Rendezvous weight of `url` for `key`: the replica with the highest one serves the key,
    so adding or losing a replica moves only the keys it wins or held."""
    return int.from_bytes(hashlib.blake2b(f"{key}\0{url}".encode(), digest_size=8).digest())


def parse_metrics(text: str) -> dict[str, float]:
    """The UPSTREAM_METRICS a Prometheus text page has (counters without `_total`), summed
    over their labels (vLLM labels them by model and engine); names without 'vllm:'."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # by sample name: TYPE lines differ between exporters
            name = sample.name.removesuffix("_total")
            if name in UPSTREAM_METRICS:
                key = name.removeprefix("vllm:")
                out[key] = out.get(key, 0.0) + sample.value
    return out


class Router:
    """Picks a replica per turn and tracks their health. Thread-safe."""

    def __init__(self, urls: list[str]) -> None:
        if not urls:
            raise InvalidRequest("--engine-url needs at least one URL")
        self.replicas = [Replica(u.rstrip("/")) for u in urls]
        self._lock = threading.Lock()

    def pick(self, key: str, exclude: frozenset[str] = frozenset()) -> Replica | None:
        """The healthy, undrained replica `key` hashes to (None if there is none). Draining
        replicas are used only when nothing else is healthy."""
        with self._lock:
            ready = [r for r in self.replicas if r.healthy and r.url not in exclude]
            pool = [r for r in ready if not r.draining] or ready
            if not pool:
                return None
            best = max(pool, key=lambda r: score(key, r.url))
            best.in_flight += 1
            return best

    def done(self, replica: Replica, ok: bool, error: str | None = None) -> None:
        """A turn on `replica` ended; a failure marks it down until a health check passes."""
        with self._lock:
            replica.in_flight -= 1
            replica.served += 1
            if not ok:
                replica.failures += 1
                self._down(replica, error or "failed")

    def mark_down(self, replica: Replica, error: str) -> None:
        with self._lock:
            self._down(replica, error)

    def set_health(self, replica: Replica, healthy: bool, error: str | None = None) -> None:
        with self._lock:
            if healthy and not replica.healthy:
                log.info("replica %s is healthy again", replica.url)
                replica.healthy, replica.down_since = True, None
            elif not healthy:
                self._down(replica, error or "health check failed")

    def drain(self, url: str, draining: bool = True) -> None:
        """Move new turns off `url` (sessions re-hash to the others) or back on."""
        with self._lock:
            match = [r for r in self.replicas if r.url == url.rstrip("/")]
            if not match:
                raise InvalidRequest(f"no replica {url!r}; known: {[r.url for r in self.replicas]}")
            match[0].draining = draining

    def stats(self) -> tuple[ReplicaStats, ...]:
        with self._lock:
            return tuple(
                ReplicaStats(
                    r.url,
                    r.healthy,
                    r.draining,
                    r.served,
                    r.failures,
                    r.in_flight,
                    r.last_error,
                    dict(r.upstream),
                )
                for r in self.replicas
            )

    def any_healthy(self) -> bool:
        with self._lock:
            return any(r.healthy for r in self.replicas)

    def _down(self, replica: Replica, error: str) -> None:
        """Mark it down; `last_error` keeps what took it down, not the checks that followed."""
        if replica.healthy:
            log.warning("replica %s marked down: %s", replica.url, error)
            replica.down_since = time.monotonic()
            replica.last_error = f"{time.strftime('%H:%M:%S')} {error}"
        replica.healthy = False


async def probe(client: httpx.AsyncClient, router: Router, replica: Replica) -> None:
    """One health check (`GET /health`) and, if healthy, one read of `GET /metrics`."""
    try:
        r = await client.get(f"{replica.url}/health", timeout=2.0)
        healthy = r.status_code == 200
        router.set_health(replica, healthy, None if healthy else f"/health said {r.status_code}")
    except httpx.HTTPError as e:
        router.set_health(replica, False, f"/health: {type(e).__name__}: {e}")
        return
    if not healthy:
        return
    try:
        r = await client.get(f"{replica.url}/metrics", timeout=2.0)
        if r.status_code == 200:
            replica.upstream = parse_metrics(r.text)  # one assignment: readers see old or new
    except (httpx.HTTPError, ValueError) as e:  # no /metrics (llama-server without --metrics)
        log.debug("metrics of %s unreadable: %s", replica.url, e)
