"""Prometheus metrics, read from the engine and the session manager at scrape time."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine import Backend
from engine.metrics import Histogram
from sessions import SessionManager, SessionState

log = logging.getLogger(__name__)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"crowdchat_{name}", doc, value=value)


def _counter_by(name: str, doc: str, label: str, values: dict[str, float]) -> CounterMetricFamily:
    """One counter per `label` value, in label order."""
    family = CounterMetricFamily(f"crowdchat_{name}", doc, labels=[label])
    for key, n in sorted(values.items()):
        family.add_metric([key], n)
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"crowdchat_{name}", doc, value=value)


def _histogram(name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
    return HistogramMetricFamily(
        f"crowdchat_{name}", doc, buckets=hist.cumulative(), sum_value=hist.sum
    )


def _served(rows: tuple[tuple[str, int, int], ...]) -> CounterMetricFamily:
    """Tokens computed per user: the most served ones by hashed label, the rest as 'other'."""
    served = CounterMetricFamily(
        "crowdchat_served_tokens",
        "Tokens computed per user (top 10 by a hash of the identity, the rest as 'other')",
        labels=["owner", "kind"],
    )
    for label, prompt, generated in rows:
        served.add_metric([label, "prompt"], prompt)
        served.add_metric([label, "generated"], generated)
    return served


class CrowdchatCollector(Collector):
    """Reads the engine's stats and histograms and the sessions' states on every scrape, so
    the numbers are never a second copy that could drift from the engine's own."""

    def __init__(self, engine: Backend, sessions: SessionManager) -> None:
        self.engine = engine
        self.sessions = sessions

    def collect(self) -> Iterator[Metric]:
        s = self.engine.stats()
        yield _counter(
            "requests_finished", "Requests that ended (stop, length, cancel)", s.requests_finished
        )
        yield _counter("requests_failed", "Requests that ended with an error", s.requests_failed)
        yield _counter(
            "requests_rejected", "Requests refused because the queue was full", s.requests_rejected
        )
        yield _counter("prompt_tokens", "Prompt tokens prefilled", s.prompt_tokens_total)
        yield _counter("generated_tokens", "Tokens generated", s.generated_tokens_total)
        yield _counter("preemptions", "Running requests preempted for KV space", s.preemptions)
        yield _gauge("running_requests", "Requests in the running batch", s.running)
        yield _gauge("queue_length", "Requests waiting to be admitted", s.waiting)
        yield _gauge("kv_blocks_used", "KV pool blocks in use", s.blocks_used)
        yield _gauge(
            "kv_blocks_cached", "Free KV blocks still holding a cached prefix", s.blocks_cached
        )
        yield _gauge("kv_blocks_shared", "KV blocks held by two or more", s.blocks_shared)
        yield _counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            s.prefix_cache_queries,
        )
        yield _counter(
            "prefix_cache_hits", "Prompt tokens whose KV was already cached", s.prefix_cache_hits
        )
        yield _gauge("kv_blocks_free", "KV pool blocks free", s.blocks_free)
        yield _gauge("kv_blocks_total", "KV pool blocks in all", s.blocks_total)
        yield _gauge(
            "tokens_per_second", "Generated tokens per second, recent window", s.tokens_per_s
        )
        if s.step_ms_p50 is not None:
            yield _gauge(
                "step_seconds_p50",
                "Median wall time of the engine's last 256 forward steps",
                s.step_ms_p50 / 1000,
            )
        yield _gauge(
            "resident_sessions", "Sessions whose KV is resident in the pool", s.resident_owners
        )
        yield _gauge(
            "engine_up", "1 while the engine thread serves, 0 once it failed", 1 if s.alive else 0
        )
        m = self.engine.metrics
        with m.lock:  # a consistent histogram: buckets and sum from the same moment
            ttft = _histogram("ttft_seconds", "Time to first token", m.ttft_hist)
            itl = _histogram("itl_seconds", "Time between generated tokens", m.itl_hist)
        yield ttft
        yield itl
        yield _served(s.served)
        yield from self._sessions()

    def _sessions(self) -> Iterator[Metric]:
        st = self.sessions.stats()
        known = [str(s) for s in SessionState]
        by_state = GaugeMetricFamily("crowdchat_sessions", "Sessions by state", labels=["state"])
        for state in (*known, *sorted(set(st.states) - set(known))):
            by_state.add_metric([state], st.states.get(state, 0))
        yield by_state
        yield _counter_by(
            "session_restores",
            "Session KV restored into the pool, by source",
            "source",
            st.restores,
        )
        yield _counter("session_persists", "Session KV snapshots written to disk", st.persists)
        yield _counter(
            "session_persist_failures",
            "Session KV snapshots that failed to write",
            st.persist_failures,
        )
        yield _counter("session_evictions", "Idle sessions moved out of a full pool", st.evictions)
        yield _counter(
            "session_recomputes", "Turns that recomputed a lost KV prefix", st.recomputes
        )
        yield _counter(
            "session_recomputes_chosen",
            "Recomputes that left a snapshot unread: recomputing was predicted faster",
            st.recomputes_chosen,
        )
        yield _counter(
            "session_restore_errors",
            "Restores that failed unexpectedly (the session recomputed)",
            st.restore_errors,
        )
        yield _gauge(
            "session_persist_backoff",
            "Sessions waiting to retry a failed snapshot write",
            len(st.persist_backoff),
        )
        yield _gauge(
            "kv_writer_up",
            "1 while the KV writer thread is healthy",
            1 if st.kv_writer_healthy else 0,
        )
        yield _counter(
            "kv_writer_restarts",
            "Times the KV writer thread crashed and restarted",
            st.kv_writer_restarts,
        )
        yield _counter_by(
            "requests_limited",
            "Requests refused by a per-user limit (tokens, turns, requests, sessions, ...)",
            "limit",
            st.refused_by,
        )


def health_problems(engine: Backend, sessions: SessionManager) -> list[str]:
    """What an operator must know is broken (empty when all is well)."""
    problems = []
    s = engine.stats()
    if not s.alive:
        problems.append(s.failure or "the engine has stopped")
    if not sessions.stats().kv_writer_healthy:
        problems.append(
            "the KV writer thread keeps crashing: evicted sessions' KV is not "
            "being written to disk (see the log)"
        )
    return problems


def build_metrics_router(engine: Backend, sessions: SessionManager) -> APIRouter:
    """GET /metrics in Prometheus text format, from a registry private to this router."""
    registry = CollectorRegistry()
    registry.register(CrowdchatCollector(engine, sessions))
    router = APIRouter()

    # A plain `def`: FastAPI runs it in its thread pool, so the engine round trip of
    # engine.stats() and the SQLite reads of sessions.stats() never block the event loop.
    @router.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @router.get("/health")
    def health() -> Response:
        """200 while every background part serves; 503 with the reasons otherwise."""
        problems = health_problems(engine, sessions)
        return JSONResponse(
            {"status": "unhealthy" if problems else "ok", "problems": problems},
            status_code=503 if problems else 200,
        )

    return router
